"""The per-row-samples decode route (`KernelOptions.decode_samples`; QSA_DECODE_SAMPLES) against
main's decode route and the reference, bit for bit.

Runs on the GPU when there is one, else in the Triton interpreter (small tiles: score tiles of
16 columns, so per-row strides of 1..16 columns and 2^5 sample slots at Kb = 8; segments of 64
columns, 32 candidates per row, 128 in the second resolve tier from 256 columns). The decode
score launch writes each row's samples at a stride of its own (`select_score.sample_shift`), so
the shapes mix in one batch: rows of several strides in one plan (a short row of a long plan
keeps one sample per column), rows at or below Kb, padding rows, MTP rows (rows x heads packed
on the dot's M), ties (integer data), ReLU zeros (a row whose every score is 0: bound 0, the
exact whole-row resolve), overflowing candidate lists (the second tier, the whole-row resolve),
the packed rows.
"""

import os
from dataclasses import replace

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernel_select import make_problem  # noqa: E402
from test_negative_zero_ties import InjectedScores  # noqa: E402

from qsa_core import QSAOptions  # noqa: E402
from qsa_core.reference import select as ref  # noqa: E402
from qsa_kernels import select as ker  # noqa: E402
from qsa_kernels import select_prefill as sp  # noqa: E402
from qsa_kernels.select_score import ScoreLaunch  # noqa: E402
from kernel_options import OPTS  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from qsa_kernels.select_common import samples_bound  # noqa: E402

ON, OFF = replace(OPTS, decode_samples=True), replace(OPTS, decode_samples=False)

# The shapes below take the route with the interpreter's small tiles only (the H200's short
# route covers them): on the GPU, benchmarks/device/dsamp_measure.sh at 7bb3f93 checks the real shapes.
small_tiles = pytest.mark.interpreter  # (its small tiles: tests/conftest.py)
R, KB, PAGE = 4, 8, 16
KW = dict(page_size=PAGE, compress_ratio=R, block_topk=KB)


@pytest.fixture
def nan_scratch(monkeypatch):
    """Every score scratch starts NaN: a read of an unscored column would show up."""
    monkeypatch.setattr(ker, "_score_scratch", lambda rows, cols, device: torch.full(
        (rows, cols), float("nan"), device=device))


def positions(seq_lens, query_lens, pad_rows):
    """The decode rows' positions (make_problem's: the last query_lens of each request), -1 padding."""
    pos = [s - lq + j for s, lq in zip(seq_lens, query_lens) for j in range(lq)]
    return torch.tensor(pos + [-1] * pad_rows, dtype=torch.int64, device=DEV)


def select(problem, on, rpr=1, pos=None, workspace=None, calls=1, aligned=False):
    """Decode select through the plan: on = the per-row-samples route (asserted taken), else main's;
    aligned: a decode-only step's rows (MTP rows: the request-rows score kernel)."""
    q, comp, table, to_req, vis, max_seq = problem
    T = q.shape[0]
    s = ker.plan_select(T, max_seq // R, KB, decode=True, device=DEV, rows_per_request=rpr, workspace=workspace,
                        rows_aligned=aligned, options=replace(OPTS, decode_samples=on))
    assert (s.decode_samples is not None) == on
    width = KB * R + R if pos is not None else KB
    out = torch.full((T, width), 7, dtype=torch.int32, device=DEV)
    launch = ker.SelectLaunch(s, q, comp, table, to_req, vis, out, positions=pos, **KW)
    for _ in range(calls):
        out.fill_(7)
        launch(q, table, out)
    return out, s


def reference(problem):
    q, comp, table, to_req, vis, _ = problem
    args = [t.cpu() for t in (q, comp, table, to_req, vis)]
    return ref.qsa_select_prefill(*args, out=torch.empty(q.shape[0], KB, dtype=torch.int32), **KW)


# One long row (600 tokens = 150 columns: stride 8 of the plan's 256-column bound), rows of 100
# and 300 tokens (strides 1 and 4: a short row of a long plan), 140 (35 columns: stride 2), 20
# (5 columns <= Kb: unscored), padding.
MIXED = dict(seq_lens=[600, 100, 300, 20, 140, 1000], query_lens=[1, 1, 1, 1, 1, 1])
# MTP: 4 rows per request, one request crossing Kb inside its rows (visible 7..8 -> 9).
MIXED_MTP = dict(seq_lens=[600, 130, 300, 36, 1000], query_lens=[4, 4, 4, 4, 4])


@pytest.fixture(params=[0, 1], ids=["segments", "skip"])
def skip(request, monkeypatch):
    """Both compactions: whole segments, and (skip) the live runs of rows of >= 8 columns per sample."""
    tiles = sp.decode_tiles
    monkeypatch.setattr(sp, "decode_tiles", lambda *a, **k: replace(tiles(*a, **k), skip=request.param))
    return request.param


