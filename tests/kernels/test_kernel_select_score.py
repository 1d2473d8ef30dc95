"""Score kernels of selection (`select_score.py`) against `reference.select.group_scores`.

A score launch writes s(t, g) for rows with visible > Kb and columns g < visible into a
chunk's scratch and nothing else: the scratch is NaN-poisoned (wider and taller than the
chunk) and every cell the reference does not score must stay NaN. Integer-valued data
(exact in fp32, bf16 and fp8 e4m3) compares bitwise; Gaussian bf16 data within fp32
summation-order rounding. Interpreter on the CPU (small tiles: rows, tiles and spans cross
request borders); the production tiles are compiled for sm_90 here, without a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import triton
import triton.language as tl
from paged import shuffled_block_table

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core.reference import select as ref  # noqa: E402
from qsa_kernels import select as sel  # noqa: E402

import entry  # noqa: E402
from qsa_kernels import select_score as ss  # noqa: E402
from kernel_options import OPTS  # noqa: E402

DTYPE = {"int": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "randn": torch.bfloat16}


def make_problem(seq_lens, query_lens, *, kind, Hi=4, Di=32, r=4, page=16, pad_rows=0, seed=0):
    """Rows of ragged requests (the last query_lens positions of each) over shuffled pages.

    Compressed keys: a paged view [pages, page / r, Di] whose pages alternate with a NaN
    neighbour layer's, NaN wherever no request has a group. kind "int" / "bf16" / "fp8":
    integers in [-2, 2] in that dtype (exact dots); "randn": Gaussian bf16. Padding rows
    (visible 0) have NaN queries. Returns (q, compressed, block_table, token_to_req, visible).
    """
    g = torch.Generator().manual_seed(seed)
    table, num_pages = shuffled_block_table(seq_lens, page, g, spare_cols=1, spare_pages=2)
    per_page = page // r

    def values(shape):
        return torch.randn(shape, generator=g) if kind == "randn" else torch.randint(-2, 3, shape, generator=g).float()

    layers = torch.full((num_pages, 2, per_page, Di), float("nan"))
    flat = layers[:, 0].reshape(-1, Di)
    for i, s in enumerate(seq_lens):
        flat[ref.compressed_rows(table, i, s // r, page, r)] = values((s // r, Di))
    layers[:, 0] = flat.view(num_pages, per_page, Di)
    reqs, vis = [], []
    for i, (s, lq) in enumerate(zip(seq_lens, query_lens)):
        reqs += [i] * lq
        vis += [min((p + 1) // r, s // r) for p in range(s - lq, s)]
    q = values((len(reqs) + pad_rows, Hi, Di))
    q[len(reqs):] = float("nan")
    to_req = torch.tensor(reqs + [0] * pad_rows, dtype=torch.int32)
    visible = torch.tensor(vis + [0] * pad_rows, dtype=torch.int32)
    dt = DTYPE[kind]
    return (q.to(dt).to(DEV), layers.to(dt).to(DEV)[:, 0], table.to(DEV), to_req.to(DEV), visible.to(DEV))


def reference_scores(problem, rows, num_cols, Kb, *, r=4, page=16):
    """fp32 [len(rows), num_cols]: group_scores where visible > Kb and g < visible, else NaN."""
    q, comp, table, to_req, vis = (t.cpu() for t in problem)
    out = torch.full((len(rows), num_cols), float("nan"))
    for i, t in enumerate(rows):
        v = min(int(vis[t]), num_cols)
        if int(vis[t]) > Kb:
            keys = ref.paged_rows(comp, ref.compressed_rows(table, int(to_req[t]), v, page, r))
            out[i, :v] = ref.group_scores(q[t : t + 1], keys)[0]
    return out


def kernel_scores(problem, rows, num_cols, Kb, *, decode, r=4, page=16, tiles=None, rows_per_request=1,
                  rows_aligned=False):
    """The score launch of the chunk `rows` (a range) into a NaN scratch 3 rows taller and 5
    columns wider than the chunk; returns the whole scratch (fp32, CPU). tiles: override the
    schedule's choice (`score_tiles` of the plan's tiles with rows_per_request, rows_aligned)."""
    q, comp, table, to_req, vis = problem
    scratch = torch.full((len(rows) + 3, num_cols + 5), float("nan"), device=DEV)
    plan_tiles = sel.plan_select(len(rows), num_cols, Kb, decode=decode, device=DEV,
                                 rows_per_request=rows_per_request, rows_aligned=rows_aligned, options=OPTS).tiles
    launch = ss.ScoreLaunch(q, comp, table, to_req, vis, scratch, row0=rows.start, rows=len(rows), num_cols=num_cols,
                            page_size=page, compress_ratio=r, block_topk=Kb, decode=decode, tiles=plan_tiles,
                            score=tiles, options=OPTS)
    launch(q, table, rows.start)
    return scratch.cpu()


def assert_scores(got, expect, exact):
    """got: the whole scratch; expect: the chunk's reference. Cells outside the chunk, and
    cells the reference leaves NaN, must be NaN (untouched); the rest equal."""
    n, c = expect.shape
    assert got[n:].isnan().all() and got[:, c:].isnan().all(), "written outside the chunk's [rows, num_cols]"
    got = got[:n, :c]
    assert torch.equal(got.isnan(), expect.isnan()), (got.isnan() != expect.isnan()).nonzero()[:5]
    m = ~expect.isnan()
    if exact:
        assert torch.equal(got[m], expect[m])
        assert not torch.signbit(got[m]).any(), "-0.0 must fold into +0.0"
    else:
        torch.testing.assert_close(got[m], expect[m], rtol=1e-5, atol=1e-5)


# Requests of 200 / 120 / 37 / 33 tokens (Kb = 8 groups, visible 8 = 32 tokens): decode rows
# straddle Kb; prefill rows of one request cross row tiles (16) and spans (32 columns).
RAGGED = dict(seq_lens=[200, 120, 37, 33], query_lens=[2, 1, 3, 1])
PREFILL = dict(seq_lens=[150, 60, 36, 90], query_lens=[21, 60, 3, 18])


@pytest.mark.parametrize("kind", ["int", "bf16", "fp8"])
def test_decode_scores_bitwise(kind):
    problem = make_problem(**RAGGED, kind=kind, pad_rows=2, seed=1)
    rows, cols = range(0, 9), 200 // 4
    assert_scores(kernel_scores(problem, rows, cols, 8, decode=True), reference_scores(problem, rows, cols, 8), True)


# Decode rows sharing a program (rows x heads on the dot's M): MTP rows of a request, single
# rows of other requests in the same row tile.
ROWS4 = ss.ScoreTiles(block_r=4, block_g=16, span=32, stages=1, num_warps=4, pack=True)


@pytest.mark.parametrize("kind", ["int", "fp8"])
def test_decode_rows_of_a_request_share_a_program(kind):
    problem = make_problem([200, 120, 37, 90, 150], [4, 1, 3, 2, 4], kind=kind, pad_rows=2, seed=7)
    rows, cols = range(1, 16), 200 // 4
    assert ss.score_tiles(True, sel.plan_select(15, cols, 8, decode=True, device=DEV, rows_per_request=4, options=OPTS).tiles,
                          DEV == "cpu").block_r == 4  # the plan's MTP route
    assert_scores(kernel_scores(problem, rows, cols, 8, decode=True, rows_per_request=4),
                  reference_scores(problem, rows, cols, 8), True)


# A decode-only step's MTP rows (whole requests of 4 rows from row 0, then padding): a program
# scores one request's rows (`_scores_mtp_kernel`), rows x heads on the dot's M. Request 3's
# rows straddle Kb (visible 8, 8, 9, 9), request 2's are all at or below it.
@pytest.mark.parametrize("kind", ["int", "fp8"])
@pytest.mark.parametrize("first", [0, 4])
def test_request_rows_kernel_bitwise(kind, first):
    problem = make_problem([200, 120, 30, 36, 90], [4] * 5, kind=kind, pad_rows=3, seed=9)
    rows, cols = range(first, 23), 200 // 4  # 19 or 23 rows: the last program's rows run past the chunk
    plan = sel.plan_select(len(rows), cols, 8, decode=True, device=DEV, rows_per_request=4, rows_aligned=True, options=OPTS)
    assert ss.score_tiles(True, plan.tiles, DEV == "cpu").request_rows
    assert_scores(kernel_scores(problem, rows, cols, 8, decode=True, rows_per_request=4, rows_aligned=True),
                  reference_scores(problem, rows, cols, 8), True)


@pytest.mark.gpu  # compiled dots: the interpreter's fp32 dots sum in an order of their shape
def test_request_rows_and_fast_division_keep_the_one_row_kernels_bits_on_random_data():
    """Gaussian bf16 data (not exact in fp32): the request-rows kernel sums each row's heads as
    the one-row kernel does, and the Markstein division gives the IEEE quotient, bit for bit."""
    problem = make_problem([3000, 1200, 800, 2000], [4] * 4, kind="randn", Di=128, pad_rows=3, seed=11)
    rows, cols = range(0, 19), 3000 // 4
    one_row = dict(block_r=1, block_g=128, span=128, stages=3, num_warps=4)
    mtp = kernel_scores(problem, rows, cols, 8, decode=True, rows_per_request=4, rows_aligned=True)
    fast = kernel_scores(problem, rows, cols, 8, decode=True, tiles=ss.ScoreTiles(**one_row, fast_div=True))
    ieee = kernel_scores(problem, rows, cols, 8, decode=True, tiles=ss.ScoreTiles(**one_row))
    assert (~mtp.isnan()).sum() > 4000
    assert torch.equal(mtp.view(torch.int32), ieee.view(torch.int32))
    assert torch.equal(fast.view(torch.int32), ieee.view(torch.int32))


@pytest.mark.gpu  # compiled dots: fp8 data takes fp16 operands only there (the interpreter's are fp32)
@pytest.mark.parametrize("route", ["decode", "request_rows", "packed", "prefill"])
def test_fp8_scores_equal_the_scores_of_their_bf16_values(route):
    """fp8 data's dots take fp16 operands, bf16 data's bf16 ones: every e4m3 value is exact in
    both, so Gaussian fp8 data scores bit for bit as the same values in bf16 (fp32 accumulation
    either way), in every score kernel (and spans of 4 tiles for fp8 keys, 2 for bf16)."""
    decode = route != "prefill"
    problem = make_problem([3000, 1200, 800, 2000], [4] * 4 if decode else [300, 100, 50, 200], kind="randn",
                           Di=128, pad_rows=3, seed=12)
    q, comp, table, to_req, vis = problem
    as8 = (q.to(torch.float8_e4m3fn), comp.to(torch.float8_e4m3fn), table, to_req, vis)
    as16 = (as8[0].to(torch.bfloat16), as8[1].to(torch.bfloat16), table, to_req, vis)
    kw = dict(decode=decode, rows_per_request=1 if route in ("decode", "prefill") else 4,
              rows_aligned=route == "request_rows")
    got, want = (kernel_scores(p, range(0, q.shape[0]), 3000 // 4, 8, **kw) for p in (as8, as16))
    assert (~want.isnan()).sum() > 4000
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_aligned_chunks_hold_whole_requests(monkeypatch):
    monkeypatch.setattr(sel, "SCORE_SCRATCH_BYTES", 4 * 50 * 10)  # 10 rows of 50 columns a chunk
    assert sel.plan_select(24, 50, 8, decode=True, device=DEV, rows_per_request=3, rows_aligned=True, options=OPTS).chunk == 9
    assert sel.plan_select(24, 50, 8, decode=True, device=DEV, rows_per_request=3, options=OPTS).chunk == 10


@pytest.mark.parametrize("aligned, chunk_rows", [(False, 0), (True, 0), (True, 7)])
def test_mtp_decode_select_through_the_plan(monkeypatch, aligned, chunk_rows):
    """A decode select planned with rows_per_request = 4 (the MTP route; aligned: a decode-only
    step's, the request-rows kernel; chunk_rows: a score scratch of that many rows, so chunks of
    4: whole requests) chooses what the reference chooses (integer data: exact scores, ties by
    the total order)."""
    if chunk_rows:
        monkeypatch.setattr(sel, "SCORE_SCRATCH_BYTES", 4 * 50 * chunk_rows)
    problem = make_problem([200, 120, 160], [4, 4, 4], kind="int", pad_rows=4, seed=8)
    q, comp, table, to_req, vis = problem
    kw = dict(page_size=16, compress_ratio=4, block_topk=8)
    sched = sel.plan_select(q.shape[0], 200 // 4, 8, decode=True, device=DEV, rows_per_request=4,
                            rows_aligned=aligned, options=OPTS)
    assert sched.chunk == (4 if chunk_rows else q.shape[0])
    out = entry.select_decode(q, comp, table, to_req, vis, out=torch.full((q.shape[0], 8), 7, dtype=torch.int32,
                                device=DEV), schedule=sched, **kw)
    args = [t.cpu() for t in problem]
    expect = ref.qsa_select_prefill(*args, out=torch.empty(q.shape[0], 8, dtype=torch.int32), **kw)
    assert torch.equal(out.cpu(), expect)


@pytest.mark.parametrize("kind", ["int", "fp8"])
def test_prefill_scores_bitwise_requests_across_row_tiles(kind):
    problem = make_problem(**PREFILL, kind=kind, pad_rows=3, seed=2)
    # A chunk from row 5: row tiles (16 rows) start mid-request and hold up to three requests.
    rows, cols = range(5, 105), 150 // 4
    assert_scores(kernel_scores(problem, rows, cols, 8, decode=False), reference_scores(problem, rows, cols, 8), True)


WHOLE = ss.ScoreTiles(block_r=16, block_g=16, span=64, stages=1, num_warps=4, pack=True, fast_div=True, whole=True)


@pytest.mark.parametrize("kind", ["int", "randn"])
@pytest.mark.parametrize("tiles", ["small", "plan"])
def test_whole_tiles_take_the_unmasked_body_with_the_same_bits(kind, tiles):
    """Tiles that every row of a program sees whole (one request, all rows in the chunk) take
    the unmasked body (on the GPU with the plan's tiles: stored in place); the rest the masked
    one. Both give the reference's bits (int) and each other's (randn), and nothing outside the
    rows' visible columns is written."""
    problem = make_problem([600, 90, 250], [40, 10, 21], kind=kind, seed=8)
    q, comp, table, to_req, vis = problem
    rows, cols = range(0, 71), 600 // 4
    plan = sel.plan_select(len(rows), cols, 8, decode=False, device=DEV, options=OPTS).tiles
    t = WHOLE if tiles == "small" else ss.score_tiles(False, plan, DEV == "cpu", num_cols=cols)
    assert t.whole
    # the premise: some row tiles are one request's rows that all see >= one column tile
    starts = range(0, len(rows), t.block_r)
    whole = [bool((to_req[i:i + t.block_r] == to_req[i]).all()) and i + t.block_r <= len(rows)
             and int(vis[i:i + t.block_r].min()) >= t.block_g for i in starts]
    assert 0 < sum(whole) < len(whole), whole
    got = kernel_scores(problem, rows, cols, 8, decode=False, tiles=t)
    masked = kernel_scores(problem, rows, cols, 8, decode=False, tiles=dataclasses.replace(t, whole=False))
    assert torch.equal(got.nan_to_num(99.0), masked.nan_to_num(99.0))
    assert_scores(got, reference_scores(problem, rows, cols, 8), kind == "int")


@pytest.mark.parametrize("decode", [True, False])
def test_gaussian_bf16_within_rounding(decode):
    problem = make_problem([130, 70], [4, 9], kind="randn", seed=3)
    rows, cols = range(0, 13), 130 // 4
    assert_scores(kernel_scores(problem, rows, cols, 8, decode=decode), reference_scores(problem, rows, cols, 8),
                  False)


def test_num_cols_bounds_every_row():
    """A schedule's num_cols below a row's visible: columns >= num_cols are never written."""
    problem = make_problem([200, 96], [2, 5], kind="int", seed=4)
    rows = range(0, 7)
    for decode in (True, False):
        assert_scores(kernel_scores(problem, rows, 40, 8, decode=decode), reference_scores(problem, rows, 40, 8),
                      True)


@pytest.mark.parametrize("Hi,Di", [(1, 32), (3, 24), (6, 16)])
def test_heads_and_dims(Hi, Di):
    """Fewer than 4 heads (packed on M with padding), a dim that is not a power of two, and
    more than 4 heads (one dot per head; the heads past the 4 kept ones reload q per tile)."""
    problem = make_problem([120, 64], [17, 2], kind="int", Hi=Hi, Di=Di, seed=5)
    rows, cols = range(0, 19), 120 // 4
    expect = reference_scores(problem, rows, cols, 8)
    for decode, tiles in ((True, None), (True, ROWS4), (False, None)):
        assert_scores(kernel_scores(problem, rows, cols, 8, decode=decode, tiles=tiles), expect, True)


def test_tiles_do_not_change_a_score():
    """Other tile shapes and spans (as another batch's schedule would pick) give the same bits."""
    problem = make_problem(**PREFILL, kind="int", seed=6)
    rows, cols = range(0, 102), 150 // 4
    base = kernel_scores(problem, rows, cols, 8, decode=False)
    for t in (ss.ScoreTiles(block_r=32, block_g=16, span=16, stages=1, num_warps=4, pack=True),
              ss.ScoreTiles(block_r=16, block_g=32, span=96, stages=1, num_warps=4, pack=False),
              ss.ScoreTiles(block_r=16, block_g=16, span=32, stages=1, num_warps=4, pack=False),
              ss.ScoreTiles(block_r=16, block_g=16, span=32, stages=1, num_warps=4, pack=True),
              ss.ScoreTiles(block_r=32, block_g=32, span=32, stages=1, num_warps=4, pack=True, fast_div=True)):
        assert torch.equal(kernel_scores(problem, rows, cols, 8, decode=False, tiles=t).nan_to_num(99.0),
                           base.nan_to_num(99.0))


def test_span_must_be_whole_tiles():
    problem = make_problem([100], [1], kind="int")
    with pytest.raises(ValueError, match="span 24 must be a multiple of block_g 16"):
        kernel_scores(problem, range(0, 1), 25, 8, decode=True,
                      tiles=ss.ScoreTiles(block_r=1, block_g=16, span=24, stages=1, num_warps=4))


def test_auto_span_keeps_programs_and_whole_tiles():
    t = ss.ScoreTiles(block_r=1, block_g=128, span=0, stages=3, num_warps=4)
    assert ss._span(t, 4, 1 << 18) == 1024  # 1M context, 4 rows: 1024 programs of 8 tiles
    assert ss._span(t, 4, 1 << 15) == 128  # few rows, short context: one tile per program
    assert ss._span(t, 64, 1 << 15) == 2048
    assert ss._span(t, 10**6, 1 << 20) == 32 * 128  # at most 32 tiles per program
    # decode rows: up to 2 tiles (bf16 keys) or 4 (fp8) while >= 512 programs remain
    bf16, fp8 = (ss.score_tiles(True, sel.select_tiles(True), False, key_bytes) for key_bytes in (2, 1))
    assert ss._span(bf16, 4, 1 << 18) == 256 and ss._span(fp8, 4, 1 << 18) == 512  # 1M B4
    assert ss._span(bf16, 4, 1 << 15) == 256 and ss._span(fp8, 4, 1 << 15) == 256  # 128K B4: 512 programs
    assert ss._span(fp8, 2, 1 << 15) == 128 and ss._span(bf16, 1, 1 << 11) == 128  # fewer: one tile


@triton.jit
def _finish_kernel(x_ptr, out_ptr, norm, rcp, FAST: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, ss._finish_fast(x, norm, rcp) if FAST else ss._finish(x, norm))


@pytest.mark.skipif(DEV == "cpu" and not ss.INTERPRETER_FMA_FUSED,
                    reason="triton 3.6's interpreter rounds tl.fma twice (CI runs this test under triton 3.9's "
                           "interpreter, scripts/test_gpu.sh compiled on the GPU)")
@pytest.mark.parametrize("Di", [32, 64, 128, 256])
def test_fast_division_is_the_ieee_quotient(Di):
    """`_finish_fast` (Markstein) equals fp32 division by sqrt(Di) bit for bit on random fp32
    sums >= 0 of every exponent whose quotient is normal (and at the 2^-100 scaling border),
    as `_finish` does; zeros stay +0.0."""
    g = torch.Generator().manual_seed(Di)
    n = 1 << 16
    bits = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
    bits |= torch.randint(4, 255, (n,), generator=g, dtype=torch.int32) << 23  # exponent >= 2^-123
    x = bits.view(torch.float32)
    x[:6] = torch.tensor([0.0, -0.0, 2.0**-100, 2.0**-100 * (1 - 2**-24), 2.0**-122, 3.0e38])
    norm = torch.tensor(math.sqrt(Di), dtype=torch.float32)
    x = x[(x / norm >= 2.0**-126) | (x == 0)]
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEV)
    expect = (x.cpu() / norm) + 0.0
    for fast in (False, True):
        out = torch.empty_like(x)
        _finish_kernel[(1,)](x, out, float(norm), float(1 / norm), FAST=fast, N=n)
        assert torch.equal(out.cpu().view(torch.int32), expect.view(torch.int32)), fast


