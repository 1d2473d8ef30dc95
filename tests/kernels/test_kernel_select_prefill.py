"""The prefill top-k from the score launch's samples (`select_prefill`) against the reference.

Runs on the GPU when there is one, else in the Triton interpreter; the top-k launches alone
take the small tiles either way (samples of at least 4 columns of score tiles of 16, segments
of 64 columns, 32 candidates per row), so the shapes below cross every path: one and several
segments (the last arriver), the resolve in the chunk's launch or deferred to a group's, the
whole-row resolve when candidates overflow, rows at or below Kb, padding rows, the packed rows. Indices exact: integer-valued data makes ties (design.md §2.7), random data score gaps.
"""

import os
from dataclasses import replace

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_kernel_select import make_problem, run_both, scores_of  # noqa: E402

from qsa_core.reference import select as ref  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_kernels import select as ker  # noqa: E402

import entry  # noqa: E402
from qsa_kernels import select_prefill as sp  # noqa: E402
from kernel_options import OPTS  # noqa: E402

# Chunks of any number of rows take the route (the GPU's plan takes it from 64).
OPTS = replace(OPTS, select_prefill_min_rows=1)

R = 4  # compress ratio
BLOCK_G = 16  # columns per score tile the samples of the top-k tests stand for


@pytest.fixture
def nan_scratch(monkeypatch):
    """Every score scratch starts NaN: a read of an unscored column would show up."""
    monkeypatch.setattr(ker, "_score_scratch", lambda rows, cols, device: torch.full(
        (rows, cols), float("nan"), device=device))


def positions_of(vis: list[int]) -> torch.Tensor:
    """A position per row with visible = (p + 1) // R (open tails of 0..R-1 tokens); -1 for
    rows that see nothing (padding)."""
    return torch.tensor([v * R - 1 + i % R if v else -1 for i, v in enumerate(vis)], dtype=torch.int64)


