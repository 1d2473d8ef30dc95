"""Triton group scores of selection: s(t, g) = sum_h relu(q[t,h].k_g) / sqrt(Di), fp32.

Contract: `qsa_core.reference.select.group_scores`. Scores go to a chunk's scratch
[chunk rows, num_cols], only for rows with visible > Kb and columns g < visible; nothing
else of the scratch is written. Decode (`_scores_decode_kernel`, grid: rows x column tiles):
a row's heads are the dot's M. Prefill (`_scores_prefill_kernel`, grid: row tiles x column
tiles): rows of one request are the dot's M, one dot per head. `ScoreLaunch` binds one
chunk's launch (`launch.py`): per call only q_idx, the block table and the chunk's first row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import Launcher

_EXACT_DOT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _load_keys(k_ptr, bt_ptr, req, g, g_mask, d, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp,
               DI: tl.constexpr, PAGE: tl.constexpr, R: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Compressed keys [BLOCK_G, DP] of groups g of request req, through its block table:
    page block_table[req, g*R // PAGE], row (g*R % PAGE) / R of the paged view."""
    tok = g * R
    page = tl.load(bt_ptr + req.to(tl.int64) * stride_btr + (tok // PAGE) * stride_btp, mask=g_mask, other=0)
    off = page.to(tl.int64) * stride_kp + ((tok % PAGE) // R) * stride_kr
    keys = tl.load(k_ptr + off[:, None] + d[None, :] * stride_kd,
                   mask=g_mask[:, None] & (d[None, :] < DI), other=0.0)
    return keys.to(DOT_DTYPE)


@triton.jit
def _finish(relu_sum, norm):
    """Divide by sqrt(Di) with IEEE rounding (as the reference) and fold -0.0 into +0.0."""
    s = tl.math.div_rn(relu_sum, norm)
    return tl.where(s == 0.0, 0.0, s)


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr"])
def _scores_decode_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr,
    row0, n_cols, norm,
    stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr,
    HI: tl.constexpr, DI: tl.constexpr, HM: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, KB: tl.constexpr, BLOCK_G: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Scores of one row x groups [pid1*BLOCK_G, +BLOCK_G): its heads (padded to HM >= 16)
    are the dot's M. q [T, HI, DI], keys [rows, DI] -> s fp32 [chunk rows, n_cols]."""
    lr = tl.program_id(0)
    row = row0 + lr
    col0 = tl.program_id(1) * BLOCK_G
    vis = tl.load(vis_ptr + row)
    vis = tl.where(vis > KB, tl.minimum(vis, n_cols), 0)  # <= Kb: chosen without scores
    if col0 < vis:
        req = tl.load(req_ptr + row)
        h = tl.arange(0, HM)
        d = tl.arange(0, DP)
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=(h < HI)[:, None] & (d < DI)[None, :], other=0.0).to(DOT_DTYPE)
        g = col0 + tl.arange(0, BLOCK_G)
        g_mask = g < vis
        keys = _load_keys(k_ptr, bt_ptr, req, g, g_mask, d, stride_kp, stride_kr, stride_kd, stride_btr,
                          stride_btp, DI, PAGE, R, DOT_DTYPE)
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # fp32 [HM, BLOCK_G]
        s = _finish(tl.sum(tl.maximum(dots, 0.0), 0), norm)
        tl.store(s_ptr + lr.to(tl.int64) * stride_sr + g, s, mask=g_mask)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "stride_sr"])
