"""Decode (split-K) sparse attention against the reference: each split's partials, then the
combine kernel. Interpreter on CPU, compiled on GPU."""

import pytest
import torch

from test_kernel_attention import attend, compare, ker, make_problem, reference
from kernel_options import OPTS  # noqa: E402


def force_splits(monkeypatch, n: int) -> None:
    monkeypatch.setattr(ker, "_num_splits", lambda *args: n)


def schedule(problem):
    q, _, k, _, _, _, _, sel = problem
    T, Hq, D = q.shape
    return ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device, options=OPTS)


@pytest.mark.parametrize("splits", [2, 4, 7])
def test_uneven_splits_match_reference(monkeypatch, splits):
    """A full row of W 131 is 5 blocks of 32: 2 splits of 3 and 2 blocks, 4 of 2, 2, 1, 0, and
    7 with two empty (shorter rows leave more empty). Ragged rows, -1 holes, entries >= seq_len
    and junk past the count are ignored; padding rows and a row with no valid entry are exactly 0."""
    force_splits(monkeypatch, splits)
    problem = make_problem([300, 40, 9], [1, 2, 1], Hq=24, Hkv=2, W=131, pad_rows=2, seed=splits)
    sel = problem[-1]
    sel[1, :-1] = -1  # a real row whose selection holds nothing valid (count stays)
    sel[0, 5] = 2**31 - 1  # far past seq_len and the block table's pages
    sched = schedule(problem)
    assert sched.n_splits == splits
    out = compare(problem)
    empty = torch.zeros(sel.shape[0], dtype=torch.bool, device=sel.device)
    empty[1] = True
    empty[-2:] = True
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert (out[~empty] != 0).any(1).all()


def test_replayed_call_same_bits(monkeypatch):
    """A bound launch called again (as a CUDA-graph replay is) gives the same bits, and so
    does a fresh schedule (determinism)."""
    force_splits(monkeypatch, 3)
    problem = make_problem([200, 70], [2, 1], Hq=24, Hkv=2, W=131, pad_rows=1, seed=21)
    q, gate, k, v, table, to_req, seq, sel = problem
    T, Hq, D = q.shape
    sched = schedule(problem)
    out = torch.empty(T, Hq * D, device=q.device)
    bound = ker.AttentionLaunch(*problem, softmax_scale=D**-0.5, out=out, schedule=sched)
    runs = []
    for _ in range(3):
        out.fill_(7.0)
        bound(q, gate, table, to_req, seq, sel, out)
        runs.append(out.clone())
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert torch.equal(runs[0], attend(*problem, softmax_scale=D**-0.5))
    torch.testing.assert_close(runs[0], reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_with_scales(monkeypatch, kv_dtype):
    force_splits(monkeypatch, 3)
    problem = make_problem([150, 33], [1, 2], Hq=24, Hkv=2, W=131, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                           pad_rows=1, seed=8)
    compare(problem, k_scale=0.37, v_scale=1.9, tol=2e-2)


@pytest.mark.parametrize("rows,splits", [(1, 33), (4, 33), (16, 11), (64, 4), (128, 2), (129, 1)])
def test_split_count_aims_at_three_programs_per_sm(monkeypatch, rows, splits):
    """On an H200 (132 SMs), W 2051 in 64-column blocks: about 3 programs per SM over rows x 2
    KV heads, balanced, at most one block per split; one pass above 128 rows."""
    monkeypatch.setattr(ker, "_num_sms", lambda device: 132)
    assert ker._num_splits(rows, 2, 2051, 64, torch.device("cpu")) == splits
