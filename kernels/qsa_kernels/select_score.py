"""Triton group scores of selection: s(t, g) = sum_h relu(q[t,h].k_g) / sqrt(Di), fp32.

Contract: `qsa_core.reference.select.group_scores`. Scores go to a chunk's scratch
[chunk rows, num_cols], only for rows with visible > Kb and columns g < visible; nothing
else of the scratch is written. A program owns a span of `span` columns that it streams in
BLOCK_G tiles (a software-pipelined loop: the next tiles' keys load while this one's dots
run). Three kernels (`score_tiles` says which for which shape, and why):
- `_scores_decode_kernel` (grid: rows x spans): one row, its heads padded to HM >= 16 on the
  dot's M.
- `_scores_mtp_kernel` (grid: requests x spans): the decode rows of one request (MTP rows of a
  decode-only step), rows x heads on the dot's M.
- `_scores_prefill_kernel` (grid: row tiles x spans, row tiles fastest so that programs
  sharing a span's keys run together): BLOCK_R rows; a row tile may hold several requests,
  each streams its own keys (prefill, and MTP rows of a mixed step). PACK (<= 4 heads, padded
  to HP): rows x heads on one dot's N, the heads outermost (m = h * BLOCK_R + r), so the head
  sum after a reshape stays in each thread's registers, and the key tile on its M (wgmma; rows
  x heads on the mma's M measured slower). Otherwise one dot per head (more than 4
  heads).
`ScoreLaunch` binds one chunk's launch (`launch.py`): per call only q_idx, the block table
and the chunk's first row.

Bits: each score is one fp32 dot per head over all of Di (no tile splits Di), the heads'
ReLUs summed in head order, then the IEEE division by sqrt(Di) (`_finish`, or `_finish_fast`:
the same quotient wherever it is normal), so a score depends on its row's q and its key
only, never on the tile or span: every route gives the same score bits (checked on the H200).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .launch import Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions

# triton 3.6's interpreter rounds tl.fma twice (the product, then the sum), so the fast
# division is exact there only when compiled: its interpreter runs take the IEEE division.
INTERPRETER_FMA_FUSED = not triton.__version__.startswith("3.6.")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


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
def _load_keys_whole(k_ptr, bt_ptr, req, g, d, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp,
                     PAGE: tl.constexpr, R: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """`_load_keys` of a whole tile: every group g < visible of every row, Di = DP (no masks);
    g >= 0, so its page and row come from unsigned division."""
    gu = g.to(tl.uint32)
    page = tl.load(bt_ptr + req.to(tl.int64) * stride_btr + (gu // (PAGE // R)).to(tl.int32) * stride_btp)
    off = page.to(tl.int64) * stride_kp + (gu % (PAGE // R)).to(tl.int32) * stride_kr
    return tl.load(k_ptr + off[:, None] + d[None, :] * stride_kd).to(DOT_DTYPE)


@triton.jit
def _finish(relu_sum, norm):
    """Divide by sqrt(Di) with IEEE rounding (as the reference) and fold -0.0 into +0.0."""
    s = tl.math.div_rn(relu_sum, norm)
    return tl.where(s == 0.0, 0.0, s)


@triton.jit
def _finish_fast(relu_sum, norm, rcp):
    """`_finish` by a Markstein correction of relu_sum * rcp (rcp = fp32(1 / norm)): the IEEE
    quotient for every relu_sum >= 0 whose quotient is normal, where norm's significand is 1
    or that of sqrt(2) (Di a power of two; every fp32 checked on the CPU); sums below 2^-100
    are scaled by 2^64 first (the remainder would underflow). -0.0 needs no fold: q0 = -0.0,
    the remainder +0.0 and q = +0.0 * rcp + -0.0 = +0.0."""
    tiny = relu_sum < 7.888609052210118e-31  # 2^-100
    x = relu_sum * tl.where(tiny, 18446744073709551616.0, 1.0)  # 2^64
    q0 = x * rcp
    q = tl.fma(tl.fma(-q0, norm, x), rcp, q0)
    return q * tl.where(tiny, 5.421010862427522e-20, 1.0)  # 2^-64


@triton.jit
def _relu_dot(q, keys):
    """relu(q . keys^T) in fp32: q [M, DP], keys [N, DP] -> [M, N]."""
    return tl.maximum(tl.dot(q, tl.trans(keys), input_precision="ieee"), 0.0)


@triton.jit
def sample_shift(vis, WBITS: tl.constexpr, MAX_SHIFT: tl.constexpr):
    """log2 of the columns per sample of rows of vis visible columns (int32, scalar or a
    tensor; decode's per-row samples): the least s in [0, MAX_SHIFT] with cdiv(vis, 2^s) <=
    2^WBITS, so a row of at most 2^WBITS columns has a sample per column and a longer one
    more than 2^(WBITS - 1) samples (the plan makes 2^(WBITS + MAX_SHIFT) >= its columns)."""
    s = vis * 0
    for i in tl.static_range(MAX_SHIFT):
        s += (vis > (1 << (WBITS + i))).to(tl.int32)
    return s


@triton.jit
def _store_scores(ptr, s, mask, KEEP: tl.constexpr):
    """Store decode scores; KEEP: with an L2 evict_last hint (`SCORES_L2_BYTES`)."""
    if KEEP:
        tl.store(ptr, s, mask=mask, eviction_policy="evict_last")
    else:
        tl.store(ptr, s, mask=mask)


@triton.jit
def store_row_samples(samp_ptr, lr, g0, s, mask, vis, stride_pr, WBITS: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_R: tl.constexpr, LOG_G: tl.constexpr):
    """Per-row samples of a score tile s fp32 [BLOCK_G, BLOCK_R] (columns g0 + i, g0 a multiple
    of BLOCK_G, a multiple of 2^LOG_G; rows lr int32 [BLOCK_R], their visible vis; mask: the cells
    written): row lr's runs of 2^shift columns (`sample_shift`) -> samples int32 [chunk rows,
    2^WBITS] at (lr, g0 / 2^shift + run) = the largest key of the run's columns below vis.
    Only the run widths of the tile's rows are reduced (one for a single row, or the rows of
    one request: their visible counts differ by less than their number)."""
    shift = sample_shift(vis, WBITS, LOG_G)
    lo = tl.min(shift, 0)
    hi = tl.max(shift, 0)
    key = tl.where(mask, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
    for j in tl.static_range(LOG_G + 1):
        if (lo <= j) & (hi >= j):
            m = tl.max(tl.reshape(key, (BLOCK_G >> j, 1 << j, BLOCK_R)), 1)  # [runs of 2^j, BLOCK_R]
            i = tl.arange(0, BLOCK_G >> j)[:, None]
            tl.store(samp_ptr + lr.to(tl.int64)[None, :] * stride_pr + (g0 >> j) + i, m,
                     mask=(shift[None, :] == j) & ((g0 + (i << j)) < vis[None, :]), eviction_policy="evict_last")


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr", "stride_pr"])
def _scores_decode_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr, samp_ptr,
    row0, n_cols, span, norm, rcp,
    stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr, stride_pr,
    HI: tl.constexpr, DI: tl.constexpr, HM: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, KB: tl.constexpr, BLOCK_G: tl.constexpr,
    STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, SPAN_TILES: tl.constexpr, ROW_SAMPLES: tl.constexpr = 0,
    LOG_G: tl.constexpr = 0, FAST_DIV: tl.constexpr = 0, KEEP: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
):
    """Scores of one row x groups [pid1*span, +span) in BLOCK_G tiles: its heads (padded
    to HM >= 16) are the dot's M. q [T, HI, DI], keys [rows, DI] -> s fp32 [chunk rows, n_cols].
    SPAN_TILES > 0 (the interpreter only): the tile loop runs over constant bounds (triton
    3.6's interpreter cannot range over in-kernel values), masked as the runtime bounds.
    ROW_SAMPLES = WBITS > 0: also the row's samples (`store_row_samples`, BLOCK_G = 2^LOG_G)
    into samp int32 [chunk rows, 2^WBITS]: a row of one sample a tile stores each tile's maximum
    in the tile loop, a row of shorter runs reads its span's scores back after it. FAST_DIV: the
    division as `_finish_fast`. KEEP: scores stored with an L2 evict_last hint (samples always)."""
    pdl_start(PDL)
    lr = tl.program_id(0)
    row = row0 + lr
    col0 = tl.program_id(1) * span
    vis = tl.load(vis_ptr + row)
    vis = tl.where(vis > KB, tl.minimum(vis, n_cols), 0)  # <= Kb: chosen without scores
    if col0 < vis:
        req = tl.load(req_ptr + row)
        h = tl.arange(0, HM)
        d = tl.arange(0, DP)
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=(h < HI)[:, None] & (d < DI)[None, :], other=0.0).to(DOT_DTYPE)
        g_end = tl.minimum(vis, col0 + span)
        s_row = s_ptr + lr.to(tl.int64) * stride_sr
        samp_row = samp_ptr + lr.to(tl.int64) * stride_pr
        # Rows of one sample a tile (the longest) take its maximum in the tile loop; shorter runs
        # are read back after it (a multi-width reduction in the loop spills at the register cap).
        tile_samples = sample_shift(vis, ROW_SAMPLES, LOG_G) == LOG_G  # (unread without ROW_SAMPLES)
        for off in tl.range(0 if SPAN_TILES else col0, SPAN_TILES * BLOCK_G if SPAN_TILES else g_end, BLOCK_G,
                            num_stages=STAGES):
            g0 = col0 + off if SPAN_TILES else off
            g = g0 + tl.arange(0, BLOCK_G)
            g_mask = g < g_end
            keys = _load_keys(k_ptr, bt_ptr, req, g, g_mask, d, stride_kp, stride_kr, stride_kd, stride_btr,
                              stride_btp, DI, PAGE, R, DOT_DTYPE)
            acc = tl.sum(_relu_dot(q, keys), 0)  # fp32 [BLOCK_G]
            s = _finish_fast(acc, norm, rcp) if FAST_DIV else _finish(acc, norm)
            _store_scores(s_row + g, s, g_mask, KEEP)
            if ROW_SAMPLES:
                if tile_samples:
                    key = tl.where(g_mask, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
                    tl.store(samp_row + (g0 >> LOG_G), tl.max(key, 0), mask=g0 < g_end, eviction_policy="evict_last")
        if ROW_SAMPLES:
            if not tile_samples:
                tl.debug_barrier()  # this program's scores, stored by all its threads, before they are read
                one = tl.arange(0, 1)
                for off in tl.range(0 if SPAN_TILES else col0, SPAN_TILES * BLOCK_G if SPAN_TILES else g_end, BLOCK_G,
                                    num_stages=1):
                    g0 = col0 + off if SPAN_TILES else off
                    g = g0 + tl.arange(0, BLOCK_G)
                    g_mask = g < g_end
                    s = tl.load(s_row + g, mask=g_mask, other=0.0, cache_modifier=".cg")
                    store_row_samples(samp_ptr, lr + one, g0, s[:, None], g_mask[:, None], vis + one, stride_pr,
                                       ROW_SAMPLES, BLOCK_G, 1, LOG_G)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "stride_sr", "stride_pr"])
def _scores_mtp_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr, samp_ptr,
    row0, n_rows, n_cols, span, norm, rcp,
    stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr, stride_pr,
    HI: tl.constexpr, DI: tl.constexpr, HM: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, KB: tl.constexpr, BLOCK_G: tl.constexpr,
    STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, SPAN_TILES: tl.constexpr, RPR: tl.constexpr, RP: tl.constexpr,
    FAST_DIV: tl.constexpr = 0, KEEP: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
):
    """Scores of the RPR decode rows [row0 + pid0*RPR, +RPR) x groups [pid1*span, +span) in
    BLOCK_G tiles, the rows one request's (the plan's promise: a decode-only step of RPR rows
    per request, guarded by the metadata build's GUARD_DECODE_ROWS; every row is scored with
    the keys of the first row's request): rows x heads on the dot's M (slot m
    = r * HM / RP + h, RP = next_pow2(RPR) row slots), so the rows share each key tile; each
    row's heads sum over its slots as the one-row kernel sums its heads. q [T, HI, DI] -> s fp32
    [chunk rows, n_cols]; SPAN_TILES as `_scores_decode_kernel`; samp_ptr, stride_pr unread (the
    rows' samples come from `select_prefill`'s sample launch); KEEP as `_scores_decode_kernel`. (A
    loop over the requests of a program, as the prefill kernel's, would double its registers.)"""
    pdl_start(PDL)
    HR: tl.constexpr = HM // RP  # slots per row (>= HI)
    slot = tl.arange(0, RP)
    lr = tl.program_id(0) * RPR + slot
    col0 = tl.program_id(1) * span
    vis = tl.load(vis_ptr + row0 + lr, mask=(slot < RPR) & (lr < n_rows), other=0)
    vis = tl.where(vis > KB, tl.minimum(vis, n_cols), 0)  # <= Kb: chosen without scores
    if tl.max(vis, 0) > col0:
        req = tl.load(req_ptr + row0 + tl.program_id(0) * RPR)
        d = tl.arange(0, DP)
        m = tl.arange(0, HM)
        q = tl.load(q_ptr + (row0 + tl.program_id(0) * RPR + m // HR).to(tl.int64)[:, None] * stride_qt
                    + (m % HR)[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=((m % HR < HI) & (m // HR < RPR) & (tl.program_id(0) * RPR + m // HR < n_rows))[:, None]
                    & (d < DI)[None, :], other=0.0).to(DOT_DTYPE)
        q = tl.where((tl.reshape(tl.broadcast_to((vis > col0)[:, None], (RP, HR)), (HM,)))[:, None], q, 0.0)
        g_end = tl.minimum(tl.max(vis, 0), col0 + span)
        s_rows = s_ptr + lr.to(tl.int64)[:, None] * stride_sr
        for off in tl.range(0 if SPAN_TILES else col0, SPAN_TILES * BLOCK_G if SPAN_TILES else g_end, BLOCK_G,
                            num_stages=STAGES):
            g0 = col0 + off if SPAN_TILES else off
            g = g0 + tl.arange(0, BLOCK_G)
            keys = _load_keys(k_ptr, bt_ptr, req, g, g < g_end, d, stride_kp, stride_kr, stride_kd, stride_btr,
                              stride_btp, DI, PAGE, R, DOT_DTYPE)
            acc = tl.sum(tl.reshape(_relu_dot(q, keys), (RP, HR, BLOCK_G)), 1)  # [RP, BLOCK_G]
            s = _finish_fast(acc, norm, rcp) if FAST_DIV else _finish(acc, norm)
            _store_scores(s_rows + g[None, :], s, g[None, :] < vis[:, None], KEEP)
    pdl_end(PDL)


@triton.jit
def _store_samples(samp_ptr, lr, g0, s, mask, vis, stride_pr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
                   SUB: tl.constexpr):
    """The selection's samples of a score tile s fp32 [BLOCK_G, BLOCK_R] (columns g0 + i, rows
    lr; mask: the cells written): for each of its SUB subsets of S = BLOCK_G / SUB columns,
    samples int32 [chunk rows, cdiv(n_cols, S)] at (row, g0 / S + subset) = the largest key
    (score bits) among the subset's columns below the row's visible (-1: none)."""
    key = tl.where(mask, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
    m = tl.max(tl.reshape(key, (SUB, BLOCK_G // SUB, BLOCK_R)), 1)  # [SUB, BLOCK_R]
    i = tl.arange(0, SUB)[:, None]
    tl.store(samp_ptr + lr.to(tl.int64)[None, :] * stride_pr + g0 // (BLOCK_G // SUB) + i, m,
             mask=(g0 + i * (BLOCK_G // SUB)) < vis[None, :])


@triton.jit
def _store_samples_whole(samp_tile, g0, s, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, SUB: tl.constexpr):
    """`_store_samples` of a whole tile (every cell written): samp_tile int32 pointers
    [1, BLOCK_R] of the rows' samples, column g0 / S + subset."""
    key = s.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    m = tl.max(tl.reshape(key, (SUB, BLOCK_G // SUB, BLOCK_R)), 1)  # [SUB, BLOCK_R]
    tl.store(samp_tile + (g0 // (BLOCK_G // SUB) + tl.arange(0, SUB)[:, None]), m)


@triton.jit
def _q_head(q_row, h, stride_qh, mask, HI: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """q [BLOCK_R, DP] of head h of a row tile (zeros where masked or h >= HI)."""
    return tl.load(q_row + h * stride_qh, mask=mask & (h < HI), other=0.0).to(DOT_DTYPE)


@triton.jit
def _keys_m_tile(k_ptr, bt_ptr, req, g0, g_end, qa, d, cols, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp,
                 norm, rcp, s_ptr, s_tile, s_offs, samp_ptr, samp_tile, lr, mine, vis, stride_sr, stride_pr,
                 DI: tl.constexpr, PAGE: tl.constexpr, R: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, HP: tl.constexpr, FAST_DIV: tl.constexpr,
                 SAMPLE: tl.constexpr, WHOLE: tl.constexpr):
    """One score tile of the prefill kernel with keys on the dot's M: groups g0 + [0, BLOCK_G) of
    request req against qa [HP * BLOCK_R, DP] (rows x heads, heads outermost), s^T [BLOCK_G,
    BLOCK_R] stored at row lr, column g (and SAMPLE samples). WHOLE: every row is req's and sees
    every group of the tile (no masks; s_tile + g0 + s_offs int32 [BLOCK_G, BLOCK_R] addresses
    the cells, samp_tile [1, BLOCK_R] the rows' samples); else cells of g < vis of mine rows."""
    g = g0 + cols
    if WHOLE:
        keys = _load_keys_whole(k_ptr, bt_ptr, req, g, d, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp,
                                PAGE, R, DOT_DTYPE)
    else:
        keys = _load_keys(k_ptr, bt_ptr, req, g, g < g_end, d, stride_kp, stride_kr, stride_kd, stride_btr,
                          stride_btp, DI, PAGE, R, DOT_DTYPE)
    dots = tl.dot(keys, tl.trans(qa), input_precision="ieee")
    acc = tl.sum(tl.reshape(tl.maximum(dots, 0.0), (BLOCK_G, HP, BLOCK_R)), 1)
    s = _finish_fast(acc, norm, rcp) if FAST_DIV else _finish(acc, norm)
    if WHOLE:
        tl.store(s_tile + g0 + s_offs, s)
        if SAMPLE:
            _store_samples_whole(samp_tile, g0, s, BLOCK_G, BLOCK_R, SAMPLE)
    else:
        written = mine[None, :] & (g[:, None] < vis[None, :])
        tl.store(s_ptr + lr.to(tl.int64)[None, :] * stride_sr + g[:, None], s, mask=written)
        if SAMPLE:
            _store_samples(samp_ptr, lr, g0, s, written, tl.where(mine, vis, 0), stride_pr, BLOCK_G, BLOCK_R, SAMPLE)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "stride_pr"])
def _scores_prefill_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr, samp_ptr,
    row0, n_rows, n_cols, span, norm, rcp,
    stride_qt, stride_qh, stride_qd, stride_kp, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr, stride_pr,
    HI: tl.constexpr, DI: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, STAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PACK: tl.constexpr, HP: tl.constexpr, FAST_DIV: tl.constexpr,
    SPAN_TILES: tl.constexpr, SAMPLE: tl.constexpr, WHOLE: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
):
    """Scores of rows [row0 + pid0*BLOCK_R, +BLOCK_R) x groups [pid1*span, +span) in
    BLOCK_G tiles. PACK (HI <= 4): rows x HP heads are one dot's N, the key tile its M (wgmma);
    else rows are the dot's M,
    one dot per head, heads 0..3 keeping their q for the whole span (further heads reload theirs
    per tile). A row tile may span requests: each request in it streams its own keys.
    SPAN_TILES: as the decode kernel. SAMPLE > 0: also the top-k's samples of each tile
    (`_store_samples`, SAMPLE subsets per tile) into samp int32 [chunk rows, ...]."""
    pdl_start(PDL)
    lr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col0 = tl.program_id(1) * span
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
        cols = tl.arange(0, BLOCK_G)
        q_row = q_ptr + rows.to(tl.int64)[:, None] * stride_qt + d[None, :] * stride_qd
        s_rows = s_ptr + lr.to(tl.int64)[:, None] * stride_sr
        cur = req_lo
        while cur <= req_hi:  # (a while loop: the interpreter cannot range over reductions)
            mine = active & (req == cur)
            g_end = tl.minimum(tl.max(tl.where(mine, vis, 0), 0), col0 + span)
            if PACK:  # heads outermost on the dot's N (m = h * BLOCK_R + r): one dot, a thread-local head sum
                m = tl.arange(0, HP * BLOCK_R)
                m_lr = tl.program_id(0) * BLOCK_R + m % BLOCK_R
                m_mine = tl.reshape(tl.broadcast_to(mine[None, :], (HP, BLOCK_R)), (HP * BLOCK_R,))
                qa = tl.load(q_ptr + (row0 + m_lr).to(tl.int64)[:, None] * stride_qt
                             + (m // BLOCK_R)[:, None] * stride_qh + d[None, :] * stride_qd,
                             mask=(m_mine & (m // BLOCK_R < HI))[:, None] & (d < DI)[None, :], other=0.0)
                qa = qa.to(DOT_DTYPE)
                # keys on M, rows x heads on N: s^T tiles [BLOCK_G, BLOCK_R]
                # WHOLE: the tiles below g_full, where every row of the program is this request's
                # and sees every column, take the unmasked body; the rest the masked one.
                g_full = col0
                if WHOLE:
                    vis_lo = tl.min(tl.where(mine, vis, 2147483647), 0)
                    whole_rows = tl.min(mine.to(tl.int32), 0) == 1
                    g_full = tl.where(whole_rows, col0 + (tl.minimum(vis_lo, col0 + span) - col0) // BLOCK_G * BLOCK_G,
                                      col0)
                s_tile = s_ptr + (tl.program_id(0) * BLOCK_R).to(tl.int64) * stride_sr
                s_offs = tl.arange(0, BLOCK_R)[None, :] * stride_sr + cols[:, None]  # int32 (< 2^31: the plan)
                samp_tile = samp_ptr + lr.to(tl.int64)[None, :] * stride_pr
                if SPAN_TILES:  # the interpreter: one loop, each tile's body chosen per tile
                    for off in tl.range(0, SPAN_TILES * BLOCK_G, BLOCK_G):
                        if col0 + off + BLOCK_G <= g_full:
                            _keys_m_tile(k_ptr, bt_ptr, cur, col0 + off, g_end, qa, d, cols, stride_kp, stride_kr,
                                         stride_kd, stride_btr, stride_btp, norm, rcp, s_ptr, s_tile, s_offs,
                                         samp_ptr, samp_tile, lr, mine, vis, stride_sr, stride_pr, DI, PAGE, R,
                                         DOT_DTYPE, BLOCK_G, BLOCK_R, HP, FAST_DIV, SAMPLE, True)
                        else:
                            _keys_m_tile(k_ptr, bt_ptr, cur, col0 + off, g_end, qa, d, cols, stride_kp, stride_kr,
                                         stride_kd, stride_btr, stride_btp, norm, rcp, s_ptr, s_tile, s_offs,
                                         samp_ptr, samp_tile, lr, mine, vis, stride_sr, stride_pr, DI, PAGE, R,
                                         DOT_DTYPE, BLOCK_G, BLOCK_R, HP, FAST_DIV, SAMPLE, False)
                else:
                    if WHOLE:
                        for g0 in tl.range(col0, g_full, BLOCK_G, num_stages=STAGES):
                            _keys_m_tile(k_ptr, bt_ptr, cur, g0, g_end, qa, d, cols, stride_kp, stride_kr,
                                         stride_kd, stride_btr, stride_btp, norm, rcp, s_ptr, s_tile, s_offs,
                                         samp_ptr, samp_tile, lr, mine, vis, stride_sr, stride_pr, DI, PAGE, R,
                                         DOT_DTYPE, BLOCK_G, BLOCK_R, HP, FAST_DIV, SAMPLE, True)
                    for g0 in tl.range(g_full, g_end, BLOCK_G, num_stages=STAGES):
                        _keys_m_tile(k_ptr, bt_ptr, cur, g0, g_end, qa, d, cols, stride_kp, stride_kr,
                                     stride_kd, stride_btr, stride_btp, norm, rcp, s_ptr, s_tile, s_offs,
                                     samp_ptr, samp_tile, lr, mine, vis, stride_sr, stride_pr, DI, PAGE, R,
                                     DOT_DTYPE, BLOCK_G, BLOCK_R, HP, FAST_DIV, SAMPLE, False)
            else:
                q_mask = mine[:, None] & (d < DI)[None, :]
                q0 = _q_head(q_row, 0, stride_qh, q_mask, HI, DOT_DTYPE)
                q1 = _q_head(q_row, 1, stride_qh, q_mask, HI, DOT_DTYPE)
                q2 = _q_head(q_row, 2, stride_qh, q_mask, HI, DOT_DTYPE)
                q3 = _q_head(q_row, 3, stride_qh, q_mask, HI, DOT_DTYPE)
                for off in tl.range(0 if SPAN_TILES else col0, SPAN_TILES * BLOCK_G if SPAN_TILES else g_end,
                                    BLOCK_G, num_stages=STAGES):
                    g0 = col0 + off if SPAN_TILES else off
                    g = g0 + cols
                    keys = _load_keys(k_ptr, bt_ptr, cur, g, g < g_end, d, stride_kp, stride_kr, stride_kd,
                                      stride_btr, stride_btp, DI, PAGE, R, DOT_DTYPE)
                    acc = _relu_dot(q0, keys)  # fp32 [BLOCK_R, BLOCK_G], heads summed in order
                    if HI > 1:
                        acc += _relu_dot(q1, keys)
                    if HI > 2:
                        acc += _relu_dot(q2, keys)
                    if HI > 3:
                        acc += _relu_dot(q3, keys)
                    for h in tl.static_range(4, HI):
                        acc += _relu_dot(_q_head(q_row, h, stride_qh, q_mask, HI, DOT_DTYPE), keys)
                    s = _finish_fast(acc, norm, rcp) if FAST_DIV else _finish(acc, norm)
                    written = mine[:, None] & (g[None, :] < vis[:, None])
                    tl.store(s_rows + g[None, :], s, mask=written)
                    if SAMPLE:
                        _store_samples(samp_ptr, lr, g0, tl.trans(s), tl.trans(written),
                                       tl.where(mine, vis, 0), stride_pr, BLOCK_G, BLOCK_R, SAMPLE)
            cur += 1
    pdl_end(PDL)


@dataclass(frozen=True)
class ScoreTiles:
    """Compile-time shape of a score launch. block_r: rows per program (decode: 1 = one row
    per program, its heads padded to 16 on the dot's M; more = the row-tile kernel packed, as
    prefill, for at most 4 heads); block_g: columns per tile (N); span: columns per program (a multiple
    of block_g), 0 = chosen per launch (`_span`); stages: pipeline depth of the tile loop;
    max_span_tiles, min_programs (span 0): `_span`'s bounds;
    pack: rows x heads on one dot (for at most 4 heads); fast_div: the division by sqrt(Di)
    as `_finish_fast` (Di a power of two); whole (pack): tiles that every row of a program
    sees whole take an unmasked body; max_regs: registers per thread (0: the compiler's choice);
    request_rows (decode): a program scores the rows_per_request rows of one request
    (`_scores_mtp_kernel`; block_r 1)."""

    block_r: int
    block_g: int
    span: int
    stages: int
    num_warps: int
    pack: bool = False
    fast_div: bool = False
    whole: bool = False
    max_regs: int = 0
    request_rows: bool = False
    max_span_tiles: int = 32
    min_programs: int = 1024


# Prefill rows of at least this many columns (1M context) score in 128-column tiles: faster
# select at 1M (the scores, and the candidate launches from the longer samples), slower at 128K
# (H200, see NOTES.md (Kernels)).
PREFILL_WIDE_COLS = 1 << 18
# The request-rows kernel's tiles (MTP rows of a decode-only step).
MTP_TILES = ScoreTiles(block_r=1, block_g=128, span=256, stages=2, num_warps=4, fast_div=True, request_rows=True)
# Registers per thread of the decode kernel with per-row samples: its time follows occupancy,
# and with only the tile maximum in the tile loop it fits 64 without spilling; the compiler's
# own count, 80 or 96 were slower (H200, see NOTES.md (Kernels)).
SAMPLES_MAX_REGS = 64


def score_tiles(decode: bool, tiles: Any, small: bool, key_bytes: int = 2, num_cols: int = 0) -> ScoreTiles:
    """The score tiles of a call whose `select.SelectTiles` are `tiles`: with small
    (`KernelOptions.small_tiles`) the schedule's small tiles (tests cross tile and span borders),
    else the H200's, each the fastest (or tied) of its sweep (figures: NOTES.md (Kernels); `python
    benchmarks/bench_qsa.py --only decode-1048576-4-1-bf16 decode-1048576-4-4-bf16
    prefill-131072-1-16384-bf16 --out DIR`):
    - decode, one row per request: one row per program, 128-column tiles; spans of up to two
      tiles for bf16 keys, four for fp8, while >= 512 programs remain; 2 stages;
    - decode with tiles.rows_per_request > 1 (MTP): 4 rows x 4 heads on one dot, so a
      request's rows read each key once; in a decode-only step (tiles.rows_aligned) the
      request-rows kernel (`_scores_mtp_kernel`: the rows x heads on the mma's M, the Markstein
      division, 256-column spans, 2 stages), else the packed kernel with the keys on the wgmma's
      M and the Markstein division (prefill's body); all bit-equal;
    - prefill: keys on the wgmma's M, 32 rows x 4 heads on its N, the Markstein division;
      128-column tiles from PREFILL_WIDE_COLS num_cols; whole tiles unmasked; 64-column tiles at
      168 registers, 3 programs an SM (128-column ones spill there)."""
    rows_tiles = decode and tiles.rows_per_request > 1
    if rows_tiles and tiles.rows_aligned:
        return ScoreTiles(block_r=1, block_g=tiles.block_g, span=2 * tiles.block_g, stages=1, num_warps=4,
                          fast_div=True, request_rows=True) if small else MTP_TILES
    if small:
        return ScoreTiles(block_r=4 if rows_tiles else 1 if decode else tiles.block_r, block_g=tiles.block_g,
                          span=2 * tiles.block_g, stages=1, num_warps=4, pack=rows_tiles or not decode,
                          fast_div=rows_tiles or not decode, whole=rows_tiles or not decode)
    if rows_tiles:
        return ScoreTiles(block_r=4, block_g=128, span=0, stages=3, num_warps=4, pack=True, fast_div=True, whole=True)
    if decode:
        return ScoreTiles(block_r=1, block_g=128, span=0, stages=2, num_warps=4, fast_div=True,
                          max_span_tiles=4 if key_bytes == 1 else 2, min_programs=512)
    wide = num_cols >= PREFILL_WIDE_COLS
    return ScoreTiles(block_r=32, block_g=128 if wide else 64, span=0, stages=3, num_warps=4, pack=True, fast_div=True,
                      whole=True, max_regs=0 if wide else 168)


def _span(t: ScoreTiles, row_tiles: int, num_cols: int) -> int:
    """Columns per program: the fixed span, or (span 0) the longest power-of-two multiple of
    block_g up to max_span_tiles tiles that still leaves >= min_programs programs (row tiles x
    spans)."""
    if t.span:
        return t.span
    span = t.block_g
    while span < t.max_span_tiles * t.block_g and row_tiles * triton.cdiv(num_cols, 2 * span) >= t.min_programs:
        span *= 2
    return span


_decode = Launcher(_scores_decode_kernel)
_prefill = Launcher(_scores_prefill_kernel)
_mtp = Launcher(_scores_mtp_kernel)
_FREE = ("q_ptr", "bt_ptr", "row0", "stride_qt", "stride_qh", "stride_qd", "stride_btr", "stride_btp")


# Decode and MTP score launches whose chunk's scores take at most this many bytes store them with
# an L2 evict_last hint: the top-k launch reads them next, and the index keys streaming through L2
# behind them evicted them at 1M context (bit-equal either way; H200 figures in NOTES.md (Kernels)).
# A quarter of the H200's 60 MB L2 (16 MiB: a 1M x 16-row chunk; every measured chunk fits):
# larger chunks would hold most of L2 at high priority until the next layer overwrites them.
# Per-row samples always (2 MiB at 256 rows up to 1M context).
SCORES_L2_BYTES = 16 << 20


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32. A double quotient of fp32 values rounded so is their fp32
    quotient (53 >= 2 x 24 + 2 bits): the same bits as dividing fp32 tensors, with no tensor."""
    return struct.unpack("f", struct.pack("f", x))[0]


def dot_dtype(q_idx: torch.Tensor, compressed: torch.Tensor, interpret: bool) -> tl.dtype:
    """The score dots' operand dtype, one that holds both sides' values exactly: fp16 where both
    are fp8 (every e4m3 / e5m2 value is an fp16 one, so the scores keep their bits, and sm_90
    converts a pair in one instruction, bf16 in several), bf16 where each is bf16 or fp8, else
    (and in the interpreter) fp32."""
    dtypes = (q_idx.dtype, compressed.dtype)
    if interpret or not all(d == torch.bfloat16 or d in _FP8 for d in dtypes):
        return tl.float32
    return tl.float16 if all(d in _FP8 for d in dtypes) else tl.bfloat16


class ScoreLaunch:
    """The score launch of one chunk of `rows` rows (from a free first row `row0`) bound to
    the compressed keys [pages, page_size / r, Di], token_to_req / visible_blocks int32 [T]
    and the score scratch fp32 [>= rows, num_cols]; `__call__(q_idx [T, Hi, Di], block_table
    int32 [R, P], row0)` launches it. q_idx's dtype is fixed at binding. `score` overrides
    the tiles (`score_tiles`; benchmarks). samples int32 [>= rows, cdiv(num_cols, block_g /
    sample_sub)] (prefill only): the launch also writes the top-k's samples there
    (`select_prefill`: sample_sub per score tile of block_g columns). row_samples = WBITS > 0
    (the one-row decode kernel, with samples int32 [>= rows, 2^WBITS], sample_sub 0): it also
    writes each row's samples at a stride of its own (`sample_shift`: a power of two up to
    block_g, from the row's visible count), for `select_prefill`'s decode route."""

    def __init__(self, q_idx: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                 token_to_req: torch.Tensor, visible_blocks: torch.Tensor, scores: torch.Tensor, *, row0: int,
                 rows: int, num_cols: int, page_size: int, compress_ratio: int, block_topk: int, decode: bool,
                 tiles: Any, options: KernelOptions = DEFAULT, score: ScoreTiles | None = None,
                 samples: torch.Tensor | None = None, sample_sub: int = 0, row_samples: int = 0) -> None:
        _, Hi, Di = q_idx.shape
        interpret = options.interpreter
        t = score or score_tiles(decode, tiles, options.small_tiles, compressed.element_size(), num_cols)
        rpr = tiles.rows_per_request
        # a request's rows per program (rows x heads <= 64 on the dot's M, else one row per program)
        mtp = decode and t.request_rows and rpr > 1 and triton.next_power_of_2(Hi) * triton.next_power_of_2(rpr) <= 64
        per_row = decode and not mtp and (t.block_r == 1 or Hi > 4)  # the decode kernel: one row per program
        HP = triton.next_power_of_2(Hi)
        block_r = max(t.block_r, 16 // HP)  # rows x heads >= 16 on the dot's M
        row_tiles = rows if per_row else triton.cdiv(rows, rpr) if mtp else triton.cdiv(rows, block_r)
        span = _span(t, row_tiles, num_cols)
        if span % t.block_g:
            raise ValueError(f"score span {span} must be a multiple of block_g {t.block_g}")
        common = dict(HI=Hi, DI=Di, DP=triton.next_power_of_2(Di), PAGE=page_size, R=compress_ratio, KB=block_topk,
                      BLOCK_G=t.block_g, STAGES=t.stages, SPAN_TILES=span // t.block_g if interpret else 0,
                      DOT_DTYPE=dot_dtype(q_idx, compressed, interpret))
        spans = triton.cdiv(num_cols, span)
        log_g = t.block_g.bit_length() - 1
        if row_samples and (samples is None or sample_sub or not per_row or t.block_g != 1 << log_g
                            or samples.shape[1] < 1 << row_samples or num_cols > 1 << (row_samples + log_g)):
            raise ValueError(f"per-row score samples need the one-row decode launch (MTP rows: select_prefill's "
                             f"sample launch), samples [rows, >= 2^{row_samples}] and num_cols <= "
                             f"2^{row_samples} x block_g {t.block_g}, "
                             f"got {None if samples is None else tuple(samples.shape)}")
        if samples is not None and not row_samples and (
                per_row or mtp or sample_sub < 1 or t.block_g % sample_sub or sample_sub & (sample_sub - 1)
                or samples.shape[1] < triton.cdiv(num_cols, t.block_g // sample_sub)):
            raise ValueError(f"score samples need the prefill kernel, sample_sub a power of two and >= "
                             f"cdiv(num_cols, block_g {t.block_g} / sample_sub) columns, got {sample_sub} and "
                             f"{tuple(samples.shape)}")
        sampled = samples if samples is not None else scores  # (unread without samples)
        args = (
            q_idx, compressed, block_table, token_to_req, visible_blocks, scores, sampled,
            row0, *(() if per_row else (rows,)), num_cols, span, math.sqrt(Di),
            _fp32(1.0 / _fp32(math.sqrt(Di))),  # fp32 1 / sqrt(Di): binding reads no tensor
            *q_idx.stride(), *compressed.stride(), *block_table.stride(), scores.stride(0), sampled.stride(0),
        )
        if row_samples:
            common.update(ROW_SAMPLES=row_samples, LOG_G=log_g)
        # whole tiles address a row tile's cells with int32 offsets from its first row
        whole = t.whole and t.pack and Hi <= 4 and Di == triton.next_power_of_2(Di) \
            and block_r * scores.stride(0) + num_cols < 2**31
        fast_div = t.fast_div and Di & (Di - 1) == 0 and (INTERPRETER_FMA_FUSED or not interpret)
        keep = rows * num_cols * scores.element_size() <= SCORES_L2_BYTES
        if mtp:
            rp = triton.next_power_of_2(rpr)
            self._launch = _mtp.bind((row_tiles, spans), *args, free=_FREE, options=options, HM=max(16, HP * rp), RPR=rpr, RP=rp,
                                     FAST_DIV=fast_div, KEEP=keep, **common, num_warps=t.num_warps,
                                     **({"maxnreg": t.max_regs} if t.max_regs else {}))
        elif per_row:
            regs = t.max_regs or (SAMPLES_MAX_REGS if row_samples else 0)
            self._launch = _decode.bind((rows, spans), *args, free=_FREE, options=options, FAST_DIV=fast_div, KEEP=keep,
                                        HM=max(16, triton.next_power_of_2(Hi)), **common, num_warps=t.num_warps,
                                        **({"maxnreg": regs} if regs else {}))
        else:  # prefill, or MTP rows of a mixed step sharing each key tile (rows x heads packed)
            self._launch = _prefill.bind((row_tiles, spans), *args, free=_FREE, options=options, BLOCK_R=block_r,
                                         PACK=t.pack and Hi <= 4, HP=HP,
                                         FAST_DIV=fast_div, WHOLE=whole,
                                         SAMPLE=sample_sub if samples is not None else 0, **common,
                                         num_warps=t.num_warps, **({"maxnreg": t.max_regs} if t.max_regs else {}))

    def __call__(self, q_idx: torch.Tensor, block_table: torch.Tensor, row0: int) -> None:
        sq, sb = q_idx.stride(), block_table.stride()
        self._launch(q_idx, block_table, row0, sq[0], sq[1], sq[2], sb[0], sb[1])