SM90_COMPILE = """
import triton.language as tl
from dataclasses import replace
from qsa_kernels import select as sel, select_score as ss
from sm90 import compile_sm90
# Runtime ints as a served step passes them (`sm90`: == 1 -> constant, % 16 == 0 -> divisibility).
VALUES = dict(stride_qt=512, stride_qh=128, stride_qd=1, stride_kp=4096, stride_kr=128, stride_kd=1,
              stride_btr=2048, stride_btp=1, span=256)
# row_samples: the per-row samples of the decode route from samples (QSA_DECODE_SAMPLES; one row per
# request: MTP rows take a sample launch of their own), 2^11 slots; aligned: a decode-only step's MTP
# rows (the request-rows kernel).
for decode, kdt, rows_per_request, row_samples, aligned in (
        (True, "bf16", 1, 0, False), (True, "fp8e4nv", 1, 0, False), (True, "bf16", 4, 0, False),
        (False, "bf16", 1, 0, False), (True, "bf16", 1, 11, False), (True, "bf16", 4, 0, True)):
    t = ss.score_tiles(decode, replace(sel.select_tiles(decode), rows_per_request=rows_per_request,
                                       rows_aligned=aligned), False,
                       1 if kdt.startswith("fp8") else 2)
    const = dict(HI=4, DI=128, DP=128, PAGE=64, R=4, KB=512, BLOCK_G=t.block_g, STAGES=t.stages,
                 DOT_DTYPE=tl.float16 if kdt.startswith("fp8") else tl.bfloat16, SPAN_TILES=0,
                 FAST_DIV=t.fast_div, PDL=2)
    if t.request_rows:
        fn = ss._scores_mtp_kernel
        const.update(HM=16, RPR=rows_per_request, RP=rows_per_request, KEEP=1)
    elif t.block_r == 1:
        fn = ss._scores_decode_kernel
        const.update(HM=16, ROW_SAMPLES=row_samples, LOG_G=t.block_g.bit_length() - 1, KEEP=1)
    else:
        fn = ss._scores_prefill_kernel
        const.update(BLOCK_R=t.block_r, PACK=t.pack, HP=4, FAST_DIV=t.fast_div, SAMPLE=0, WHOLE=t.whole)
    types = dict(q_ptr="*" + kdt, k_ptr="*" + kdt, s_ptr="*fp32", norm="fp32", rcp="fp32")
    k = compile_sm90(fn, const, types, VALUES, num_warps=t.num_warps, num_stages=t.stages, launch_pdl=True,
                     maxnreg=t.max_regs or (ss.SAMPLES_MAX_REGS if row_samples and t.block_r == 1
                                            and not t.request_rows else None))
    ptx = k.asm["ptx"]
    # (the dot's M: rows x heads in the decode kernels, the key tile in the packed one)
    print(decode and (t.block_r == 1 or t.request_rows),
          ptx.count("wgmma.mma_async"),
          ptx.count("mma.sync.aligned"), ptx.count("cp.async"), k.metadata.shared,
          ptx.count("L2::evict_last"))
"""