def samples_of(scores: torch.Tensor, vis: list[int], S: int) -> torch.Tensor:
    """What the score launch writes as samples: per row, the largest key (score bits) of each
    S columns below visible; -7 (garbage) beyond."""
    T, G = scores.shape
    n = -(-G // S)
    out = torch.full((T, n), -7, dtype=torch.int32)
    keys = scores.view(torch.int32) & 0x7FFFFFFF
    for t, v in enumerate(vis):
        for i in range(-(-v // S)):
            out[t, i] = keys[t, i * S: min(v, i * S + S)].max()
    return out


def run_topk(rows: list[torch.Tensor], num_cols: int, kb: int, *, row0: int = 0, calls: int = 1,
             packed: bool = False, poison: tuple | None = None, bounds: list | None = None,
             **tile_changes) -> torch.Tensor:
    """Kernel top-k of score rows (row i: its visible scores) in one chunk, samples as the
    score launch writes them. The scratch beyond each row's visible columns is NaN; out has
    row0 rows before the chunk (must stay -7). bounds: gets the scratch's row bounds after the
    calls (tile bound 1 / 3). poison (row, columns): scores set to +inf after
    the samples are taken (a kernel that reads them chooses them). tile_changes: of the small
    tiles."""
    T = len(rows)
    vis = [r.numel() for r in rows]
    scores = torch.full((T, num_cols), float("nan"))
    for i, r in enumerate(rows):
        scores[i, : r.numel()] = r
    tiles = replace(sp.prefill_tiles(num_cols, kb, BLOCK_G, small=True), **tile_changes)
    scratch = sp.prefill_scratch(sp.prefill_scratch_elems(T, T, num_cols, tiles, BLOCK_G), DEV)
    samples = sp.samples_view(scratch, T, num_cols, tiles, BLOCK_G)
    samples.copy_(samples_of(scores, vis, sp.sample_cols(tiles, BLOCK_G)))
    if poison is not None:
        scores[poison] = float("inf")
    vis_t = torch.tensor([0] * row0 + vis, dtype=torch.int32, device=DEV)
    pos = torch.cat([torch.full((row0,), -1, dtype=torch.int64), positions_of(vis)]).to(DEV) if packed else None
    width = kb * R + R if packed else kb
    out = torch.full((row0 + T, width), -7, dtype=torch.int32, device=DEV)
    scores = scores.to(DEV)
    launch = sp.PrefillTopkLaunch(scores, samples, vis_t, out, scratch, row0=row0, rows=T, num_cols=num_cols,
                                  block_topk=kb, tiles=tiles, score_block_g=BLOCK_G, first_row=row0, num_rows=T,
                                  chunk=T, positions=pos, compress_ratio=R, options=OPTS)
    for _ in range(calls):
        out[row0:] = -7
        launch(row0, out, out.stride(0))
    assert (out[:row0] == -7).all(), "rows before the chunk were written"
    assert (scratch.arrive == 0).all(), "arrival counters must be clean after a call"
    if bounds is not None:
        bounds.extend(scratch.bound[:T].tolist())
    return out[row0:].cpu()


def reference(rows: list[torch.Tensor], num_cols: int, kb: int, packed: bool = False) -> torch.Tensor:
    scores = torch.zeros(len(rows), num_cols)
    for i, r in enumerate(rows):
        scores[i, : r.numel()] = r
    vis = [r.numel() for r in rows]
    blocks = ref.topk_groups(scores, torch.tensor(vis, dtype=torch.int32), kb)
    if not packed:
        return blocks
    out = torch.empty(len(rows), kb * R + R, dtype=torch.int32)
    return qsa_expand(blocks, positions_of(vis), torch.tensor(vis, dtype=torch.int32), compress_ratio=R, out=out)


def distinct(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) * 10


# Small tiles: 60 columns is one segment, 300 five (the last arriver resolves).
COLS = [60, 300]


def test_small_tiles_cross_every_path():
    t = sp.prefill_tiles(300, 8, BLOCK_G, small=True)
    assert 60 <= t.seg < 300 and sp.prefill_route(300, 8, t, BLOCK_G)
    assert not sp.prefill_route(40, 8, sp.prefill_tiles(40, 8, BLOCK_G, small=True), BLOCK_G)


@pytest.mark.parametrize("num_cols, kb, packed, lbits, defer", [
    (60, 8, False, 31, 0), (300, 8, False, 31, 0), (300, 16, False, 31, 0), (300, 8, True, 31, 0),
    (300, 8, False, 12, 0), (60, 8, True, 31, 1), (300, 8, True, 31, 1), (300, 16, False, 12, 1)])
def test_random_scores(num_cols, kb, packed, lbits, defer):
    # lbits 12: a coarser bound (its 12 high key bits), more candidates, the same result;
    # defer: the resolve in its own launch after the chunk.
    rows = [distinct(num_cols, s) for s in range(3)] + [distinct(num_cols - 5, 9)]
    got = run_topk(rows, num_cols, kb, calls=2, packed=packed, lbits=lbits, defer=defer)
    assert torch.equal(got, reference(rows, num_cols, kb, packed))


@pytest.mark.parametrize("num_cols", COLS)
def test_all_equal_scores_take_the_lowest_groups(num_cols):
    # Every key equals the bound: the candidates overflow the row's 32 slots (whole-row resolve).
    rows = [torch.full((num_cols,), 1.5), torch.zeros(num_cols)]
    got = run_topk(rows, num_cols, 8)
    assert torch.equal(got, torch.arange(8, dtype=torch.int32).expand(2, 8))


@pytest.mark.parametrize("num_cols", COLS)
def test_ties_at_the_threshold_take_the_lowest_groups(num_cols):
    # 5 distinct top scores, then 12 keys tied at the threshold spread over the row, the rest below.
    g = torch.Generator().manual_seed(3)
    row = torch.rand(num_cols, generator=g)
    tie_at = torch.randperm(num_cols, generator=g)[:17]
    row[tie_at[:12]] = 2.0
    row[tie_at[12:]] = 3.0 + torch.arange(5.0)
    got = run_topk([row], num_cols, 8)
    assert torch.equal(got, reference([row], num_cols, 8))
    tied = tie_at[:12].sort().values[:3]
    assert set(got[0].tolist()) == set(tie_at[12:].tolist()) | set(tied.tolist())


def test_a_score_gap_at_the_threshold():
    # The 8 chosen keys stand a gap above the rest: exactly them, whichever segment holds them.
    num_cols = 300
    row = distinct(num_cols, 4)
    top = torch.tensor([3, 70, 71, 150, 199, 230, 280, 299])
    row[top] = 100.0 + torch.arange(8.0)
    assert run_topk([row], num_cols, 8)[0].tolist() == top.tolist()


@pytest.mark.parametrize("num_cols, packed, defer", [(60, False, 0), (300, False, 0), (200, True, 0), (200, True, 1)])
def test_crowded_candidates_overflow_to_the_exact_resolve(num_cols, packed, defer):
    # Integer scores 0..3: the bound admits every key of the top value, beyond the row's capacity
    # (defer: that row resolves from its scores in the chunk's launch, the other one later).
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 4, (num_cols,), generator=g).float() for _ in range(2)]
    rows[1][-40:] = 7.0  # the top keys crowd the last segment
    rows.append(distinct(num_cols, 8))
    got = run_topk(rows, num_cols, 16, calls=2, packed=packed, defer=defer)
    assert torch.equal(got, reference(rows, num_cols, 16, packed))


@pytest.mark.parametrize("num_cols", COLS)
def test_rows_at_or_below_kb_and_padding_rows(num_cols):
    rows = [distinct(n, n) for n in (0, 1, 7, 8, 9, num_cols)]  # 0: a padding row (visible 0)
    assert torch.equal(run_topk(rows, num_cols, 8, row0=2, packed=True), reference(rows, num_cols, 8, True))
    assert torch.equal(run_topk(rows, num_cols, 8, row0=2, packed=True, defer=0), reference(rows, num_cols, 8, True))
    got = run_topk(rows, num_cols, 8, row0=2)
    assert torch.equal(got, reference(rows, num_cols, 8))
    assert (got[0] == -1).all() and torch.equal(got[2][:7], torch.arange(7, dtype=torch.int32))


def test_negative_zero_equals_zero():
    num_cols = 300
    row = torch.zeros(num_cols)
    row[1::2] = -0.0
    row[num_cols // 2] = 1.0
    got = run_topk([row], num_cols, 8)
    assert torch.equal(got[0], torch.tensor(sorted([0, 1, 2, 3, 4, 5, 6, num_cols // 2]), dtype=torch.int32))


def test_batch_invariance_rows_of_different_lengths():
    num_cols = 300
    g = torch.Generator().manual_seed(11)
    rows = [torch.rand(n, generator=g) for n in (300, 9, 61, 0, 130, 200)]
    rows[4][::3] = 0.5  # ties in one row only
    together = run_topk(rows, num_cols, 8)
    assert torch.equal(together, reference(rows, num_cols, 8))
    for i, r in enumerate(rows):
        assert torch.equal(together[i], run_topk([r], num_cols, 8)[0]), f"row {i} depends on the batch"


@pytest.mark.parametrize("num_cols, kb, packed, defer", [(300, 8, False, 0), (300, 16, True, 1)])
def test_skip_reads_only_the_runs_that_reach_the_bound(num_cols, kb, packed, defer):
    # Tile skip: the candidate launch reads only runs whose sample reaches the bound. Row 0's
    # scores below 0.01 in columns [8, 48) (runs of at most 8 columns: whole runs far below the
    # Kb-th sample; the row does not overflow to the whole-row resolve, which reads every column)
    # turn +inf after sampling: read, they would be chosen. Ties and a crowded row too.
    assert sp.sample_cols(sp.prefill_tiles(num_cols, kb, BLOCK_G, small=True), BLOCK_G) <= 8
    g = torch.Generator().manual_seed(7)
    rows = [distinct(num_cols, 1), torch.randint(0, 3, (num_cols,), generator=g).float(), distinct(num_cols - 5, 2),
            torch.randint(0, 4, (num_cols,), generator=g).float()]
    rows[0][8:48] *= 1e-3
    rows[3][-40:] = 7.0  # crowded: the whole-row resolve
    got = run_topk(rows, num_cols, kb, calls=2, packed=packed, defer=defer, skip=1, poison=(0, slice(8, 48)))
    assert torch.equal(got, reference(rows, num_cols, kb, packed))
    with pytest.raises(AssertionError):  # (the test can fail: the route that reads every column)
        assert torch.equal(run_topk(rows[:1], num_cols, kb, skip=0, poison=(0, slice(8, 48))),
                           reference(rows[:1], num_cols, kb))


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_bound_once_per_row_or_by_the_bracket_search(bound):
    # Tile bound: 1 / 3 the chunk's bound launch writes each row's bound once (`_kth_key` / the
    # bracket search), the segment programs read it; 2 each program's own bracket search. Random
    # rows (one and several segments, deferred or not, packed), ties, a crowded row, rows at or
    # below Kb, tile skip (poisoned runs below the bound): all as the reference.
    g = torch.Generator().manual_seed(13)
    for num_cols, kb, packed, defer in [(60, 8, False, 0), (300, 8, True, 1), (300, 16, False, 0)]:
        rows = [distinct(num_cols, s) for s in range(2)] + [distinct(num_cols - 5, 9),
                                                             torch.randint(0, 4, (num_cols,), generator=g).float()]
        rows[3][-40:] = 7.0  # crowded: the whole-row resolve
        got = run_topk(rows, num_cols, kb, calls=2, packed=packed, defer=defer, bound=bound)
        assert torch.equal(got, reference(rows, num_cols, kb, packed))
    rows = [distinct(n, n) for n in (0, 1, 8, 9, 300)]
    assert torch.equal(run_topk(rows, 300, 8, row0=2, packed=True, bound=bound), reference(rows, 300, 8, True))
    row = torch.rand(300, generator=g)
    row[torch.randperm(300, generator=g)[:12]] = 2.0  # 12 keys tied at the threshold
    assert torch.equal(run_topk([row], 300, 8, bound=bound), reference([row], 300, 8))
    rows = [distinct(300, 1), distinct(300, 2)]
    rows[0][8:48] *= 1e-3
    got = run_topk(rows, 300, 8, skip=1, poison=(0, slice(8, 48)), bound=bound)
    assert torch.equal(got, reference(rows, 300, 8))


@pytest.mark.parametrize("bound", [1, 3])
def test_bound_launch_writes_the_kth_sample(bound):
    # The bound launch's value per long row: the Kb-th largest sample (bound 1: lbits 31, exact;
    # bound 3: the bracket's, or a value below it that exactly Kb samples reach). Samples with ties.
    num_cols, kb = 300, 8
    g = torch.Generator().manual_seed(17)
    rows = [distinct(num_cols, 3), torch.randint(0, 6, (num_cols,), generator=g).float(), distinct(200, 4),
            distinct(5, 5)]
    got = []
    run_topk(rows, num_cols, kb, bound=bound, bounds=got)
    S = sp.sample_cols(sp.prefill_tiles(num_cols, kb, BLOCK_G, small=True), BLOCK_G)
    for i, r in enumerate(rows[:3]):
        samp = samples_of(r[None], [r.numel()], S)[0]
        kth = int(samp.sort(descending=True).values[kb - 1])
        assert got[i] == kth or (bound == 3 and got[i] < kth and int((samp >= got[i]).sum()) == kb), (i, got[i], kth)


# -- through the plan: the score launch writes the samples ------------------------------------

def test_score_launch_writes_the_samples(nan_scratch):
    # Rows of one request cross row tiles (16) and spans; samples of columns below each row's visible.
    problem = make_problem([300, 520], [40, 24], kind="int", pad_rows=2)
    q, comp, table, to_req, vis, max_seq = problem
    T, cols = q.shape[0], max_seq // R
    s = ker.plan_select(T, cols, 8, decode=False, device=DEV, options=OPTS)
    assert s.prefill is not None and s.chunk == T
    out = torch.empty(T, 8, dtype=torch.int32, device=DEV)
    launch = ker.SelectLaunch(s, q, comp, table, to_req, vis, out, page_size=16, compress_ratio=R, block_topk=8)
    launch._chunks[0][1](q, table, 0)
    S = sp.sample_cols(s.prefill_tiles, ker.score_block_g(cols, OPTS))
    got = sp.samples_view(s.prefill, T, cols, s.prefill_tiles, ker.score_block_g(cols, OPTS)).cpu()
    scores = s.scores.cpu()
    for t in range(T):
        v = int(vis[t])
        if v > 8:
            want = samples_of(scores[t:t + 1], [v], S)[0, : -(-v // S)]
            assert torch.equal(got[t, : want.numel()], want), t


@pytest.mark.parametrize("kind", ["int", "bf16"])
def test_prefill_select_takes_this_route(nan_scratch, kind):
    # Two requests (130 and 75 columns: several segments), chunks of rows crossing Kb, padding.
    problem = make_problem([520, 300, 40], [12, 10, 3], kind=kind, pad_rows=3, seed=1)
    out, expect = run_both(problem, decode=False, route="prefill", options=OPTS)
    if kind == "int":  # exact scores: ties broken by design.md §2.7
        assert torch.equal(out, expect)
    else:  # fp32 sums in another order: the chosen groups' reference scores agree
        for a, b in zip(scores_of(problem, out, R, 16), scores_of(problem, expect, R, 16)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("defer", [0, 1])
def test_prefill_chunks_under_the_memory_cap_and_a_workspace(nan_scratch, monkeypatch, defer):
    monkeypatch.setattr(ker, "SCORE_SCRATCH_BYTES", 4 * 128 * 7)  # 7 rows per chunk
    monkeypatch.setattr(ker, "PREFILL_MIN_CHUNK_ROWS", 1)
    # defer: the lists of 2 chunks (14 rows) per resolve launch: groups of 14, 14 and a last one of 9.
    tiles = sp.prefill_tiles
    monkeypatch.setattr(sp, "prefill_tiles", lambda *a, **k: replace(tiles(*a, **k), defer=defer))
    t = sp.prefill_tiles(128, 8, ker.score_block_g(128, OPTS), small=DEV == "cpu")
    monkeypatch.setattr(sp, "CAND_BYTES", 2 * 7 * -(-128 // t.seg) * t.lists * 8)
    problem = make_problem([512, 300], [25, 12], kind="int", seed=2)
    q, comp, table, to_req, vis, max_seq = problem
    T = q.shape[0]
    ws = ker.select_workspace(T, max_seq // R, 8, DEV, options=OPTS)
    s = ker.plan_select(T, max_seq // R, 8, decode=False, device=DEV, workspace=ws, options=OPTS)
    assert s.prefill is ws.prefill and s.chunk == 7
    assert sp.defer_rows(s.chunk, T, s.num_cols, s.prefill_tiles) == (14 if defer else 7)
    kw = dict(page_size=16, compress_ratio=R, block_topk=8)
    expect = ref.qsa_select_prefill(*(t.cpu() for t in (q, comp, table, to_req, vis)),
                                    out=torch.empty(T, 8, dtype=torch.int32), **kw)
    for _ in range(2):
        out = entry.select_prefill(q, comp, table, to_req, vis, out=torch.full((T, 8), 7, dtype=torch.int32,
                                     device=DEV), schedule=s, **kw)
        assert torch.equal(out.cpu(), expect)


SM90_COMPILE = """
import triton.language as tl
from qsa_kernels import select as sel, select_prefill as sp, select_score as ss
from sm90 import compile_sm90
t = sp.prefill_tiles(32768, 512, 64, small=False)
write = dict(KB=512, BITS=t.bits, SEG=t.seg, SEGP=8, CAP=t.lists, PACKED=True, R=4, W=2051, BLOCK_W=1024,
             stride_oc=1, PDL=2)
assert t.cap2 > t.cap
topk = dict(KBP=512, LBITS=t.lbits, S=16, SAMPP=2048, BLOCK=t.block, RBLOCK=t.rblock, DEFER=t.defer,
            ROW_SAMPLES=0, LOG_G=0, BOUND_IN=0, SBITS=0, RSBITS=0, WARM_K=0, WARM_V=0, PAGE=1, BSLACK=t.bslack,
            CAP2=0, LIST=t.list_cap)
skip = dict(topk, RUNS=sp.seg_runs(32768, t, 64))
bound = dict(KB=512, BITS=t.bits, LBITS=t.lbits, S=16, SAMPP=2048, ROW_SAMPLES=0, LOG_G=0, BSLACK=t.bslack, PDL=2)
for fn, const, warps in (  # the candidate launch without and with tile skip (routed from 32768 columns),
        # with the bound read (tile bound 1 / 3) or by the bracket search (2), the bound launch (1 / 3)
        (sp._topk_prefill_kernel, dict(topk, RUNS=0, **write), t.warps),
        (sp._topk_prefill_kernel, dict(skip, **write), t.warps),
        (sp._topk_prefill_kernel, dict(skip, **write, BOUND_IN=1), t.warps),
        (sp._topk_prefill_kernel, dict(skip, **write, SBITS=t.sbits), t.warps),
        # the deferred resolve's two tiers
        (sp._resolve_prefill_kernel, dict(write, CAP=t.cap, LIST=t.lists, LO=0), t.rwarps),
        (sp._resolve_prefill_kernel, dict(write, CAP=t.cap2, LIST=t.lists, LO=t.cap), t.r2warps),
        (sp._bound_prefill_kernel, dict(bound, SBITS=0), t.warps),
        (sp._bound_prefill_kernel, dict(bound, SBITS=t.sbits), t.warps)):
    k = compile_sm90(fn, const, dict(pos_ptr="*i64", s_ptr="*fp32"), num_warps=warps,
                     maxnreg=(t.regs if fn is sp._topk_prefill_kernel else 0) or None, launch_pdl=True)
    print("topk", k.metadata.shared)
fn = ss._scores_prefill_kernel
for st, sub in [(ss.score_tiles(False, sel.select_tiles(False), False, num_cols=c), sub) for c in (1 << 15, 1 << 18) for sub in (1, 4, 16)]:
    const = dict(HI=4, DI=128, DP=128, PAGE=64, R=4, KB=512, BLOCK_G=st.block_g, STAGES=st.stages,
                 DOT_DTYPE=tl.bfloat16, SPAN_TILES=0, BLOCK_R=st.block_r, PACK=st.pack, HP=4, FAST_DIV=st.fast_div,
                 SAMPLE=sub, WHOLE=st.whole,
                 stride_qd=1, stride_kd=1, stride_btp=1, PDL=2)
    k = compile_sm90(fn, const, dict(q_ptr="*bf16", k_ptr="*bf16", s_ptr="*fp32", norm="fp32", rcp="fp32"),
                     num_warps=st.num_warps, num_stages=st.stages, launch_pdl=True, maxnreg=st.max_regs or None)
    print("score", sub, k.asm["ptx"].count("wgmma.mma_async"), k.metadata.shared)
"""


@pytest.mark.sm90
def test_production_tiles_compile_for_sm90():
    """The H200 shapes of the top-k and of the sampling score kernel compile here without a GPU
    (what the interpreter accepts and the compiler rejects shows in CI); the score kernel keeps
    its wgmma, shared memory within the H200's 227 KiB per program (64- and, from 1M context,
    128-column tiles)."""
    from sm90 import run as run_script

    run = run_script(SM90_COMPILE, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.strip().splitlines()]
    assert len(lines) == 14 and all(line[0] == "topk" for line in lines[:8]), run.stdout
    assert all(int(line[1]) <= 227 * 1024 for line in lines[:8])
    for _, _, wgmma, shared in lines[8:]:
        assert int(wgmma) > 0 and int(shared) <= 227 * 1024, lines