def _scores_prefill_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr,
    row0, n_rows, n_cols, norm,
    stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr,
    HI: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Scores of rows [row0 + pid0*BLOCK_R, +BLOCK_R) x groups [pid1*BLOCK_G, +BLOCK_G):
    rows are the dot's M, one dot per head. A row tile may span requests: each request in it
    loads its own keys once."""
    lr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col0 = tl.program_id(1) * BLOCK_G
    in_chunk = lr < n_rows
    rows = row0 + lr
    vis = tl.load(vis_ptr + rows, mask=in_chunk, other=0)
    vis = tl.where(vis > KB, tl.minimum(vis, n_cols), 0)  # <= Kb: chosen without scores
    active = in_chunk & (vis > col0)
    if tl.max(vis, 0) > col0:
        req = tl.load(req_ptr + rows, mask=active, other=0)
        req_lo = tl.min(tl.where(active, req, 2147483647), 0)
        req_hi = tl.max(tl.where(active, req, -1), 0)
        d = tl.arange(0, DP)
        g = col0 + tl.arange(0, BLOCK_G)
        q_row = q_ptr + rows.to(tl.int64)[:, None] * stride_qt + d[None, :] * stride_qd
        cur = req_lo
        while cur <= req_hi:  # (a while loop: the interpreter cannot range over reductions)
            mine = active & (req == cur)
            g_end = tl.max(tl.where(mine, vis, 0), 0)
            if g_end > col0:
                keys = _load_keys(k_ptr, bt_ptr, cur, g, g < g_end, d, stride_kp, stride_kr, stride_kd,
                                  stride_btr, stride_btp, DI, PAGE, R, DOT_DTYPE)
                acc = tl.zeros((BLOCK_R, BLOCK_G), tl.float32)
                for h in range(HI):
                    q = tl.load(q_row + h * stride_qh, mask=mine[:, None] & (d < DI)[None, :], other=0.0)
                    dots = tl.dot(q.to(DOT_DTYPE), tl.trans(keys), input_precision="ieee")
                    acc += tl.maximum(dots, 0.0)
                s_off = lr.to(tl.int64)[:, None] * stride_sr + g[None, :]
                tl.store(s_ptr + s_off, _finish(acc, norm), mask=mine[:, None] & (g[None, :] < vis[:, None]))
            cur += 1


_decode = Launcher(_scores_decode_kernel)
_prefill = Launcher(_scores_prefill_kernel)
_FREE = ("q_ptr", "bt_ptr", "row0", "stride_qt", "stride_qh", "stride_qd", "stride_btr", "stride_btp")


def exact_dot(q_idx: torch.Tensor, compressed: torch.Tensor, interpret: bool) -> bool:
    """Whether the score dots may take bf16 operands exactly (both sides bf16 or fp8), else fp32."""
    return not interpret and q_idx.dtype in _EXACT_DOT_DTYPES and compressed.dtype in _EXACT_DOT_DTYPES


class ScoreLaunch:
    """The score launch of one chunk of `rows` rows (from a free first row `row0`) bound to
    the compressed keys [pages, page_size / r, Di], token_to_req / visible_blocks int32 [T]
    and the score scratch fp32 [>= rows, num_cols]; `__call__(q_idx [T, Hi, Di], block_table
    int32 [R, P], row0)` launches it. q_idx's dtype is fixed at binding."""

    def __init__(self, q_idx: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                 token_to_req: torch.Tensor, visible_blocks: torch.Tensor, scores: torch.Tensor, *, row0: int,
                 rows: int, num_cols: int, page_size: int, compress_ratio: int, block_topk: int, decode: bool,
                 tiles: dict, interpret: bool) -> None:
        _, Hi, Di = q_idx.shape
        common = dict(HI=Hi, DI=Di, DP=triton.next_power_of_2(Di), PAGE=page_size, R=compress_ratio, KB=block_topk,
                      BLOCK_G=tiles["block_g"],
                      DOT_DTYPE=tl.bfloat16 if exact_dot(q_idx, compressed, interpret) else tl.float32)
        col_tiles = triton.cdiv(num_cols, tiles["block_g"])
        args = (
            q_idx, compressed, block_table, token_to_req, visible_blocks, scores,
            row0, *(() if decode else (rows,)), num_cols, math.sqrt(Di),
            *q_idx.stride(), *compressed.stride(), *block_table.stride(), scores.stride(0),
        )
        if decode:
            self._launch = _decode.bind((rows, col_tiles), *args, free=_FREE,
                                        HM=max(16, triton.next_power_of_2(Hi)), **common, num_warps=4)
        else:
            self._launch = _prefill.bind((triton.cdiv(rows, tiles["block_r"]), col_tiles), *args, free=_FREE,
                                         BLOCK_R=tiles["block_r"], **common, num_warps=8)

    def __call__(self, q_idx: torch.Tensor, block_table: torch.Tensor, row0: int) -> None:
        sq, sb = q_idx.stride(), block_table.stride()
        self._launch(q_idx, block_table, row0, sq[0], sq[1], sq[2], sb[0], sb[1])