def test_prefill_tiles_widen_from_1m_context():
    # H200 (session 8): 128-column tiles won at 1M (select 35.9 -> 32.7 ms) and lost at 128K.
    prefill, decode = sel.select_tiles(False), sel.select_tiles(True)
    assert ss.score_tiles(False, prefill, False, num_cols=1 << 18).block_g == 128
    assert ss.score_tiles(False, prefill, False, num_cols=(1 << 18) - 4096).block_g == 64
    assert ss.score_tiles(True, decode, False, num_cols=1 << 18).block_g == 128  # decode: its own 128


@pytest.mark.sm90
def test_production_tiles_compile_for_sm90_on_tensor_cores():
    """The H200 tiles compile here without a GPU (what the interpreter accepts and the compiler
    rejects shows in CI), with the launcher's specialization; dots of 64+ on M (rows x heads, or
    the key tile) are wgmma, smaller ones mma, key loads asynchronous (the pipelined tile loop), shared memory
    within the H200's 227 KiB per program; also with the decode route's per-row samples; the
    decode kernels' stores with KEEP carry an L2 evict_last hint (SCORES_L2_BYTES)."""
    from sm90 import run as run_script

    run = run_script(SM90_COMPILE, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.strip().splitlines()]
    assert len(lines) == 6, run.stdout
    for small_m, wgmma, mma, cp_async, shared, keep in lines:
        assert int(mma if small_m == "True" else wgmma) > 0 and int(cp_async) > 0, lines
        assert int(shared) <= 227 * 1024, lines
        # decode scores with KEEP (and the decode kernel's samples) carry the L2 hint; prefill's none
        assert (int(keep) > 0) == (small_m == "True"), lines
