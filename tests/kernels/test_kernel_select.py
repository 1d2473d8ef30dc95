"""Triton selection kernels against the reference (interpreter on CPU, compiled on GPU)."""

from paged import shuffled_block_table
import os

import pytest
import torch

# Small-shape tests run on the GPU when there is one, else in the Triton interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference import select as ref  # noqa: E402
from qsa_kernels import select as ker  # noqa: E402
from kernel_options import OPTS  # noqa: E402

import entry  # noqa: E402


def make_problem(
    seq_lens, query_lens, *, r=4, page=16, Hi=4, Di=32, kind="int", pad_rows=0, device=DEV, seed=0,
):
    """A ragged batch with shuffled pages. Compressed rows of groups no row may see are NaN.

    kind: "int" (integer-valued fp32, tie-heavy), "bf16", "fp8" (e4m3 keys and queries).
    The compressed keys are a paged view [pages, page / r, Di] whose pages alternate with a
    NaN neighbour layer's (page stride 2x). Returns (q_idx, compressed, block_table,
    token_to_req, visible, max_seq_len).
    """
    g = torch.Generator().manual_seed(seed)
    table, num_pages = shuffled_block_table(seq_lens, page, g, spare_cols=1, spare_pages=3)
    rows_per_page = page // r
    comp = torch.full((num_pages * rows_per_page, Di), float("nan"))
    for i, s in enumerate(seq_lens):
        rows = ref.compressed_rows(table, i, s // r, page, r)
        comp[rows] = _values(kind, (rows.numel(), Di), g)
    reqs, vis = [], []
    for i, (s, lq) in enumerate(zip(seq_lens, query_lens)):
        for j in range(lq):
            p = s - lq + j
            reqs.append(i)
            vis.append(max(0, min((p + 1) // r, s // r)))
    T = len(reqs) + pad_rows
    q = _values(kind, (T, Hi, Di), g)
    if pad_rows:
        q[-pad_rows:] = float("nan")
    token_to_req = torch.tensor(reqs + [0] * pad_rows, dtype=torch.int32)
    visible = torch.tensor(vis + [0] * pad_rows, dtype=torch.int32)
    dtype = {"int": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kind]
    both_layers = torch.full((num_pages, 2, rows_per_page, Di), float("nan"))
    both_layers[:, 0] = comp.view(num_pages, rows_per_page, Di)
    tensors = (q.to(dtype), both_layers.to(dtype), table, token_to_req, visible)
    q, both_layers, table, token_to_req, visible = (t.to(device) for t in tensors)
    return q, both_layers[:, 0], table, token_to_req, visible, max(seq_lens)


def _values(kind, shape, g):
    if kind == "int":
        return torch.randint(-2, 3, shape, generator=g).float()
    return torch.randn(shape, generator=g)


def schedule(rows, max_seq_len, r, Kb, decode, device, route, options=OPTS):
    """The plan's schedule of one select call (scratch allocated, so fixtures can poison it),
    asserted to take the top-k route `route` (`SelectSchedule.route`): a plan that moves the
    case to another route fails the test instead of testing that one."""
    sched = ker.plan_select(rows, max_seq_len // r, Kb, decode=decode, device=device, options=options)
    assert sched.route == route, (sched.route, route)
    return sched


def reference(problem, *, r=4, page=16, Kb=8, device=None):
    """The reference selection int32 [T, Kb] of `problem` (computed on `device`, by default the
    problem's; returned on the problem's)."""
    q, comp, table, to_req, vis, _ = problem
    dev = device or q.device
    args = [t.to(dev) for t in (q, comp, table, to_req, vis)]
    out = torch.empty(q.shape[0], Kb, dtype=torch.int32, device=dev)
    return ref.qsa_select_prefill(*args, out=out, page_size=page, compress_ratio=r, block_topk=Kb).to(q.device)


def run_both(problem, *, route, r=4, page=16, Kb=8, decode=False, ref_device=None, options=OPTS):
    """(kernel selection through a schedule asserted to take `route`, reference selection)."""
    q, comp, table, to_req, vis, max_seq = problem
    fn = entry.select_decode if decode else entry.select_prefill
    sched = schedule(q.shape[0], max_seq, r, Kb, decode, q.device, route, options)
    out = fn(q, comp, table, to_req, vis, out=torch.full((q.shape[0], Kb), 7, dtype=torch.int32, device=q.device),
             schedule=sched, page_size=page, compress_ratio=r, block_topk=Kb)
    return out, reference(problem, r=r, page=page, Kb=Kb, device=ref_device)


def scores_of(problem, sel, r=4, page=16):
    """Reference scores of the selected groups, sorted descending per row (fp64 host)."""
    q, comp, table, to_req, vis, _ = problem
    rows = []
    for t in range(q.shape[0]):
        idx = sel[t][sel[t] >= 0].long()
        if idx.numel() == 0:
            rows.append(torch.empty(0))
            continue
        keys = ref.paged_rows(comp, ref.compressed_rows(table, int(to_req[t]), int(vis[t]), page, r))[idx]
        rows.append(ref.group_scores(q[t : t + 1], keys)[0].double().sort(descending=True).values.cpu())
    return rows


def check_valid(sel, vis, Kb):
    """Ascending, unique, < visible, exactly min(Kb, visible) entries, -1 padded."""
    for t in range(sel.shape[0]):
        n = min(Kb, int(vis[t]))
        row = sel[t].tolist()
        assert all(x == -1 for x in row[n:]), (t, row)
        chosen = row[:n]
        assert chosen == sorted(set(chosen)) and all(0 <= x < int(vis[t]) for x in chosen), (t, row)


def assert_same_selection(problem, out, expect, kind):
    """Integer data: bitwise equal; float kinds: equal reference scores of the chosen groups."""
    if kind == "int":
        assert torch.equal(out, expect)
    else:
        for a, b in zip(scores_of(problem, out, 4, 64), scores_of(problem, expect, 4, 64)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def nan_scratch(monkeypatch):
    """Poison the score scratch: any read of an unscored column would show up."""
    def poisoned(rows, cols, device):
        return torch.full((rows, cols), float("nan"), device=device)

    monkeypatch.setattr(ker, "_score_scratch", poisoned)


@pytest.fixture
def route(request, monkeypatch):
    """The top-k route a test's schedules must take (parametrized indirectly; `schedule`
    asserts it). "fused" / "radix" make chunks that `select_radix` takes run its one program
    per row or its multi-launch passes; other routes are the plan's own for the test's shape."""
    if request.param in ("fused", "radix"):
        fused = request.param == "fused"
        monkeypatch.setattr(ker, "_FUSED_MAX_COLS", 1 << 30 if fused else 0)
        monkeypatch.setattr(ker, "_FUSED_MAX_ROWS", 1 << 30 if fused else 0)
    return request.param


def routes(*names):
    """`route` parametrized indirectly over names (the test ids)."""
    return pytest.mark.parametrize("route", names, indirect=True)


# Prefill chunks below select_prefill's shapes: select_radix's two top-k routes.
PREFILL = routes("fused", "radix")
# Decode rows of 33..4096 columns (chunks of <= 256 rows): select_topk's short route on the GPU;
# under the interpreter's small tiles (a short row holds at most 32 columns) the per-row-samples route.
MID_DECODE = "dsamp" if DEV == "cpu" else "topk-short"


# A 48-token prompt prefilled from 0 (visible crosses Kb = 8 inside it), a 30-token chunk
# of a 120-token request, short requests.
RAGGED = dict(seq_lens=[120, 48, 37, 33], query_lens=[30, 48, 3, 1])


# RAGGED's routes: prefill chunks through select_radix's two, decode rows (30 columns) through
# select_topk's short route.
RAGGED_ROUTES = pytest.mark.parametrize("decode, route", [(False, "fused"), (False, "radix"), (True, "topk-short")],
                                        indirect=["route"], ids=["prefill-fused", "prefill-radix", "decode-topk-short"])


@RAGGED_ROUTES
def test_int_ties_bitwise(nan_scratch, decode, route):
    problem = make_problem(**RAGGED, kind="int", pad_rows=3)
    out, expect = run_both(problem, decode=decode, route=route)
    assert torch.equal(out, expect)


@RAGGED_ROUTES
def test_packed_rows_equal_the_expanded_reference_groups(nan_scratch, decode, route):
    """The layer's packed selection rows, which the top-k writes itself (no expand launch), on
    each route (prefill: the fused per-row kernel and the radix passes' emit; decode:
    select_topk's short route) equal the reference expansion of the reference groups: tokens of
    the groups, the open tail, -1 padding, the count; padding rows all -1 with count 0."""
    from qsa_core.reference import qsa_expand

    r, Kb, page = 4, 8, 16
    problem = make_problem(**RAGGED, kind="int", pad_rows=3)
    q, comp, table, to_req, vis, max_seq = problem
    pos = [s - lq + j for s, lq in zip(RAGGED["seq_lens"], RAGGED["query_lens"]) for j in range(lq)] + [-1] * 3
    positions = torch.tensor(pos, dtype=torch.int64, device=q.device)
    T, W = q.shape[0], Kb * r + r - 1
    out = torch.full((T, W + 1), 7, dtype=torch.int32, device=q.device)
    sched = schedule(T, max_seq, r, Kb, decode, q.device, route)
    ker.SelectLaunch(sched, q, comp, table, to_req, vis, out, page_size=page, compress_ratio=r, block_topk=Kb,
                     positions=positions)(q, table, out)
    kw = dict(page_size=page, compress_ratio=r, block_topk=Kb)
    groups = ref.qsa_select_prefill(*(t.cpu() for t in (q, comp, table, to_req, vis)),
                                    out=torch.empty(T, Kb, dtype=torch.int32), **kw)
    want = qsa_expand(groups, positions.cpu(), vis.cpu(), compress_ratio=r, out=torch.empty(T, W + 1, dtype=torch.int32))
    assert torch.equal(out.cpu(), want)
    assert (out[-3:, :W] == -1).all() and (out[-3:, W] == 0).all()


@routes(MID_DECODE)
def test_visible_around_kb(nan_scratch, route):
    # Kb = 8, r = 4: visible 0 (padding), 7 (< Kb), 8 (== Kb), 9 (just above), and long (50 columns).
    seq_lens, qlens = [28, 32, 36, 40, 200], [1, 1, 1, 1, 1]
    problem = make_problem(seq_lens, qlens, kind="int", pad_rows=2, seed=3)
    out, expect = run_both(problem, decode=True, route=route)
    assert torch.equal(out, expect)
    assert out[0].tolist() == list(range(7)) + [-1] and out[1].tolist() == list(range(8))
    assert (out[-2:] == -1).all()


@PREFILL
def test_all_zero_scores_take_lowest_groups(nan_scratch, route):
    problem = make_problem([160], [2], kind="int")
    q, comp, *rest = problem
    problem = (torch.zeros_like(q), comp, *rest)  # every score is +0.0
    out, expect = run_both(problem, route=route)
    assert torch.equal(out, expect) and out[0].tolist() == list(range(8))


@PREFILL
def test_negative_zero_ties(nan_scratch, route):
    # -0.0 products and +0.0 products must tie: the lower group index wins.
    problem = make_problem([96], [1], kind="int", Hi=1)
    q, comp, table, to_req, vis, ms = problem
    q = torch.zeros_like(q)
    q[..., 0] = -1.0
    comp = torch.where(comp.isnan(), comp, comp.clamp(min=0.0))  # q.k in {-2, -1, -0.0}
    out, expect = run_both((q, comp, table, to_req, vis, ms), route=route)
    assert torch.equal(out, expect)


def test_prefill_chunks_hold_at_least_256_rows_past_the_cap():
    # 1M context (262144 columns): decode chunks stay under the 64 MiB cap (64 rows); prefill
    # chunks hold 256 rows (256 MiB), or every row of a shorter call.
    cols = 1 << 18
    assert ker._scored_chunk(16384, cols, True) == 64
    assert ker._scored_chunk(16384, cols, False) == 256
    assert ker._scored_chunk(100, cols, False) == 100
    assert ker._scored_chunk(16384, 1 << 15, False) == 512  # 128K: the cap's chunk, above 256


@PREFILL
def test_row_chunks_under_memory_cap(nan_scratch, route, monkeypatch):
    # A 7-row cap forces many chunks, with row tiles that do not align with them.
    problem = make_problem(**RAGGED, kind="int", pad_rows=1, seed=5)
    monkeypatch.setattr(ker, "SCORE_SCRATCH_BYTES", 7 * 4 * (RAGGED["seq_lens"][0] // 4))
    monkeypatch.setattr(ker, "PREFILL_MIN_CHUNK_ROWS", 1)
    out, expect = run_both(problem, route=route)
    assert torch.equal(out, expect)


@PREFILL
def test_non_power_of_two_heads_and_dim(nan_scratch, route):
    problem = make_problem([100, 60], [20, 5], kind="int", Hi=3, Di=24, seed=7)
    out, expect = run_both(problem, route=route)
    assert torch.equal(out, expect)


@PREFILL
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_float_kinds_by_score_values(nan_scratch, route, kind):
    problem = make_problem(**RAGGED, kind=kind, pad_rows=2, seed=11)
    out, expect = run_both(problem, route=route)
    check_valid(out, problem[4], 8)
    for a, b in zip(scores_of(problem, out), scores_of(problem, expect)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_one_workspace_serves_consecutive_calls(nan_scratch):
    """A plan's persistent scratch: histograms and arrival counters are clean again after every
    call (prefill chunks of 64 columns take select_prefill, decode rows `MID_DECODE`)."""
    ws = ker.select_workspace(max_rows=128, max_cols=64, block_topk=8, device=DEV, options=OPTS)
    for seed, decode in ((0, False), (1, True), (2, False)):
        problem = make_problem(**RAGGED, kind="int", pad_rows=2, seed=seed)
        q, comp, table, to_req, vis, ms = problem
        sched = ker.plan_select(q.shape[0], 64, 8, decode=decode, device=DEV, workspace=ws, options=OPTS)
        assert sched.route == (MID_DECODE if decode else "prefill")
        fn = entry.select_decode if decode else entry.select_prefill
        out = torch.full((q.shape[0], 8), 7, dtype=torch.int32, device=DEV)
        fn(q, comp, table, to_req, vis, page_size=16, compress_ratio=4, block_topk=8, out=out, schedule=sched)
        assert torch.equal(out, reference(problem))
        assert not ws.hist.any() and not ws.arrive.any()


@PREFILL
def test_bigger_kb_and_page(nan_scratch, route):
    problem = make_problem([300, 90], [6, 90], kind="int", page=32, seed=13)
    out, expect = run_both(problem, page=32, Kb=20, route=route)
    assert torch.equal(out, expect)


def test_empty_batch():
    problem = make_problem([40], [1], kind="int")
    q, comp, table, to_req, vis, ms = problem
    out = torch.empty(0, 8, dtype=torch.int32)
    entry.select_decode(q[:0], comp, table, to_req[:0], vis[:0], page_size=16, compress_ratio=4,
                          block_topk=8, schedule=schedule(0, ms, 4, 8, True, "cpu", "topk-short"), out=out)
    assert out.shape == (0, 8)


# ---------------------------------------------------------------- GPU, production shapes

PROD = dict(r=4, page=64, Kb=512)


def _prod_problem(seq_lens, query_lens, kind, pad_rows=0, seed=0):
    return make_problem(seq_lens, query_lens, r=4, page=64, Hi=4, Di=128, kind=kind, pad_rows=pad_rows,
                        device="cuda", seed=seed)


@pytest.mark.gpu
@routes("dsamp")
@pytest.mark.parametrize("kind", ["int", "bf16", "fp8"])
def test_gpu_decode_long(nan_scratch, route, kind):
    seq_lens = [131072, 65536, 2049, 2048, 2052, 100_000]
    problem = _prod_problem(seq_lens, [1] * len(seq_lens), kind, pad_rows=2)
    out, expect = run_both(problem, decode=True, route=route, **PROD)
    check_valid(out.cpu(), problem[4].cpu(), 512)
    assert_same_selection(problem, out, expect, kind)


@pytest.mark.gpu
@routes("dsamp")
def test_gpu_decode_1m_and_batch_invariance(nan_scratch, route):
    problem = _prod_problem([1 << 20, 4096, 131072], [4, 1, 2], "bf16", seed=1)
    q, comp, table, to_req, vis, ms = problem
    kw = dict(page_size=64, compress_ratio=4, block_topk=512)

    def run(sl):
        o = torch.empty(q[sl].shape[0], 512, dtype=torch.int32, device="cuda")
        sched = schedule(o.shape[0], ms, 4, 512, True, "cuda", route)
        return entry.select_decode(q[sl], comp, table, to_req[sl], vis[sl], out=o, schedule=sched, **kw)

    full = run(slice(None))
    assert torch.equal(full, run(slice(None)))  # deterministic across runs
    assert torch.equal(full[:4], run(slice(0, 4)))  # same rows, another batch composition
    assert torch.equal(full[4:], run(slice(4, None)))
    _, expect = run_both(problem, decode=True, route=route, **PROD)
    check_valid(full.cpu(), vis.cpu(), 512)
    for a, b in zip(scores_of(problem, full, 4, 64), scores_of(problem, expect, 4, 64)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@routes("dsamp")
@pytest.mark.parametrize("kind", ["int", "bf16"])
def test_gpu_decode_128k_segments_by_rows_batch_invariant(nan_scratch, route, kind):
    # `select_prefill.decode_seg`: at 128K a chunk of 1 or 4 rows takes 1024-column segments (32
    # a row, 128 programs at 4 rows), one of 64 rows the 4096-column base; the same rows select
    # the same groups in each (bitwise), and the reference's (integer data, crowded ties: bitwise;
    # bf16: the candidate lists, the same scores).
    seq_lens = [131072, 100_000, 65536, 40_000] + [2048 + 1000 * i for i in range(60)]
    problem = _prod_problem(seq_lens, [1] * len(seq_lens), kind, seed=6)
    q, comp, table, to_req, vis, ms = problem
    kw = dict(page_size=64, compress_ratio=4, block_topk=512)
    outs = {}
    for rows, seg in ((1, 1024), (4, 1024), (64, 4096)):
        o = torch.full((rows, 512), 7, dtype=torch.int32, device="cuda")
        sched = schedule(rows, ms, 4, 512, True, "cuda", route)
        assert sched.decode_samples_tiles.seg == seg, (rows, sched.decode_samples_tiles)
        outs[rows] = entry.select_decode(q[:rows], comp, table, to_req[:rows], vis[:rows], out=o, schedule=sched,
                                         **kw)
    assert torch.equal(outs[1], outs[4][:1]) and torch.equal(outs[4], outs[64][:4])
    _, expect = run_both(problem, decode=True, route=route, **PROD)
    check_valid(outs[64].cpu(), vis.cpu(), 512)
    assert_same_selection(problem, outs[64], expect, kind)


@pytest.mark.gpu
@routes("prefill")
@pytest.mark.parametrize("kind", ["int", "bf16"])
def test_gpu_prefill_chunked(nan_scratch, route, monkeypatch, kind):
    # A 64K-token request whose last 1024 tokens are prefilled, a fresh 3000-token prompt,
    # a short one and padding; a 16 MiB cap forces several row chunks.
    problem = _prod_problem([65536, 3000, 700], [1024, 3000, 700], kind, pad_rows=5, seed=2)
    monkeypatch.setattr(ker, "SCORE_SCRATCH_BYTES", 16 << 20)
    monkeypatch.setattr(ker, "PREFILL_MIN_CHUNK_ROWS", 1)
    out, expect = run_both(problem, route=route, **PROD)
    check_valid(out.cpu(), problem[4].cpu(), 512)
    assert_same_selection(problem, out, expect, kind)


@pytest.mark.gpu
@routes("prefill")
def test_gpu_prefill_batch_invariance(nan_scratch, route):
    problem = _prod_problem([131072, 8192], [512, 2048], "bf16", seed=4)
    q, comp, table, to_req, vis, ms = problem
    kw = dict(page_size=64, compress_ratio=4, block_topk=512)

    def run(sl):
        o = torch.empty(q[sl].shape[0], 512, dtype=torch.int32, device="cuda")
        sched = schedule(o.shape[0], ms, 4, 512, False, "cuda", route)
        return entry.select_prefill(q[sl], comp, table, to_req[sl], vis[sl], out=o, schedule=sched, **kw)

    full = run(slice(None))
    assert torch.equal(full, run(slice(None)))
    assert torch.equal(full[512:], run(slice(512, None)))
    assert torch.equal(full[100:300], run(slice(100, 300)))


def graph_replay(fn, reps=20):
    """Capture fn in a CUDA graph (after an eager warm-up); return (replayed output, us/replay)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end) * 1e3 / reps


def kernel_breakdown(fn, reps=3):
    """Per-kernel GPU time (us per call) from the torch profiler, or why it is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        rows = [(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0), e.key)
                for e in prof.key_averages()]
        return ", ".join(f"{name[:32]} {t / reps:.0f}" for t, name in sorted(rows, reverse=True)[:8] if t > 0)
    except Exception as exc:  # the profiler may be unavailable on the machine
        return f"profiler unavailable: {exc!r}"


@pytest.mark.gpu
def test_gpu_cuda_graph_and_timing(capsys):
    """Selection replays from a CUDA graph bitwise as run eagerly; prints graph-replay timings
    and a per-kernel breakdown (no assertion on speed)."""
    kw = dict(page_size=64, compress_ratio=4, block_topk=512)
    for name, seq, ql, fn, route in [
        ("decode 4x1M", [1 << 20] * 4, [1] * 4, entry.select_decode, "dsamp"),
        ("decode 64x128K", [131072] * 64, [1] * 64, entry.select_decode, "dsamp"),
        ("prefill 8K rows @128K", [131072], [8192], entry.select_prefill, "prefill"),
    ]:
        q, comp, table, to_req, vis, ms = _prod_problem(seq, ql, "bf16")
        comp = torch.nan_to_num(comp)
        o = torch.empty(q.shape[0], 512, dtype=torch.int32, device="cuda")
        sched = schedule(q.shape[0], ms, 4, 512, fn is entry.select_decode, "cuda", route)
        run = lambda: fn(q, comp, table, to_req, vis, out=o, schedule=sched, **kw)  # noqa: E731
        eager = run().clone()
        replayed, us = graph_replay(run)
        assert torch.equal(replayed, eager)
        with capsys.disabled():
            print(f"\nselect {name}: {us:.1f} us (graph replay); {kernel_breakdown(run)}")