# MTP rows of a mixed step (the packed score kernel) and of a decode-only step (aligned: the
# request-rows kernel).
ROUTES = [(MIXED, 1, False), (MIXED_MTP, 4, False), (MIXED_MTP, 4, True)]
# A plan of 500 columns: its longest row takes one sample a score tile (stride 16, the score
# kernel's in-loop tile maximum), the others strides 8, 4 and 1 (read back after the tile loop).
MIXED_LONG = dict(seq_lens=[2000, 600, 300, 100, 20], query_lens=[1, 1, 1, 1, 1])


@small_tiles
@pytest.mark.parametrize("mix, rpr, aligned", ROUTES)
@pytest.mark.parametrize("kind", ["int", "bf16"])
def test_mixed_batch_equals_main_route(nan_scratch, skip, mix, rpr, aligned, kind):
    problem = make_problem(**mix, kind=kind, pad_rows=2, seed=1)
    got, s = select(problem, True, rpr, calls=2, aligned=aligned)  # twice: arrival counters left at zero
    assert s.decode_samples_tiles.row_s == 5 and s.num_cols == 250
    # `select_prefill.decode_seg`: MIXED's 8 rows take 32-column segments, MIXED_MTP's 22 the 64-column base
    seg = 32 if s.chunk <= 8 else 64
    assert s.decode_samples_tiles.seg == seg
    assert sp.seg_runs(s.num_cols, s.decode_samples_tiles, ker.decode_block_g(OPTS)) == seg // 8 * skip
    want, _ = select(problem, False, rpr)
    assert torch.equal(got, want)
    if kind == "int":
        assert torch.equal(got.cpu(), reference(problem))


@small_tiles
@pytest.mark.parametrize("mix, rpr, aligned", ROUTES)
def test_packed_rows_equal_main_route(nan_scratch, skip, mix, rpr, aligned):
    pad = 2
    problem = make_problem(**mix, kind="int", pad_rows=pad, seed=2)
    pos = positions(mix["seq_lens"], mix["query_lens"], pad)
    got, _ = select(problem, True, rpr, pos=pos, aligned=aligned)
    want, _ = select(problem, False, rpr, pos=pos)
    assert torch.equal(got, want)


def sample_shift(v: int, wbits: int, log_g: int) -> int:
    """`select_score.sample_shift` on the host."""
    return sum(v > 1 << (wbits + i) for i in range(log_g))


