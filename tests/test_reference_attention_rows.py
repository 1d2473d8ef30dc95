"""The vectorised reference attention equals the per-row definition, however it is chunked."""

from __future__ import annotations

import pytest
import torch

from qsa_core.reference import attention as ref


def per_row(q, gate, k_cache, v_cache, table, to_req, seq_lens, sel, scale):
    """design.md §2.9 row by row: softmax over the row's valid entries (a repeated entry counts twice)."""
    T, Hq, D = q.shape
    Hkv, page = k_cache.shape[2], k_cache.shape[1]
    W = sel.shape[1] - 1
    out = torch.zeros(T, Hq, D)
    for t in range(T):
        r = int(to_req[t])
        idx = [int(i) for i in sel[t, : int(sel[t, W])] if 0 <= int(i) < int(seq_lens[r])]
        if not idx:
            continue
        pos = torch.tensor(idx)
        pages = table[r, pos // page].long()
        k = k_cache[pages, pos % page].repeat_interleave(Hq // Hkv, 1)  # [n, Hq, D]
        v = v_cache[pages, pos % page].repeat_interleave(Hq // Hkv, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[t], k) * scale, -1)
        out[t] = torch.einsum("hn,nhd->hd", p, v) * torch.sigmoid(gate[t])
    return out.view(T, Hq * D)


@pytest.mark.parametrize("scratch", [ref.SCRATCH_BYTES, 1])  # default chunks, then one row per chunk
def test_matches_per_row_definition(monkeypatch, scratch):
    monkeypatch.setattr(ref, "SCRATCH_BYTES", scratch)
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, page, W = 6, 2, 16, 8, 11
    seq_lens = torch.tensor([30, 9, 50], dtype=torch.int32)
    table = torch.randperm(24, generator=g)[:21].view(3, 7).int()
    k_cache = torch.randn(24, page, Hkv, D, generator=g)
    v_cache = torch.randn(24, page, Hkv, D, generator=g)
    to_req = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 0], dtype=torch.int32)  # the last row: padding
    T = to_req.numel()
    sel = torch.randint(-2, 55, (T, W + 1), generator=g, dtype=torch.int32)  # junk to ignore
    sel[:, W] = torch.randint(0, W + 1, (T,), generator=g)
    sel[1, :4] = torch.tensor([3, 3, 3, 7])  # duplicates count as often as listed
    sel[1, W] = 4
    sel[-1] = -1
    sel[-1, W] = 0
    q = torch.randn(T, Hq, D, generator=g)
    gate = torch.randn(T, Hq, D, generator=g)
    q[-1] = gate[-1] = float("nan")
    got = ref.qsa_sparse_attention(q, gate, k_cache, v_cache, table, to_req, seq_lens, sel, softmax_scale=0.3)
    want = per_row(q, gate, k_cache, v_cache, table, to_req, seq_lens, sel, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[-1], torch.zeros(Hq * D))
