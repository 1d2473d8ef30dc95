"""Reference of the sparse paged attention: GQA over each row's selected tokens, gated."""

from __future__ import annotations

import torch

# Cap on the gathered K/V scratch of one chunk of rows (bytes).
GATHER_SCRATCH_BYTES = 256 << 20


def qsa_sparse_attention(
    q: torch.Tensor,
    gate: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    selection: torch.Tensor,
    *,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """out [T, Hq*D] (q.dtype) = dtype(softmax(q.k * scale) v) * sigmoid(gate), fp32 math.

    q, gate [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D] (any strides, fp8 with
    per-tensor k_scale / v_scale allowed); selection int32 [T, W + 1] with the count in the
    last column. Entries < 0 or >= the request's seq_len are ignored; a row with none left
    is exactly 0 whatever its gate holds.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    page = k_cache.shape[1]
    W = selection.shape[1] - 1
    out = torch.zeros(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out.view(T, Hq * D)
    per_row = max(1, W * Hkv * D * 4 * 2)
    chunk = max(1, GATHER_SCRATCH_BYTES // per_row)
    for i in range(0, T, chunk):
        rows = slice(i, min(T, i + chunk))
        req = token_to_req[rows].long()
        idx = selection[rows, :W].long()
        cols = torch.arange(W, device=q.device)[None, :]
        valid = (idx >= 0) & (idx < seq_lens.long()[req][:, None]) & (cols < selection[rows, W:].long())
        safe = torch.where(valid, idx, 0)
        pages = torch.where(valid, block_table.long()[req[:, None], safe // page], 0)  # no read for invalid entries
        offs = safe % page
        k = k_cache[pages, offs].float() * k_scale  # [n, W, Hkv, D]
        v = v_cache[pages, offs].float() * v_scale
        qf = q[rows].float().view(-1, Hkv, Hq // Hkv, D)
        logits = torch.einsum("nkgd,nwkd->nkgw", qf, k) * softmax_scale
        logits = logits.masked_fill(~valid[:, None, None, :], -torch.inf)
        has_any = valid.any(1)
        logits = torch.where(has_any[:, None, None, None], logits, 0.0)  # empty rows: no NaN
        probs = torch.softmax(logits, dim=-1)
        o = torch.einsum("nkgw,nwkd->nkgd", probs, v).reshape(-1, Hq, D)
        gated = o.to(q.dtype).float() * torch.sigmoid(gate[rows].float())
        out[rows] = torch.where(has_any[:, None, None], gated, 0.0).to(q.dtype)
    return out.view(T, Hq * D)