@small_tiles
@pytest.mark.parametrize("mix, rpr, aligned", ROUTES + [(MIXED_LONG, 1, False)])
def test_per_row_samples_of_the_score_launch_or_the_sample_launch(nan_scratch, mix, rpr, aligned):
    # One row per request: the score launch writes them; MTP rows: a launch of their own
    # (`_row_samples_kernel`, over the score scratch) after the score launch.
    problem = make_problem(**mix, kind="int", pad_rows=2, seed=3)
    q, comp, table, to_req, vis, max_seq = problem
    T = q.shape[0]
    s = ker.plan_select(T, max_seq // R, KB, decode=True, device=DEV, rows_per_request=rpr, rows_aligned=aligned,
                        options=ON)
    t = s.decode_samples_tiles
    out = torch.empty(T, KB, dtype=torch.int32, device=DEV)
    launch = ker.SelectLaunch(s, q, comp, table, to_req, vis, out, **KW)
    samples = sp.samples_view(s.decode_samples, s.chunk, s.num_cols, t, ker.decode_block_g(OPTS))
    samples.fill_(-7)
    launch._chunks[0][1](q, table, 0)  # the score launch alone
    assert t.sample_launch == (rpr > 1)
    if rpr > 1:
        assert (samples.cpu() == -7).all(), "MTP rows' score launch wrote samples"
        launch._chunks[0][2]._samples(0)
    keys = s.scores.cpu().view(torch.int32) & 0x7FFFFFFF
    got = samples.cpu()
    shifts = set()
    for r in range(T):
        v = min(int(vis[r]), s.num_cols)
        if v <= KB:
            assert (got[r] == -7).all(), r
            continue
        S = 1 << sample_shift(v, t.row_s, t.log_g)
        shifts.add(S)
        n = -(-v // S)
        assert KB < n <= 1 << t.row_s
        want = torch.stack([keys[r, i * S: min(v, i * S + S)].max() for i in range(n)])
        assert torch.equal(got[r, :n], want), (r, S)
        assert (got[r, n:] == -7).all(), r
    assert len(shifts) >= 3, shifts
    if mix is MIXED_LONG:
        assert shifts == {1, 4, 8, 1 << t.log_g}, shifts


@small_tiles
def test_segments_by_chunk_rows_and_batch_invariance(nan_scratch, skip):
    # `select_prefill.decode_seg` (the interpreter's 64 programs, 64-column base, 16-column score
    # tiles): the first row of a 150-column plan alone and in chunks of 4, 8 and 64 rows takes 16-,
    # 16-, 32- and 64-column segments (10, 10, 5 and 3 lists a row); each row selects the same groups
    # whatever its chunk, the reference's (integer data: ties; most of the 64 rows are short, so
    # that the interpreter runs few score programs).
    g = torch.Generator().manual_seed(7)
    seq_lens = [600, 440, 300, 20, 140, 600, 64, 599] + torch.randint(20, 201, (56,), generator=g).tolist()
    problem = make_problem(seq_lens, [1] * 64, kind="int", seed=7)
    q, comp, table, to_req, vis, max_seq = problem
    want = reference(problem)
    got = {}
    for rows, seg in ((1, 16), (4, 16), (8, 32), (64, 64)):
        sub = (q[:rows], comp, table, to_req[:rows], vis[:rows], max_seq)
        got[rows], s = select(sub, True)
        assert s.decode_samples_tiles.seg == seg and s.num_cols == 150, (rows, s.decode_samples_tiles)
        assert torch.equal(got[rows].cpu(), want[:rows]), rows
    for rows in (1, 4, 8):
        assert torch.equal(got[rows], got[64][:rows]), rows


@small_tiles
def test_ties_zeros_and_overflow(nan_scratch, skip):
    # Integer data, one index head: crowds of equal scores and ReLU zeros; request 1's query is
    # zero (every score 0: bound 0, all columns candidates, the whole-row resolve).
    seq_lens, qlens = [1000, 600, 300, 1000], [1, 1, 1, 1]
    problem = list(make_problem(seq_lens, qlens, Hi=1, kind="int", pad_rows=1, seed=5))
    problem[0] = problem[0].clone()
    problem[0][1] = 0
    problem = tuple(problem)
    got, s = select(problem, True)
    scores = s.scores.cpu()
    assert (scores[1, :150] == 0).all() and (scores[0, :250] == 0).float().mean() > 0.2
    assert torch.equal(got, select(problem, False)[0])
    assert torch.equal(got.cpu(), reference(problem))


@small_tiles
@pytest.mark.parametrize("copies", [1, 2])
def test_clustered_rows_resolve_in_the_second_tier_or_the_whole_row(monkeypatch, skip, copies):
    """Rows whose top scores cluster at recent columns overflow the candidate lists (cap 32): with
    at most cap2 (128) candidates, no list past its length, the last arriver resolves them from the
    lists in its cap2-wide tile (`decode_tiles` cap2), else from the scores: more than cap2
    candidates, or one 64-column segment of more candidates than its list keeps (it lost some, the
    top ones here): cap in a chunk of few rows (8), 2 cap in one of many (16: the 8 rows twice,
    `DECODE_MANY_LISTS`). The scores (NaN past visible) stand in for the score launch's; MTP rows
    (4 a request) take their samples from the route's sample launch over them. Every row equals
    the reference."""
    T, G = 8 * copies, 512
    g = torch.Generator().manual_seed(3)
    ramp = torch.arange(G, dtype=torch.float32) / G
    even = torch.arange(G) % 2 == 0
    s = torch.stack([
        ramp + torch.rand(G, generator=g),  # lists
        ramp + 0.7 * torch.rand(G, generator=g),  # tier 2
        torch.where(even, ramp, 0.0) + 0.05 * torch.rand(G, generator=g),  # tier 2, lists of up to 32
        torch.where(even & (ramp >= 200 / G), 1.0, 0.0),  # whole row: 156 tied candidates, lists of up to 32
        ramp ** 4 + 0.3 * torch.rand(G, generator=g),  # whole row: the last segment's 64
        torch.round((G / 300 * ramp + torch.rand(G, generator=g)) * 16) / 16,  # visible 300, ties: tier 2
        torch.rand(G, generator=g),  # visible 5
        torch.rand(G, generator=g),  # lists
    ]).repeat(copies, 1)
    vis = torch.tensor([G, G, G, G, G, 300, 5, G] * copies, dtype=torch.int32)
    s[torch.arange(G)[None, :] >= vis[:, None]] = float("nan")
    monkeypatch.setattr(ker, "ScoreLaunch", InjectedScores(s))
    sched = ker.plan_select(T, G, KB, decode=True, device=DEV, rows_per_request=4, options=ON)
    t = sched.decode_samples_tiles
    assert sched.route == "dsamp" and sched.chunk == T and (t.seg, t.cap, t.cap2, t.lists) == (64, 32, 128, 32 * copies)
    pages = G * R // PAGE + 1
    q, table = torch.zeros(T, 1, 16, device=DEV), torch.arange(pages, dtype=torch.int32, device=DEV)[None, :]
    out = torch.full((T, KB), 7, dtype=torch.int32, device=DEV)
    launch = ker.SelectLaunch(sched, q, torch.zeros(pages, PAGE // R, 16, device=DEV), table,
                              torch.zeros(T, dtype=torch.int32, device=DEV), vis.to(DEV), out, **KW)
    topk = launch._chunks[0][2]._topk  # the chunk's top-k launch, its second tier bound
    assert topk.values[topk.launcher.names.index("CAP2")] == t.cap2
    for _ in range(2):  # twice: arrival counters left at zero
        out.fill_(7)
        launch(q, table, out)
    assert torch.equal(out.cpu(), ref.topk_groups(s, vis, KB))
    # The tier each row took, from its list lengths (0: visible <= Kb; 1: the lists; 2: the second
    # tier; 3: the whole row), and why rows 3 and 4 took the whole row.
    segp = triton.next_power_of_2(-(-G // t.seg))
    counts = sched.decode_samples.counts[: T * segp].view(T, segp).cpu()
    lens = [counts[r, : -(-v // t.seg)] for r, v in enumerate(vis.tolist())]
    tiers = [0 if v <= KB else 1 if c.sum() <= t.cap else 2 if c.sum() <= t.cap2 and c.max() <= t.lists else 3
             for v, c in zip(vis.tolist(), lens)]
    assert tiers == [1, 2, 2, 3, 3 if copies == 1 else 2, 2, 0, 1] * copies, [c.tolist() for c in lens]
    assert lens[3].sum() > t.cap2 and lens[3].max() <= t.cap
    assert lens[4].sum() <= t.cap2 and t.cap < lens[4][-1] <= 2 * t.cap


@small_tiles
def test_the_whole_row_resolve_sweeps_the_candidates_compacted_anew(monkeypatch, skip):
    """A row past the second tier (more than cap2 candidates) whose candidates fit its list
    scratch (8 segments x 32 entries) is resolved by sweeps over them, compacted anew from its
    scores in one sweep; a row whose candidates do not fit, by sweeps over its scores. Winners
    at the row's first and last columns, ties at the threshold in every segment (the lowest
    columns win): every row equals the reference."""
    T, G = 8, 512
    g = torch.Generator().manual_seed(4)
    cols = torch.arange(G)
    fit = torch.where(cols % 3 == 0, 0.5, 0.0)  # 171 tied candidates, about 21 a segment
    fit[0], fit[G - 1], fit[200] = 0.9, 0.9, 0.8
    many = torch.where(cols % 5 != 0, 0.5, 0.0)  # 409 tied candidates
    many[G - 1] = 0.9
    s = torch.stack([fit, many] + [torch.rand(G, generator=g) for _ in range(T - 2)])
    vis = torch.full((T,), G, dtype=torch.int32)
    monkeypatch.setattr(ker, "ScoreLaunch", InjectedScores(s))
    # MTP rows (4 a request): their samples come from the route's sample launch over the scores
    sched = ker.plan_select(T, G, KB, decode=True, device=DEV, rows_per_request=4, options=ON)
    t = sched.decode_samples_tiles
    segp = triton.next_power_of_2(-(-G // t.seg))
    assert sched.route == "dsamp" and (t.seg, t.cap2, t.lists, segp) == (64, 128, 32, 8)
    pages = G * R // PAGE + 1
    q, table = torch.zeros(T, 1, 16, device=DEV), torch.arange(pages, dtype=torch.int32, device=DEV)[None, :]
    out = torch.full((T, KB), 7, dtype=torch.int32, device=DEV)
    launch = ker.SelectLaunch(sched, q, torch.zeros(pages, PAGE // R, 16, device=DEV), table,
                              torch.zeros(T, dtype=torch.int32, device=DEV), vis.to(DEV), out, **KW)
    launch(q, table, out)
    want = ref.topk_groups(s, vis, KB)
    assert torch.equal(out.cpu(), want)
    assert want[0].tolist() == [0, 3, 6, 9, 12, 15, 200, G - 1] and want[1].tolist() == [1, 2, 3, 4, 6, 7, 8, G - 1]
    totals = sched.decode_samples.counts[: T * segp].view(T, segp).sum(1).cpu()
    assert t.cap2 < totals[0] <= segp * t.lists < totals[1]


@small_tiles
@pytest.mark.parametrize("bound", [1, 2, 3])
def test_bound_launch_and_bracket_search_per_row_strides(nan_scratch, monkeypatch, bound):
    # Tile bound (`select_prefill.prefill_tiles`) on per-row sample strides: 1 / 3 the chunk's
    # bound launch, 2 / 3 the bracket search; MTP rows and skip, then ties, zeros and a row of all 0.
    tiles = sp.decode_tiles
    monkeypatch.setattr(sp, "decode_tiles", lambda *a, **k: replace(tiles(*a, **k), bound=bound, skip=bound & 1))
    problem = make_problem(**MIXED_MTP, kind="int", pad_rows=2, seed=1)
    got, s = select(problem, True, 4, calls=2)
    assert s.decode_samples_tiles.bound == bound
    assert torch.equal(got, select(problem, False, 4)[0])
    assert torch.equal(got.cpu(), reference(problem))
    problem = list(make_problem([1000, 600, 300, 1000], [1, 1, 1, 1], Hi=1, kind="int", pad_rows=1, seed=5))
    problem[0] = problem[0].clone()
    problem[0][1] = 0
    got, _ = select(tuple(problem), True)
    assert torch.equal(got.cpu(), reference(tuple(problem)))


@small_tiles
def test_the_workspace_holds_every_decode_plan_of_this_route(nan_scratch):
    cap = ker._DECODE_SAMPLES_MAX_ROWS  # rows a chunk (256)
    ws = ker.select_workspace(cap + 40, 1200 // R, KB, DEV, options=ON)
    assert ws.decode_samples is not None
    assert ker.select_workspace(cap + 40, 1200 // R, KB, DEV, options=OFF).decode_samples is None
    for rows in (1, 2, 3, 4, 8, 9, 16, 64, 65, cap, cap + 1, cap + 40):
        for cols in (16, 32, 64, 128, 256, 300):
            s = ker.plan_select(rows, cols, KB, decode=True, device=DEV, workspace=ws, options=ON)
            taken = s.decode_samples is not None
            assert taken == (rows <= cap and cols > 32 and cols > KB), (rows, cols)
            assert not taken or s.decode_samples is ws.decode_samples
    problem = make_problem(**MIXED, kind="int", pad_rows=2, seed=6)
    got, s = select(problem, True, workspace=ker.select_workspace(16, 1200 // R, KB, DEV, options=ON),
                    calls=2)
    assert torch.equal(got.cpu(), reference(problem))


@small_tiles
@pytest.mark.parametrize("aligned", [False, True], ids=["packed", "request_rows"])
def test_mtp_score_kernels_refuse_per_row_samples(aligned):
    # MTP rows take their samples from the sample launch; their score kernels write none.
    q, comp, table, to_req, vis, max_seq = make_problem(**MIXED_MTP, kind="int", pad_rows=0, seed=5)
    T = q.shape[0]
    s = ker.plan_select(T, max_seq // R, KB, decode=True, device=DEV, rows_per_request=4, rows_aligned=aligned,
                        options=ON)
    t = s.decode_samples_tiles
    samples = sp.samples_view(s.decode_samples, s.chunk, s.num_cols, t, ker.decode_block_g(OPTS))
    with pytest.raises(ValueError, match="per-row score samples need the one-row decode launch"):
        ScoreLaunch(q, comp, table, to_req, vis, s.scores, row0=0, rows=T, num_cols=s.num_cols, page_size=PAGE,
                    compress_ratio=R, block_topk=KB, decode=True, tiles=s.tiles, options=s.options,
                    samples=samples, row_samples=t.row_s)


@small_tiles
def test_the_option_is_read_when_a_schedule_is_made():
    assert ker.plan_select(4, 256, KB, decode=True, device=DEV, options=ON).decode_samples is not None
    assert ker.plan_select(4, 256, KB, decode=False, device=DEV, options=ON).decode_samples is None
    assert ker.plan_select(4, 256, KB, decode=True, device=DEV, options=OFF).decode_samples is None


def test_the_route_takes_long_decode_chunks_by_default(monkeypatch):
    # H200: faster than the radix and segment routes with one row per request (128K B4, 1M B4,
    # 128K B64; chunks of up to 256 rows) and, with their samples from a launch of their own,
    # with MTP rows (1M B4 x 4, 128K B16 x 4): BENCHMARKS.md.
    assert OPTS.decode_samples
    assert ker.select_workspace(64, 1 << 15, KB, "meta", options=OPTS).decode_samples is not None
    for rows, cols in ((4, 1 << 15), (15, 20480), (64, 1 << 18)):
        s = ker.plan_select(rows, cols, KB, decode=True, device="meta", options=OPTS)
        assert s.decode_samples is not None and not s.decode_samples_tiles.sample_launch
        s = ker.plan_select(rows * 4, cols, KB, decode=True, device="meta", rows_per_request=4, options=OPTS)
        assert s.decode_samples is not None and s.decode_samples_tiles.sample_launch
    assert ker.plan_select(256, 1 << 15, KB, decode=True, device="meta", options=OPTS).decode_samples is not None
    assert ker.plan_select(257, 1 << 15, KB, decode=True, device="meta", options=OPTS).decode_samples is None  # > 256 rows a chunk
    assert ker.select_workspace(64, 1 << 15, KB, "meta", options=OFF).decode_samples is None
    # The environment's switch (read when a planner is made): QSA_DECODE_SAMPLES.
    for raw, on in (("", True), ("auto", True), ("1", True), ("0", False)):
        monkeypatch.setenv("QSA_DECODE_SAMPLES", raw)
        assert QSAOptions.from_env().kernel.decode_samples is on
    monkeypatch.setenv("QSA_DECODE_SAMPLES", "2")
    with pytest.raises(ValueError, match=r"QSA_DECODE_SAMPLES must be one of auto, 0, 1 \(or unset\), got '2'"):
        QSAOptions.from_env()


def test_decode_segments_spread_chunks_of_few_rows():
    # `select_prefill.decode_seg` on the H200's tiles (Kb 512, 128-column score tiles): chunks of few
    # long rows take smaller segments, up to DECODE_TOPK_PROGRAMS programs and DECODE_MAX_SEGS lists
    # a row; chunks with enough rows keep the base (4096 columns up to 32768, then 8192).
    for cols, rows, seg in ((32768, 1, 1024), (32768, 4, 1024), (32768, 3, 1024), (32768, 8, 2048),
                            (32768, 16, 4096), (32768, 64, 4096), (36864, 4, 2048), (131072, 4, 4096),
                            (262144, 1, 8192), (262144, 4, 8192), (262144, 16, 8192), (8192, 16, 1024)):
        t = sp.decode_tiles(cols, 512, 128, small=False, rows=rows)
        assert (t.seg, t.block) == (seg, min(2048, seg)), (cols, rows, t)
    # Every plan: at most the base, at most DECODE_MAX_SEGS lists below it, and a segment holds
    # whole sample runs of every row's stride (`sample_shift`: the kernel's run count SEG >> shift must not be 0).
    for kb, block_g, small in ((512, 128, False), (8, 16, True)):
        for cols in [1 << i for i in range(kb.bit_length(), 19)] + list(range(8192, 1 << 18, 4096)):
            for rows in range(1, 257):
                t = sp.decode_tiles(cols, kb, block_g, small=small, rows=rows)
                base = 64 if small else 4096 if cols <= 32768 else 8192
                assert t.seg <= base and (t.seg == base or -(-cols // t.seg) <= sp.DECODE_MAX_SEGS), (cols, rows)
                assert t.seg >= 1 << sample_shift(cols, t.row_s, t.log_g), (cols, rows, t.seg)
                # programs: at least half (powers of two) of the target, of the lists' cap, of the base's
                programs = 2 * rows * -(-cols // t.seg)
                assert programs >= min(64 if small else sp.DECODE_TOPK_PROGRAMS, rows * sp.DECODE_MAX_SEGS,
                                       rows * -(-cols // base)), (cols, rows, t.seg)


def test_decode_second_tier_tiles():
    # `decode_tiles` cap2: 4 cap (4096), for rows of at least 2 cap2 columns; the lists, and so
    # the scratch, keep cap entries a segment in chunks of fewer than DECODE_BOUND_ROWS rows (8
    # warps, segments of `decode_seg`), 2 cap in chunks of more (4 warps, the base's segments).
    for cols, rows, small, warps, cap2, lists in (
            (32768, 4, False, 8, 4096, 1024), (262144, 4, False, 8, 4096, 1024), (32768, 64, False, 4, 4096, 2048),
            (262144, 64, False, 4, 4096, 2048), (8191, 4, False, 8, 0, 1024), (8192, 4, False, 8, 4096, 1024),
            (8191, 64, False, 4, 0, 1024), (262144, 15, False, 8, 4096, 1024), (262144, 16, False, 4, 4096, 2048),
            (512, 8, True, 4, 128, 32), (255, 8, True, 4, 0, 32), (512, 16, True, 4, 128, 64)):
        kb, block_g = (8, 16) if small else (512, 128)
        t = sp.decode_tiles(cols, kb, block_g, small=small, rows=rows)
        assert (t.warps, t.cap2, t.lists) == (warps, cap2, lists), (cols, rows, t)
        segp = triton.next_power_of_2(-(-cols // t.seg))
        assert sp.prefill_scratch_elems(rows, rows, cols, t, block_g)["cand_idx"] == rows * segp * lists


def test_decode_samples_density():
    # `decode_tiles` row_s (2^row_s samples a row) on the H200's tiles: at least 4 Kb (2048), and
    # samples at most one score tile (128 columns) apart, or DECODE_TIER2_SAMPLE_COLS (32) in chunks
    # with the second tier; rows of more than 4 Kb samples take the bound launch (bound 3), as
    # chunks of many rows do.
    for cols, rows, row_s, bound in ((8192, 4, 11, 2), (65536, 4, 11, 2), (65537, 4, 12, 3), (131072, 4, 12, 3),
                                     (262144, 1, 13, 3), (262144, 15, 13, 3), (262144, 16, 13, 3),
                                     (262144, 64, 13, 3), (32768, 64, 11, 3), (32768, 8, 11, 2)):
        t = sp.decode_tiles(cols, 512, 128, small=False, rows=rows)
        assert (t.row_s, t.bound) == (row_s, bound), (cols, rows, t)
    for cols in [1 << i for i in range(9, 19)] + list(range(8192, 1 << 18, 4096)):
        for rows in (1, 4, 15, 16, 64):
            t = sp.decode_tiles(cols, 512, 128, small=False, rows=rows)
            gap = sp.DECODE_TIER2_SAMPLE_COLS if t.cap2 else 128
            assert 1 << t.row_s >= 2048 and cols <= gap << t.row_s, (cols, rows, t)
            assert t.row_s == 11 or cols > gap << (t.row_s - 1), (cols, rows, t)  # the least such
            assert t.bound == (3 if rows >= sp.DECODE_BOUND_ROWS or t.row_s > 11 else 2), (cols, rows, t)
    # The interpreter's tiles keep one sample a score tile at most.
    t = sp.decode_tiles(1 << 14, 8, 16, small=True, rows=4)
    assert (t.row_s, t.bound) == (10, 2), t


@triton.jit
def _samples_bound_kernel(samp_ptr, out_ptr, KB: tl.constexpr, SBITS: tl.constexpr, SLACK: tl.constexpr,
                          N: tl.constexpr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, samples_bound(tl.load(samp_ptr + row * N + tl.arange(0, N)), KB, SBITS, SLACK))


@pytest.mark.parametrize("kind", ["random", "ties", "few"])
def test_samples_bound_slack(kind):
    # `select_common.samples_bound` with the decode tiles' slack (`decode_tiles` bslack): a lower
    # bound that at least KB samples reach and at most KB + SLACK do (or the exact one: the KB-th
    # largest sample, where ties put more above it), never above the KB-th largest sample; 0 for
    # rows of fewer than KB samples. SLACK 0 gives the KB-th largest sample itself.
    N, KB, SLACK = 256, 32, 8
    g = torch.Generator().manual_seed(11)
    if kind == "random":
        samp = torch.randint(0, 1 << 30, (16, N), generator=g, dtype=torch.int32)
    elif kind == "ties":
        samp = torch.randint(0, 40, (16, N), generator=g, dtype=torch.int32) * 1000
    else:  # fewer than KB samples (-1: empty subsets), and exactly KB
        samp = torch.full((16, N), -1, dtype=torch.int32)
        for r in range(16):
            samp[r, : 2 * r + 2] = torch.randint(0, 100, (2 * r + 2,), generator=g, dtype=torch.int32)
    bounds = {}
    for slack in (0, SLACK):
        out = torch.empty(16, dtype=torch.int32, device=DEV)
        _samples_bound_kernel[(16,)](samp.to(DEV), out, KB=KB, SBITS=2, SLACK=slack, N=N)
        bounds[slack] = out.cpu()
    for r in range(16):
        row, exact, loose = samp[r], int(bounds[0][r]), int(bounds[SLACK][r])
        if int((row >= 0).sum()) < KB:
            assert exact == loose == 0, (r, exact, loose)
            continue
        kth = int(row.sort(descending=True).values[KB - 1])
        assert exact <= kth and int((row >= exact).sum()) == int((row >= kth).sum()), (r, exact, kth)
        reach = int((row >= loose).sum())
        assert loose <= exact and KB <= reach and (reach <= KB + SLACK or loose == exact), (r, loose, reach)
    if kind == "random":  # distinct samples: the search ends early on most rows
        assert int((bounds[SLACK] < bounds[0]).sum()) >= 8, (bounds[SLACK], bounds[0])


SM90_COMPILE = """
from qsa_kernels import select_prefill as sp
from sm90 import compile_decode_topk, compile_sm90, int_divisions, usage

# 128K and 1M context; 64 rows: the bound launch; 32K x 16 rows: 1024-column segments (`decode_seg`) of
# the bound launch's chunks, 128K x 4 rows those of chunks without it
for cols, rows in ((32768, 4), (262144, 4), (262144, 64), (8192, 16)):
    t = sp.decode_tiles(cols, 512, 128, small=False, rows=rows)
    print("tiles", cols, rows, "seg", t.seg, "block", t.block, "row_s", t.row_s, "bound", t.bound)
    for packed, skip in ((False, 0), (True, 0), (True, 1)) if rows < 16 else ((True, 1),):
        # packed rows of few rows also warm the attention's bf16 K/V (warm.KV: 4 tokens x 2 heads x 2 x 256,
        # QSACacheLayout's paired pages)
        for warm in (0, 8192) if packed and rows < 16 else (0,):
            k = compile_decode_topk(cols, rows, packed, skip, warm)
            print("compiled topk", cols, packed, skip, "divisions", int_divisions(k), "warm", warm,
                  k.asm["ptx"].count("cp.async.bulk.prefetch"))
    # registers and spill stack bytes with the second resolve tier (t.cap2) and without (-1: no cuobjdump)
    u = [usage(compile_decode_topk(cols, rows, True, 1, **change)) or (-1, -1) for change in ({}, dict(cap2=0))]
    print("usage", cols, rows, t.warps, t.cap2, *u[0], *u[1])
    if t.bound & 1:
        const = dict(KB=512, BITS=t.bits, LBITS=t.lbits, S=128, SAMPP=1 << t.row_s, SBITS=t.sbits,
                     ROW_SAMPLES=t.row_s, LOG_G=t.log_g, BSLACK=t.bslack, PDL=2)
        k = compile_sm90(sp._bound_prefill_kernel, const, num_warps=t.warps, launch_pdl=True)
        print("compiled bound", cols, "divisions", int_divisions(k))
    const = dict(KB=512, WBITS=t.row_s, BLOCK=t.sblock, LOG_G=t.log_g, PDL=2)  # MTP rows' sample launch
    compile_sm90(sp._row_samples_kernel, const, dict(s_ptr="*fp32"), num_warps=4, launch_pdl=True)
    print("compiled samples", cols)
"""


@pytest.mark.sm90
def test_route_compiles_for_sm90():
    """The route's H200 top-k (per-row strides, groups and packed rows, tile skip, the second
    resolve tier; 128K and 1M context, segments of 1024 and 8192 columns), the bound launch of
    chunks of many rows and MTP rows' sample launch compile for sm_90 here without a GPU (its
    score kernels: test_kernel_select_score); the K/V warm (`warm.KV`) issues bulk L2
    prefetches, and only where bound; the top-k and the bound launch divide by no runtime value
    (a row's sample stride is a power of two: shifts)."""
    from sm90 import run as run_script

    run = run_script(SM90_COMPILE, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    segs = [x.split()[1:] for x in run.stdout.splitlines() if x.startswith("tiles")]
    # 1M x 4 rows: 8192 samples a row (`DECODE_TIER2_SAMPLE_COLS`), so a bound launch too
    assert segs == [["32768", "4", "seg", "1024", "block", "1024", "row_s", "11", "bound", "2"],
                    ["262144", "4", "seg", "8192", "block", "2048", "row_s", "13", "bound", "3"],
                    ["262144", "64", "seg", "8192", "block", "2048", "row_s", "13", "bound", "3"],
                    ["8192", "16", "seg", "1024", "block", "1024", "row_s", "11", "bound", "3"]], segs
    lines = [x for x in run.stdout.splitlines() if x.startswith("compiled")]
    assert len(lines) == 19, run.stdout
    warms = [x.split()[-3:] for x in lines if " warm " in x]
    assert len(warms) == 12 and all((w == "0") == (n == "0") for _, w, n in warms), run.stdout
    divisions = [x.split()[x.split().index("divisions") + 1] for x in lines if "divisions" in x]
    assert len(divisions) == 15 and set(divisions) == {"0"}, run.stdout
    usage = [[int(v) for v in x.split()[1:]] for x in run.stdout.splitlines() if x.startswith("usage")]
    assert [u[:4] for u in usage] == [[32768, 4, 8, 4096], [262144, 4, 8, 4096], [262144, 64, 4, 4096],
                                      [8192, 16, 4, 4096]], run.stdout
    # The 8-warp programs with the tier stay within what was timed (triton 3.6: 176 registers, from
    # 125, and 179 at 1M, which reads its bound from the bound launch; 3.9: 128); the 4-warp ones of
    # many rows take up to all 255 (3.6; 3.9: 248, from 128), two programs an SM; none spills more
    # than a few words.
    assert min(u[4] for u in usage) > 0, f"no resource usage: triton ships no cuobjdump here\n{run.stdout}"
    for _, _, warps, cap2, regs, stack, regs0, stack0 in usage:
        assert regs <= (max(regs0, 180) if warps == 8 else 255) and stack <= 32, run.stdout
