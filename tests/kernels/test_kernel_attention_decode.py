"""Decode (split-K) sparse attention against the reference: each split's partials, merged by
the last split of each (row, KV head) to arrive, in the same launch. Interpreter on CPU,
compiled on GPU."""

import pytest
import torch
import triton
import triton.language as tl

from test_kernel_attention import attend, compare, ker, make_problem, reference


def force_splits(monkeypatch, n: int) -> None:
    monkeypatch.setattr(ker, "_num_splits", lambda *args: n)


@triton.jit
def _two_launch_combine(
    gate_ptr, out_ptr, part_ml_ptr, part_acc_ptr, n_splits, v_scale, stride_gt, stride_gh, stride_ot,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
):
    """The merge as a separate launch did it before the merge moved into the split programs
    (main's `_combine_kernel`, verbatim): grid (rows, HQ), one head per program."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SP)
    d = tl.arange(0, DP)
    slot = (row.to(tl.int64) * HQ + head) * n_splits + sp
    m = tl.load(part_ml_ptr + slot * 2, mask=sp < n_splits, other=float("-inf"))
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=sp < n_splits, other=0.0)
    acc = tl.load(part_acc_ptr + slot[:, None] * D + d[None, :], mask=(sp < n_splits)[:, None] & (d < D)[None, :],
                  other=0.0)
    m_all = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    l_all = tl.sum(w * l, 0)
    has_any = l_all > 0.0
    o = tl.sum(w[:, None] * acc, 0) / tl.where(has_any, l_all, 1.0) * v_scale
    mask = d < D
    g_off = row.to(tl.int64) * stride_gt + head * stride_gh + d
    o_off = row.to(tl.int64) * stride_ot + head * D + d
    ker._gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask)


def two_launch_combine(sched, gate, out, v_scale=1.0):
    """out from the partials a split launch left in sched, merged by `_two_launch_combine`."""
    T, Hq, n_splits, D = sched.part_acc.shape
    DP = triton.next_power_of_2(D)
    _two_launch_combine[(T, Hq)](gate, out, sched.part_ml, sched.part_acc, n_splits, v_scale, gate.stride(0),
                                 gate.stride(1), out.stride(0), HQ=Hq, D=D, DP=DP,
                                 SP=max(2, triton.next_power_of_2(n_splits)))
    return out


def schedule(problem):
    q, _, k, _, _, _, _, sel = problem
    T, Hq, D = q.shape
    return ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device)


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


@pytest.mark.parametrize("splits,v_scale", [(3, 1.0), (5, 1.9), (8, 1.0)])
def test_one_launch_merge_has_the_two_launch_bits(monkeypatch, splits, v_scale):
    """The last arriver's merge gives exactly the bits of the separate combine launch it
    replaced (same partials, same order of operations over the splits), empty splits and
    empty rows included; the arrival counters are zero after the launch."""
    force_splits(monkeypatch, splits)
    problem = make_problem([300, 40, 9], [2, 1, 1], Hq=24, Hkv=2, W=131, pad_rows=1, seed=30 + splits)
    q, gate, k, v, table, to_req, seq, sel = problem
    T, Hq, D = q.shape
    sched = schedule(problem)
    out = torch.full((T, Hq * D), 7.0, device=q.device)
    ker.qsa_sparse_attention(*problem, softmax_scale=D**-0.5, v_scale=v_scale, out=out, schedule=sched)
    assert torch.equal(sched.arrive, torch.zeros_like(sched.arrive))
    combined = two_launch_combine(sched, gate, torch.full_like(out, 5.0), v_scale)
    assert torch.equal(out, combined)
    torch.testing.assert_close(out, reference(*problem, softmax_scale=D**-0.5, v_scale=v_scale),
                               rtol=1e-5, atol=1e-5)


def test_counters_left_zero_across_launches_and_schedules(monkeypatch):
    """Two schedules on one workspace (as a planner's steps share it), launched one after the
    other and again: each launch merges every (row, KV head) once and leaves the counters
    zero, so the next launch (or graph replay) starts clean."""
    force_splits(monkeypatch, 4)
    big = make_problem([200, 70, 33], [2, 1, 1], Hq=24, Hkv=2, W=131, seed=41)
    small = make_problem([90], [1], Hq=24, Hkv=2, W=131, seed=42)
    D = big[0].shape[2]
    ws = (torch.empty(4 * 24 * 4 * 2), torch.empty(4 * 24 * 4 * D), torch.zeros(4 * 2, dtype=torch.int32))
    ws = tuple(t.to(big[0].device) for t in ws)
    want = {}
    for name, problem in (("big", big), ("small", small), ("big", big), ("small", small)):
        q, gate, k, v, table, to_req, seq, sel = problem
        T, Hq, _ = q.shape
        sched = ker.plan_attention(T, Hq, 2, D, sel.shape[1] - 1, device=q.device, partials=ws)
        out = torch.full((T, Hq * D), 7.0, device=q.device)
        ker.qsa_sparse_attention(*problem, softmax_scale=D**-0.5, out=out, schedule=sched)
        assert torch.equal(ws[2], torch.zeros_like(ws[2]))
        if name in want:
            assert torch.equal(out, want[name])
        want[name] = out
        torch.testing.assert_close(out, reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)


def test_arrival_counters_too_few_rejected():
    with pytest.raises(ValueError, match="arrival counters"):
        ker.plan_attention(4, 24, 2, 32, 2051, device="cpu",
                           partials=(torch.empty(1 << 16), torch.empty(1 << 20), torch.zeros(7, dtype=torch.int32)))
