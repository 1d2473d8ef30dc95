"""Triton decode selection of short rows in one launch: scores, then the last program of each
row to finish takes its exact top-k (SPEC 2.7).

Contract: `select.py`'s (`qsa_core.reference.select`): group scores of each row with visible
> Kb into the chunk's fp32 score scratch [chunk rows, num_cols] (bits as `select_score`'s
decode kernel: the same dots, head order and division), then per row the Kb largest groups,
ties to the lowest group index, ascending (or, PACKED, the packed selection rows); rows with
visible <= Kb take groups 0..visible-1 unscored.

`_select_short_kernel` (grid: rows x spans of `span` columns; rows of at most CAP columns):
each program scores its span (the decode score kernel's tile loop, `_score_span`) and arrives
at its row's counter (acq_rel; few programs per row, so the counter is not contended); the
last to arrive reads the row's scores back and resolves it in registers as
`select_topk._topk_short_kernel` does (`_kth_key`, `_emit`). Deterministic and
batch-invariant: the result depends on the row's scores only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import Launcher
from .select_radix import packed_write
from . import select_score
from .select_score import _q_row, _score_span, exact_dot
from .select_topk import _emit, _kth_key, _write_short, _write_tail


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr"])
def _select_short_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr, arrive_ptr, out_ptr, pos_ptr,
    row0, n_cols, span, norm,
    stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr,
    stride_or, stride_oc,
    HI: tl.constexpr, DI: tl.constexpr, HM: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, KB: tl.constexpr, KBP: tl.constexpr, BLOCK_G: tl.constexpr,
    STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, SPAN_TILES: tl.constexpr, CAP: tl.constexpr,
    BITS: tl.constexpr, PACKED: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, EARLY: tl.constexpr,
):
    """Row pid0's groups [pid1 * span, +span): scores (q [T, HI, DI], keys [rows, DI] -> s fp32
    [chunk rows, n_cols]), then, in the row's last program to arrive at arrive int32 [chunk
    rows] (zero between calls; it resets it), the top-k into out int32 [T, KB] or (PACKED) the
    packed rows [T, W + 1] (R: the compress ratio, tokens per group). EARLY: as the decode
    score kernel's."""
    lr = tl.program_id(0)
    row = row0 + lr
    col0 = tl.program_id(1) * span
    vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    s_row = s_ptr + lr.to(tl.int64) * stride_sr
    if EARLY:
        req = tl.load(req_ptr + row)
        q = _q_row(q_ptr, row, stride_qt, stride_qh, stride_qd, HI, DI, HM, DP, DOT_DTYPE)
    if vis <= KB:
        if col0 == 0:
            _write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
            _write_short(out_row, stride_oc, vis, KB, KBP, PACKED, R)
    elif col0 < vis:
        if not EARLY:
            req = tl.load(req_ptr + row)
            q = _q_row(q_ptr, row, stride_qt, stride_qh, stride_qd, HI, DI, HM, DP, DOT_DTYPE)
        _score_span(q, k_ptr, bt_ptr, s_row, req, col0, tl.minimum(vis, col0 + span), norm, stride_kp, stride_kr,
                    stride_kd, stride_btr, stride_btp, DI, DP, PAGE, R, BLOCK_G, STAGES, DOT_DTYPE, SPAN_TILES,
                    s_row, 0)
        tl.debug_barrier()  # this program's scores before its arrival
        if tl.atomic_add(arrive_ptr + lr, 1, sem="acq_rel", scope="gpu") == tl.cdiv(vis, span) - 1:
            tl.store(arrive_ptr + lr, 0)  # clean for the next call
            _write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
            cols = tl.arange(0, CAP)
            s = tl.load(s_row + cols, mask=cols < vis, other=0.0, cache_modifier=".cg")
            key = tl.where(cols < vis, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
            _emit(key, cols, _kth_key(key, KB, BITS, 31), out_row, stride_oc, KB, PACKED, R)


_short = Launcher(_select_short_kernel)
_FREE = ("q_ptr", "bt_ptr", "out_ptr", "row0", "stride_qt", "stride_qh", "stride_qd", "stride_btr", "stride_btp",
         "stride_or")


class FusedShortLaunch:
    """The one launch of a chunk of `rows` short rows (from a free first row `row0`) bound to
    the compressed keys [pages, page_size / r, Di], token_to_req / visible_blocks int32 [T],
    the score scratch fp32 [>= rows, num_cols] and arrive int32 [>= rows] (zero); `__call__(
    q_idx [T, Hi, Di], block_table, row0, out, out_row_stride)` launches it into out: int32
    [T, Kb] or, with `positions` int64 [T] given, the packed selection int32 [T, W + 1].
    tiles: `select_score.score_tiles`'s decode tiles (block_g, span, stages), bits: key bits
    per search step, warps."""

    def __init__(self, q_idx: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                 token_to_req: torch.Tensor, visible_blocks: torch.Tensor, scores: torch.Tensor, arrive: torch.Tensor,
                 out: torch.Tensor, *, row0: int, rows: int, num_cols: int, page_size: int, compress_ratio: int,
                 block_topk: int, block_g: int, span: int, stages: int, bits: int, warps: int, interpret: bool,
                 positions: torch.Tensor | None = None) -> None:
        _, Hi, Di = q_idx.shape
        write, pos = packed_write(out, positions, visible_blocks, compress_ratio)
        write.pop("R")
        self._launch = _short.bind(
            (rows, triton.cdiv(num_cols, span)), q_idx, compressed, block_table, token_to_req, visible_blocks, scores,
            arrive, out, pos, row0, num_cols, span, math.sqrt(Di), *q_idx.stride(), *compressed.stride(),
            *block_table.stride(), scores.stride(0), out.stride(0), out.stride(1), free=_FREE,
            HI=Hi, DI=Di, HM=max(16, triton.next_power_of_2(Hi)), DP=triton.next_power_of_2(Di), PAGE=page_size,
            R=compress_ratio, KB=block_topk, KBP=triton.next_power_of_2(block_topk), BLOCK_G=block_g, STAGES=stages,
            DOT_DTYPE=tl.bfloat16 if exact_dot(q_idx, compressed, interpret) else tl.float32,
            SPAN_TILES=span // block_g if interpret else 0, CAP=triton.next_power_of_2(max(num_cols, 1)), BITS=bits,
            **write, EARLY=select_score.EARLY_LOADS, num_warps=warps,
        )

    def __call__(self, q_idx: torch.Tensor, block_table: torch.Tensor, row0: int, out: torch.Tensor,
                 out_row_stride: int) -> None:
        sq, sb = q_idx.stride(), block_table.stride()
        self._launch(q_idx, block_table, out, row0, sq[0], sq[1], sq[2], sb[0], sb[1], out_row_stride)
