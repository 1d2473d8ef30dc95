"""Triton selection of short decode rows in one launch: group scores, then the exact top-k.

Contract: `select.py`'s (`qsa_core.reference.select`; SPEC 2.7: score descending, ties to the
lower group, ascending order, or the packed rows) for a decode chunk that `plan_select` gives
the short top-k (`select_topk._topk_short_kernel`) with at most 4096 columns, 64 rows and one
row per request (`select._short_fused_route`), in one launch instead of the score launch and
the top-k launch (issue 12). Off unless QSA_SHORT_FUSED=1 when the schedule is made (`enabled`), until measured on the H200
(`benchmarks/device/dshort_measure.sh`).

`_select_short_kernel`, grid: rows x spans of `span` columns. Program (row, p) scores the
row's groups [p * span, + span) below its visible count for all its heads into the chunk's
fp32 scratch [chunk rows, num_cols] (`_score_span`: the tile loop of the decode score
kernel, the same dot, ReLU, head sum and division, so the same bits), then arrives at the
row's counter (arrive int32 [chunk rows], acq_rel at gpu scope: zero between calls, the last
arriver resets it). The last of the row's cdiv(visible, span) programs to arrive reads the
row's scores back (L2) and runs the short route's top-k on them (`select_topk`'s
`_kth_bound`, then `_emit_above`, as `_topk_short_kernel`), writing the chosen groups or the
packed row. Rows with visible <= Kb take groups 0..visible-1 unscored (program 0); padding
rows (visible 0) get the empty row. MTP chunks (rows_per_request > 1) keep main's two
launches: main scores a request's rows together (rows x heads on the dot's M, the head sum
thread-local), the one-row kernel sums heads across lanes; the two may associate the four
heads differently, so a one-row score here could differ from main's in its last bit.
`ShortSelectLaunch` binds one chunk (`launch.py`).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .launch import Launcher
from .select_radix import packed_write
from .select_score import _finish, _load_keys, _relu_dot, exact_dot, score_tiles
from .select_topk import _emit_above, _kth_bound, _write_short, _write_tail


def enabled() -> bool:
    """QSA_SHORT_FUSED=1: schedules made now take this route where the short top-k would run
    (read by `plan_select`, i.e. once per schedule)."""
    return os.environ.get("QSA_SHORT_FUSED", "0") == "1"


@triton.jit
def _score_span(q_ptr, k_ptr, bt_ptr, req, row, s_row, col0, g_end, norm, stride_qt, stride_qh, stride_qd,
                stride_kp, stride_kr, stride_kd, stride_btr, stride_btp,
                HI: tl.constexpr, DI: tl.constexpr, HM: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
                R: tl.constexpr, BLOCK_G: tl.constexpr, STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr,
                SPAN_TILES: tl.constexpr):
    """Scores of one row (q [T, HI, DI], its heads padded to HM >= 16 on the dot's M) x groups
    [col0, g_end) of request req, in BLOCK_G tiles -> s_row fp32 [n_cols] (the tile loop of
    `select_score._scores_decode_kernel`). SPAN_TILES > 0 (the interpreter): that many tiles
    over constant bounds, masked at g_end."""
    h = tl.arange(0, HM)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=(h < HI)[:, None] & (d < DI)[None, :], other=0.0).to(DOT_DTYPE)
    for off in tl.range(0 if SPAN_TILES else col0, SPAN_TILES * BLOCK_G if SPAN_TILES else g_end, BLOCK_G,
                        num_stages=STAGES):
        g = (col0 + off if SPAN_TILES else off) + tl.arange(0, BLOCK_G)
        g_mask = g < g_end
        keys = _load_keys(k_ptr, bt_ptr, req, g, g_mask, d, stride_kp, stride_kr, stride_kd, stride_btr,
                          stride_btp, DI, PAGE, R, DOT_DTYPE)
        tl.store(s_row + g, _finish(tl.sum(_relu_dot(q, keys), 0), norm), mask=g_mask)


@triton.jit
def _arrive_last(arrive_ptr, lr, n_programs):
    """Whether this program is the last of n_programs to arrive at counter lr (acq_rel, gpu
    scope: every program's scores before it are visible after it); the last resets it to 0."""
    tl.debug_barrier()  # this program's score stores before its arrival
    last = tl.atomic_add(arrive_ptr + lr, 1, sem="acq_rel", scope="gpu") == n_programs - 1
    if last:
        tl.store(arrive_ptr + lr, 0)  # zero for the next call
    return last


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr"])
def _select_short_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr, arrive_ptr, out_ptr, pos_ptr,
    row0, n_cols, span, norm,
    stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr,
    stride_or, stride_oc,
    HI: tl.constexpr, DI: tl.constexpr, HM: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
    R: tl.constexpr, KB: tl.constexpr, BLOCK_G: tl.constexpr, STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr,
    SPAN_TILES: tl.constexpr, KBP: tl.constexpr, CAP: tl.constexpr, SBITS: tl.constexpr, PACKED: tl.constexpr,
    RP: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Selection of one row's span [pid1 * span, + span) (grid: chunk rows x spans): scores
    into s fp32 [chunk rows, n_cols], then, in the row's last program to arrive, its top-k
    over all CAP >= n_cols columns (`_kth_bound`, 2^SBITS counts a step) into out (int32
    [T, KB]; PACKED: the packed rows [T, W + 1] with RP tokens a group, positions pos int64 [T])."""
    lr = tl.program_id(0)
    row = row0 + lr
    col0 = tl.program_id(1) * span
    vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    if vis <= KB:
        if col0 == 0:
            _write_tail(out_row, pos_ptr, row, vis, KB, PACKED, RP, W, BLOCK_W)
            _write_short(out_row, stride_oc, vis, KB, KBP, PACKED, RP)
    elif col0 < vis:
        s_row = s_ptr + lr.to(tl.int64) * stride_sr
        _score_span(q_ptr, k_ptr, bt_ptr, tl.load(req_ptr + row), row, s_row, col0, tl.minimum(vis, col0 + span),
                    norm, stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp,
                    HI, DI, HM, DP, PAGE, R, BLOCK_G, STAGES, DOT_DTYPE, SPAN_TILES)
        if _arrive_last(arrive_ptr, lr, tl.cdiv(vis, span)):
            _write_tail(out_row, pos_ptr, row, vis, KB, PACKED, RP, W, BLOCK_W)
            cols = tl.arange(0, CAP)
            s = tl.load(s_row + cols, mask=cols < vis, other=0.0, cache_modifier=".cg")
            key = tl.where(cols < vis, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)  # (`_keys`, from L2)
            thr, n_above = _kth_bound(key, vis, KB, SBITS)
            _emit_above(key, cols, thr, n_above, out_row, stride_oc, KB, PACKED, RP)


_short = Launcher(_select_short_kernel)
_FREE = ("q_ptr", "bt_ptr", "row0", "stride_qt", "stride_qh", "stride_qd", "stride_btr", "stride_btp", "out_ptr",
         "stride_or")


# Programs of one wave on the H200: 132 SMs, one program each (16 warps of >= 103 registers:
# the top-k's, sm_90 compile with triton 3.6).
WAVE_PROGRAMS = 132


def fused_tiles(tiles: dict, rows: int, num_cols: int, key_bytes: int, topk_tiles: dict, interpret: bool) -> dict:
    """The launch shape of `rows` rows of num_cols columns from the schedule's tiles: span,
    columns per program: main's decode score span (one row per program: 128 columns for bf16
    keys, 256 for fp8), doubled while the grid exceeds one wave (`WAVE_PROGRAMS`; 8K B64: 1024
    columns, 128 programs); the interpreter: one tile, so small rows cross spans. warps: the
    short top-k's (the last arriver runs it); block_g, stages: the score tiles'. Benchmarks
    override it (`benchmarks/bench_dshort.py`)."""
    t = score_tiles(True, {**tiles, "rows_per_request": 1}, interpret, key_bytes)
    span = t.block_g if interpret else t.span
    while not interpret and span < num_cols and rows * triton.cdiv(num_cols, span) > WAVE_PROGRAMS:
        span *= 2
    return dict(span=span, block_g=t.block_g, stages=t.stages, warps=topk_tiles["warps"])


class ShortSelectLaunch:
    """The one launch of a chunk of `rows` short decode rows (from a free first row `row0`)
    bound to the compressed keys [pages, page_size / r, Di], token_to_req / visible_blocks
    int32 [T], the score scratch fp32 [>= rows, num_cols], the arrival counters int32
    [>= rows] (zero) and `out` (its dtype, column stride); `tiles`: the schedule's,
    `topk_tiles`: the short route's (`select_topk.topk_tiles`). `__call__(q_idx [T, Hi, Di], block_table, row0, out,
    out_row_stride)` launches it into out: int32 [T, Kb] or, with `positions` int64 [T]
    given, the packed selection int32 [T, W + 1] (contiguous rows). q_idx's dtype is fixed."""

    def __init__(self, q_idx: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                 token_to_req: torch.Tensor, visible_blocks: torch.Tensor, scores: torch.Tensor,
                 arrive: torch.Tensor, out: torch.Tensor, *, row0: int, rows: int, num_cols: int, page_size: int,
                 compress_ratio: int, block_topk: int, tiles: dict, topk_tiles: dict, interpret: bool,
                 positions: torch.Tensor | None = None) -> None:
        _, Hi, Di = q_idx.shape
        t = fused_tiles(tiles, rows, num_cols, compressed.element_size(), topk_tiles, interpret)
        if t["span"] % t["block_g"] or arrive.numel() < rows:
            raise ValueError(f"short select: span {t['span']} must be a multiple of block_g {t['block_g']}, "
                             f"arrive must hold {rows} counters (has {arrive.numel()})")
        write, pos = packed_write(out, positions, visible_blocks, compress_ratio)
        write = dict(PACKED=write["PACKED"], RP=write["R"], W=write["W"], BLOCK_W=write["BLOCK_W"])
        self._launch = _short.bind(
            (rows, triton.cdiv(num_cols, t["span"])), q_idx, compressed, block_table, token_to_req, visible_blocks,
            scores, arrive, out, pos, row0, num_cols, t["span"], math.sqrt(Di), *q_idx.stride(),
            *compressed.stride(), *block_table.stride(), scores.stride(0), out.stride(0), out.stride(1), free=_FREE,
            HI=Hi, DI=Di, HM=max(16, triton.next_power_of_2(Hi)), DP=triton.next_power_of_2(Di), PAGE=page_size,
            R=compress_ratio, KB=block_topk, BLOCK_G=t["block_g"], STAGES=t["stages"],
            DOT_DTYPE=tl.bfloat16 if exact_dot(q_idx, compressed, interpret) else tl.float32,
            SPAN_TILES=t["span"] // t["block_g"] if interpret else 0, KBP=triton.next_power_of_2(block_topk),
            CAP=triton.next_power_of_2(max(num_cols, 1)), SBITS=topk_tiles["sbits"], **write, num_warps=t["warps"],
        )

    def __call__(self, q_idx: torch.Tensor, block_table: torch.Tensor, row0: int, out: torch.Tensor,
                 out_row_stride: int) -> None:
        sq, sb = q_idx.stride(), block_table.stride()
        self._launch(q_idx, block_table, row0, sq[0], sq[1], sq[2], sb[0], sb[1], out, out_row_stride)
