"""Decode (split-K) sparse attention against the reference: each split's partials, then the
combine kernel, or (one-launch merge) the last split of each (row, KV head) to arrive, to the
same bits. Interpreter on CPU, compiled on GPU."""

import pytest
import torch

from test_kernel_attention import attend, compare, ker, make_problem, reference


def force_splits(monkeypatch, n: int) -> None:
    monkeypatch.setattr(ker, "_num_splits", lambda *args: n)


def schedule(problem, one_launch=False):
    q, _, k, _, _, _, _, sel = problem
    T, Hq, D = q.shape
    return ker.plan_attention(T, Hq, k.shape[2], D, sel.shape[1] - 1, device=q.device, one_launch_merge=one_launch)


def run(problem, sched, **kw):
    q = problem[0]
    T, Hq, D = q.shape
    out = torch.full((T, Hq * D), 7.0, dtype=q.dtype, device=q.device)
    return ker.qsa_sparse_attention(*problem, softmax_scale=D**-0.5, out=out, schedule=sched, **kw)


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("splits", [2, 4, 7])
def test_uneven_splits_match_reference(monkeypatch, splits, one_launch):
    """A full row of W 131 is 5 blocks of 32: 2 splits of 3 and 2 blocks, 4 of 2, 2, 1, 0, and
    7 with two empty (shorter rows leave more empty). Ragged rows, -1 holes, entries >= seq_len
    and junk past the count are ignored; padding rows and a row with no valid entry are exactly 0."""
    force_splits(monkeypatch, splits)
    problem = make_problem([300, 40, 9], [1, 2, 1], Hq=24, Hkv=2, W=131, pad_rows=2, seed=splits)
    sel = problem[-1]
    sel[1, :-1] = -1  # a real row whose selection holds nothing valid (count stays)
    sel[0, 5] = 2**31 - 1  # far past seq_len and the block table's pages
    sched = schedule(problem, one_launch)
    assert sched.n_splits == splits and sched.one_launch == one_launch
    out = run(problem, sched)
    D = problem[0].shape[2]
    torch.testing.assert_close(out, reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)
    empty = torch.zeros(sel.shape[0], dtype=torch.bool, device=sel.device)
    empty[1] = True
    empty[-2:] = True
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert (out[~empty] != 0).any(1).all()


@pytest.mark.parametrize("one_launch", [False, True])
def test_replayed_call_same_bits(monkeypatch, one_launch):
    """A bound launch called again (as a CUDA-graph replay is) gives the same bits, and so
    does a fresh schedule (determinism); the one-launch merge leaves its counters zero."""
    force_splits(monkeypatch, 3)
    problem = make_problem([200, 70], [2, 1], Hq=24, Hkv=2, W=131, pad_rows=1, seed=21)
    q, gate, k, v, table, to_req, seq, sel = problem
    T, Hq, D = q.shape
    sched = schedule(problem, one_launch)
    out = torch.empty(T, Hq * D, device=q.device)
    bound = ker.AttentionLaunch(*problem, softmax_scale=D**-0.5, out=out, schedule=sched)
    runs = []
    for _ in range(3):
        out.fill_(7.0)
        bound(q, gate, table, to_req, seq, sel, out)
        runs.append(out.clone())
        assert torch.equal(sched.arrive, torch.zeros_like(sched.arrive))
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert torch.equal(runs[0], attend(*problem, softmax_scale=D**-0.5))
    torch.testing.assert_close(runs[0], reference(*problem, softmax_scale=D**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_with_scales(monkeypatch, kv_dtype):
    force_splits(monkeypatch, 3)
    problem = make_problem([150, 33], [1, 2], Hq=24, Hkv=2, W=131, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                           pad_rows=1, seed=8)
    out = compare(problem, k_scale=0.37, v_scale=1.9, tol=2e-2)
    assert torch.equal(run(problem, schedule(problem, True), k_scale=0.37, v_scale=1.9), out)


@pytest.mark.parametrize("rows,splits", [(1, 33), (4, 33), (16, 11), (64, 4), (128, 2), (129, 1)])
def test_split_count_aims_at_three_programs_per_sm(monkeypatch, rows, splits):
    """On an H200 (132 SMs), W 2051 in 64-column blocks: about 3 programs per SM over rows x 2
    KV heads, balanced, at most one block per split; one pass above 128 rows."""
    monkeypatch.setattr(ker, "_num_sms", lambda device: 132)
    assert ker._num_splits(rows, 2, 2051, 64, torch.device("cpu")) == splits


@pytest.mark.parametrize("splits,v_scale", [(3, 1.0), (5, 1.9), (8, 1.0)])
def test_one_launch_merge_has_the_two_launch_bits(monkeypatch, splits, v_scale):
    """The last arriver's merge gives exactly the bits of the combine launch (same partials,
    same order of operations over the splits), empty splits and empty rows included; the
    arrival counters are zero after the launch."""
    force_splits(monkeypatch, splits)
    problem = make_problem([300, 40, 9], [2, 1, 1], Hq=24, Hkv=2, W=131, pad_rows=1, seed=30 + splits)
    D = problem[0].shape[2]
    sched = schedule(problem, True)
    out = run(problem, sched, v_scale=v_scale)
    assert sched.one_launch and torch.equal(sched.arrive, torch.zeros_like(sched.arrive))
    two = schedule(problem)
    assert not two.one_launch
    assert len(ker.AttentionLaunch(*problem, softmax_scale=1.0, out=out, schedule=two)._launches) == 2  # + combine
    assert len(ker.AttentionLaunch(*problem, softmax_scale=1.0, out=out, schedule=sched)._launches) == 1
    assert torch.equal(out, run(problem, two, v_scale=v_scale))
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
        sched = ker.plan_attention(T, Hq, 2, D, sel.shape[1] - 1, device=q.device, partials=ws, one_launch_merge=True)
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


def test_one_launch_merge_off_by_default(monkeypatch):
    """QSA_ONE_LAUNCH_MERGE=1 switches it on (read when a planner is made); unset, or for a
    one-pass schedule, the combine route (nothing unmeasured is the default)."""
    monkeypatch.delenv("QSA_ONE_LAUNCH_MERGE", raising=False)
    assert not ker.one_launch_merge_enabled()
    assert not ker.plan_attention(4, 24, 2, 32, 2051, device="cpu").one_launch
    monkeypatch.setenv("QSA_ONE_LAUNCH_MERGE", "1")
    assert ker.one_launch_merge_enabled()
    assert not ker.plan_attention(200, 24, 2, 32, 2051, device="cpu", one_launch_merge=True).one_launch
