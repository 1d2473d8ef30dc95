"""Triton selection: group scores over compressed keys, then an exact top-k in a total order.

Contract: `qsa_core/reference/select.py`. Per chunk of rows (host ints only, no sync):

1. Scores s(t, g) = sum_h relu(q[t,h].k_g) / sqrt(Di) in fp32 go to a capped scratch
   [chunk rows, max_seq_len // r], only for rows with visible > Kb and columns g < visible;
   nothing else of the scratch is read. Decode (`_scores_decode_kernel`, grid: rows x column
   tiles): a row's heads are the dot's M. Prefill (`_scores_prefill_kernel`, grid: row tiles
   x column tiles): rows of one request are the dot's M, one dot per head.
2. Top-k, fused (`_topk_row_kernel`, grid: rows; used for few rows over few columns):
   one program per row runs the four radix passes over its scores with in-register
   histograms, then emits the chosen groups in ascending order - one launch. Otherwise
   (few rows over very many columns, where one program per row would idle the GPU):
   radix select on the score bit pattern (scores >= 0, -0.0 folded into +0.0, so the int32
   bits order like the values): four passes of `_hist_kernel` (grid: rows x column tiles,
   atomic 256-bin histograms of the next digit among keys that match the prefix so far)
   and `_resolve_kernel` (grid: rows) that picks the digit holding the k-th largest key.
   A row stops refining once every key of its bin is taken.
3. `_count_kernel` + `_emit_kernel` (grid: rows x column tiles) take every key above the
   threshold prefix and the lowest-index keys equal to it, and write their group indices in
   ascending order (per-tile counts give each tile's output offset). Rows with visible <= Kb
   take groups 0..visible-1 without scoring.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Cap on the fp32 score scratch of one chunk of rows (bytes); never [rows, all columns].
SCORE_SCRATCH_BYTES = 64 << 20
# Fused per-row top-k only for few rows over few columns, where the ten launches of the
# radix passes dominate (H200, 8K context: 4 rows 33 -> 24 us, 256 rows 78 -> 64 us); one
# program per row is slower than the passes beyond ~4K columns (4 rows at 128K: 135 vs
# 45 us) or for many rows (16K rows at 16K context: 1.9 vs 1.7 ms).
_FUSED_MAX_COLS = 4096
_FUSED_MAX_ROWS = 256

_BINS = 256
# (shift, width) of the radix digits of a non-negative fp32 bit pattern (bit 31 is 0).
_PASSES = ((23, 8), (15, 8), (7, 8), (0, 7))
_EXACT_DOT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _score_scratch(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """fp32 [rows, cols] score scratch (uninitialised; tests poison it with NaN)."""
    return torch.empty(rows, cols, dtype=torch.float32, device=device)


def _tiles(decode: bool) -> dict[str, int]:
    """Tile sizes. block_r x block_g: prefill score tile (block_r rows feed tl.dot); block_g
    alone for decode (one row per program, heads feed tl.dot); scan: columns per radix tile;
    rows / resolve_rows: rows per radix / resolve program. The interpreter uses small column
    tiles (tests cross tile borders) and many rows per program (its cost is per program)."""
    if _interpreting():
        return dict(block_r=16, block_g=16, scan=32, rows=8, resolve_rows=16)
    return dict(block_r=64, block_g=128 if decode else 64, scan=4096, rows=1, resolve_rows=4)


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


@triton.jit
def _rows_state(vis_ptr, row0, n_rows, n_cols, ROWS: tl.constexpr):
    """Local rows [ROWS] of this program, their mask and visible groups (clamped to n_cols)."""
    lr = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_chunk = lr < n_rows
    vis = tl.minimum(tl.load(vis_ptr + row0 + lr, mask=in_chunk, other=0), n_cols)
    return lr, in_chunk, vis


@triton.jit
def _keys(s_ptr, lr, cols, mask, stride_sr):
    """int32 keys [ROWS, BLOCK] of scores (>= 0, or NaN): the bits order like the values."""
    s = tl.load(s_ptr + lr.to(tl.int64)[:, None] * stride_sr + cols, mask=mask, other=0.0)
    return s.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "stride_sr"])
def _hist_kernel(
    s_ptr, vis_ptr, state_ptr, hist_ptr, row0, n_rows, n_cols, stride_sr,
    KB: tl.constexpr, FIRST: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
    BINS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """One radix pass over one column tile of ROWS rows: histogram of the digit
    (key >> SHIFT) & (2^WIDTH - 1) of keys whose bits above SHIFT + WIDTH equal the row's
    prefix; hist int32 [rows, BINS] += (row r's digits are binned at r * BINS + digit)."""
    lr, in_chunk, vis = _rows_state(vis_ptr, row0, n_rows, n_cols, ROWS)
    start = tl.program_id(1) * BLOCK
    if FIRST:
        prefix = lr * 0
        refine = in_chunk & (vis > KB)
    else:
        prefix = tl.load(state_ptr + lr * 4, mask=in_chunk, other=0)
        refine = tl.load(state_ptr + lr * 4 + 3, mask=in_chunk, other=0) != 0
    refine = refine & (start < vis)
    if tl.max(refine.to(tl.int32), 0) > 0:
        cols = start + tl.arange(0, BLOCK)[None, :]
        mask = refine[:, None] & (cols < vis[:, None])
        key = _keys(s_ptr, lr, cols, mask, stride_sr)
        match = mask & ((key >> (SHIFT + WIDTH)) == prefix[:, None])
        local = tl.arange(0, ROWS)[:, None] * BINS + ((key >> SHIFT) & ((1 << WIDTH) - 1))
        counts = tl.histogram(tl.reshape(local, (ROWS * BLOCK,)), ROWS * BINS,
                              mask=tl.reshape(match, (ROWS * BLOCK,)))
        slot = (tl.program_id(0) * ROWS).to(tl.int64) * BINS + tl.arange(0, ROWS * BINS)
        tl.atomic_add(hist_ptr + slot, counts, mask=counts > 0, sem="relaxed")


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols"])
def _resolve_kernel(
    vis_ptr, state_ptr, hist_ptr, row0, n_rows, n_cols,
    KB: tl.constexpr, FIRST: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
    BINS: tl.constexpr, ROWS: tl.constexpr,
):
    """Pick the digit holding each row's need-th largest key; state int32 [rows, 4] =
    (prefix, need: keys still to take from the prefix's bin, shift of the prefix, refine)."""
    lr, in_chunk, vis = _rows_state(vis_ptr, row0, n_rows, n_cols, ROWS)
    if FIRST:
        prefix = lr * 0
        need = lr * 0 + KB
        shift = lr * 0 + 31
        refine = vis > KB
    else:
        prefix = tl.load(state_ptr + lr * 4, mask=in_chunk, other=0)
        need = tl.load(state_ptr + lr * 4 + 1, mask=in_chunk, other=0)
        shift = tl.load(state_ptr + lr * 4 + 2, mask=in_chunk, other=0)
        refine = tl.load(state_ptr + lr * 4 + 3, mask=in_chunk, other=0) != 0
    bins = tl.arange(0, BINS)[None, :]
    h_off = lr.to(tl.int64)[:, None] * BINS + bins
    counts = tl.load(hist_ptr + h_off, mask=in_chunk[:, None], other=0)
    tl.store(hist_ptr + h_off, counts * 0, mask=in_chunk[:, None])  # zero for the next pass
    at_or_above = tl.sum(counts, 1)[:, None] - tl.cumsum(counts, 1) + counts
    b = tl.max(tl.where(at_or_above >= need[:, None], bins, -1), 1)
    in_b = tl.sum(tl.where(bins == b[:, None], counts, 0), 1)
    new_need = need - (tl.sum(tl.where(bins == b[:, None], at_or_above, 0), 1) - in_b)
    tl.store(state_ptr + lr * 4, tl.where(refine, (prefix << WIDTH) | b, prefix), mask=in_chunk)
    tl.store(state_ptr + lr * 4 + 1, tl.where(refine, new_need, need), mask=in_chunk)
    tl.store(state_ptr + lr * 4 + 2, tl.where(refine, SHIFT, shift), mask=in_chunk)
    tl.store(state_ptr + lr * 4 + 3, (refine & (in_b > new_need)).to(tl.int32), mask=in_chunk)


@triton.jit
def _take(s_ptr, state_ptr, lr, live, cols, vis, stride_sr):
    """(above, equal) int32 [ROWS, BLOCK]: keys above / at the row's threshold prefix."""
    mask = live[:, None] & (cols < vis[:, None])
    key = _keys(s_ptr, lr, cols, mask, stride_sr)
    prefix = tl.load(state_ptr + lr * 4, mask=live, other=0)
    shift = tl.load(state_ptr + lr * 4 + 2, mask=live, other=0)
    top = key >> shift[:, None]
    return (mask & (top > prefix[:, None])).to(tl.int32), (mask & (top == prefix[:, None])).to(tl.int32)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "n_tiles", "stride_sr"])
def _count_kernel(
    s_ptr, vis_ptr, state_ptr, cnt_ptr, row0, n_rows, n_cols, n_tiles, stride_sr,
    KB: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """Per row and tile: keys above the threshold and keys equal to it; cnt int32 [rows, tiles, 2]."""
    lr, in_chunk, vis = _rows_state(vis_ptr, row0, n_rows, n_cols, ROWS)
    tile = tl.program_id(1)
    start = tile * BLOCK
    live = in_chunk & (vis > KB) & (start < vis)
    if tl.max(live.to(tl.int32), 0) > 0:
        cols = start + tl.arange(0, BLOCK)[None, :]
        above, equal = _take(s_ptr, state_ptr, lr, live, cols, vis, stride_sr)
        base = (lr.to(tl.int64) * n_tiles + tile) * 2
        tl.store(cnt_ptr + base, tl.sum(above, 1), mask=live)
        tl.store(cnt_ptr + base + 1, tl.sum(equal, 1), mask=live)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "n_tiles", "stride_sr"])
def _emit_kernel(
    s_ptr, vis_ptr, state_ptr, cnt_ptr, out_ptr, row0, n_rows, n_cols, n_tiles, stride_sr,
    stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, BLOCK: tl.constexpr, PREV: tl.constexpr, ROWS: tl.constexpr,
):
    """Write the chosen groups of one tile at their ascending-order positions in out
    int32 [T, KB]; tile 0 of a row with visible <= KB writes 0..visible-1 then -1."""
    lr, in_chunk, vis = _rows_state(vis_ptr, row0, n_rows, n_cols, ROWS)
    tile = tl.program_id(1)
    out_row = out_ptr + (row0 + lr).to(tl.int64)[:, None] * stride_or
    short = in_chunk & (vis <= KB)
    if tile == 0:
        j = tl.arange(0, KBP)[None, :]
        tl.store(out_row + j * stride_oc, tl.where(j < vis[:, None], j, -1), mask=short[:, None] & (j < KB))
    start = tile * BLOCK
    live = in_chunk & (vis > KB) & (start < vis)
    if tl.max(live.to(tl.int32), 0) > 0:
        # Chosen keys in earlier tiles: above-threshold counts and threshold ties.
        taken = lr * 0
        equal_before = lr * 0
        cnt_row = cnt_ptr + lr.to(tl.int64)[:, None] * n_tiles * 2
        t0 = tile * 0
        while t0 < tile:
            t = t0 + tl.arange(0, PREV)[None, :]
            t_mask = live[:, None] & (t < tile)
            taken += tl.sum(tl.load(cnt_row + t * 2, mask=t_mask, other=0), 1)
            equal_before += tl.sum(tl.load(cnt_row + t * 2 + 1, mask=t_mask, other=0), 1)
            t0 += PREV
        need = tl.load(state_ptr + lr * 4 + 1, mask=live, other=0)
        cols = start + tl.arange(0, BLOCK)[None, :]
        above, equal = _take(s_ptr, state_ptr, lr, live, cols, vis, stride_sr)
        # Ties at the threshold: the lowest group indices first (exclusive running rank).
        tie_rank = equal_before[:, None] + tl.cumsum(equal, 1) - equal
        chosen = above + equal * (tie_rank < need[:, None]).to(tl.int32)
        taken += tl.minimum(equal_before, need)
        pos = taken[:, None] + tl.cumsum(chosen, 1) - chosen
        tl.store(out_row + pos * stride_oc, cols + lr[:, None] * 0, mask=chosen > 0)


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr"])
def _topk_row_kernel(
    s_ptr, vis_ptr, out_ptr, row0, n_cols, stride_sr, stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Whole top-k of one row in one program: four radix passes over the bytes of the fp32
    score bits (high byte first) with in-register histograms narrow the threshold to the
    exact k-th key; one more sweep writes keys above it and the lowest-index ties, ascending."""
    lr = tl.program_id(0)
    row = row0 + lr
    vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    s_row = s_ptr + lr.to(tl.int64) * stride_sr
    j = tl.arange(0, KBP)
    if vis <= KB:
        tl.store(out_row + j * stride_oc, tl.where(j < vis, j, -1), mask=j < KB)
    else:
        bins = tl.arange(0, BINS)
        prefix = vis * 0  # the threshold's bytes resolved so far
        need = vis * 0 + KB  # keys still to take from the threshold's bin
        for p in tl.static_range(4):
            hist = tl.zeros((BINS,), tl.int32)
            start = vis * 0
            while start < vis:  # (while: the interpreter cannot range over loaded values)
                cols = start + tl.arange(0, BLOCK)
                mask = cols < vis
                key = tl.load(s_row + cols, mask=mask, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
                if p == 0:
                    match = mask
                else:
                    match = mask & ((key >> (32 - 8 * p)) == prefix)
                hist += tl.histogram((key >> (24 - 8 * p)) & 255, BINS, mask=match)
                start += BLOCK
            at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
            b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
            need -= tl.sum(tl.where(bins == b, at_or_above - hist, 0), 0)
            prefix = (prefix << 8) | b
        taken = vis * 0
        ties = vis * 0
        start = vis * 0
        while start < vis:
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vis
            key = tl.load(s_row + cols, mask=mask, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            above = (mask & (key > prefix)).to(tl.int32)
            equal = (mask & (key == prefix)).to(tl.int32)
            rank = ties + tl.cumsum(equal, 0) - equal  # ties go to the lowest group indices
            chosen = above + equal * (rank < need).to(tl.int32)
            pos = taken + tl.cumsum(chosen, 0) - chosen
            tl.store(out_row + pos * stride_oc, cols, mask=chosen > 0)
            taken += tl.sum(chosen, 0)
            ties += tl.sum(equal, 0)
            start += BLOCK


@dataclass(frozen=True)
class SelectWorkspace:
    """Persistent scratch of selection (flat; a schedule takes views): fp32 scores and the
    int32 radix histograms (zero between uses: each resolve pass clears what it read),
    states and per-tile counts."""

    scores: torch.Tensor
    hist: torch.Tensor
    state: torch.Tensor
    counts: torch.Tensor


def select_workspace(max_rows: int, max_cols: int, block_topk: int, device: torch.device | str) -> SelectWorkspace:
    """Scratch for any `plan_select` with num_rows <= max_rows and num_cols <= max_cols."""
    dev = torch.device(device)
    cols = max(max_cols, 1)
    if cols <= block_topk:  # nothing is ever scored
        return SelectWorkspace(*(torch.empty(0, dtype=dt, device=dev) for dt in (torch.float32,) + (torch.int32,) * 3))
    tiles = _tiles(decode=True)  # both kinds share the radix tiles
    max_chunk = min(max_rows, max(1, SCORE_SCRATCH_BYTES // (4 * (block_topk + 1))))
    score_elems = max(min(max_chunk * cols, SCORE_SCRATCH_BYTES // 4), cols)
    hist_rows = triton.cdiv(max_chunk, tiles["rows"]) * tiles["rows"]
    # chunk * n_tiles <= chunk + chunk * cols / scan, and chunk * cols <= score_elems.
    count_slots = max_chunk + score_elems // tiles["scan"] + 1
    return SelectWorkspace(
        scores=_score_scratch(1, score_elems, dev).view(-1),
        hist=torch.zeros(hist_rows * _BINS, dtype=torch.int32, device=dev),
        state=torch.empty(max_chunk * 4, dtype=torch.int32, device=dev),
        counts=torch.empty(count_slots * 2, dtype=torch.int32, device=dev),
    )


@dataclass(frozen=True)
class SelectSchedule:
    """How one select call runs, fixed when the step is planned (host ints and views only).

    num_cols: the column bound (groups of the longest request); chunk: rows per scratch
    pass; scored: any row may have more than Kb visible groups; fused: the one-launch
    per-row top-k, else the radix passes; the views scores fp32 [chunk, num_cols], hist,
    state, counts (unused ones alias `scores`).
    """

    num_rows: int
    num_cols: int
    chunk: int
    scored: bool
    fused: bool
    decode: bool
    n_tiles: int
    tiles: dict
    interpret: bool
    scores: torch.Tensor
    hist: torch.Tensor
    state: torch.Tensor
    counts: torch.Tensor


def plan_select(
    num_rows: int,
    num_cols: int,
    block_topk: int,
    *,
    decode: bool,
    device: torch.device | str,
    workspace: SelectWorkspace | None = None,
) -> SelectSchedule:
    """Schedule of a decode or prefill select over num_rows rows and num_cols columns.

    num_cols = max_seq_len // r, the bound on any row's visible groups. Scratch views come
    from `workspace` (CUDA-graph safe) or are allocated here.
    """
    Kb = block_topk
    n_cols = max(num_cols, 1)
    tiles = _tiles(decode)
    scan = tiles["scan"]
    n_tiles = triton.cdiv(n_cols, scan)
    scored = n_cols > Kb
    chunk = min(num_rows, max(1, SCORE_SCRATCH_BYTES // (4 * n_cols))) if scored else max(num_rows, 1)
    chunk = max(chunk, 1)
    fused = n_cols <= _FUSED_MAX_COLS and chunk <= _FUSED_MAX_ROWS
    rows = tiles["rows"]
    if workspace is None and scored:
        workspace = SelectWorkspace(
            scores=_score_scratch(chunk, n_cols, torch.device(device)).view(-1),
            hist=torch.zeros(triton.cdiv(chunk, rows) * rows * _BINS, dtype=torch.int32, device=device),
            state=torch.empty(chunk * 4, dtype=torch.int32, device=device),
            counts=torch.empty(chunk * n_tiles * 2, dtype=torch.int32, device=device),
        )
    if scored:
        need = dict(scores=chunk * n_cols, hist=triton.cdiv(chunk, rows) * rows * _BINS, state=chunk * 4,
                    counts=chunk * n_tiles * 2)
        for name, n in need.items():
            if getattr(workspace, name).numel() < n:
                raise ValueError(f"select workspace.{name} holds {getattr(workspace, name).numel()} < {n} elements")
        scores = workspace.scores[: chunk * n_cols].view(chunk, n_cols)
        hist = workspace.hist[: need["hist"]].view(-1, _BINS)
        state = workspace.state[: chunk * 4].view(chunk, 4)
        counts = workspace.counts[: need["counts"]].view(chunk, n_tiles, 2)
    else:
        scores = hist = state = counts = torch.empty(1, 1, dtype=torch.float32, device=device)
    return SelectSchedule(
        num_rows=num_rows, num_cols=n_cols, chunk=chunk, scored=scored, fused=fused, decode=decode,
        n_tiles=n_tiles, tiles=tiles, interpret=_interpreting(),
        scores=scores, hist=hist, state=state, counts=counts,
    )


def _select(
    q_idx: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    visible_blocks: torch.Tensor,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    out: torch.Tensor,
    s: SelectSchedule,
) -> torch.Tensor:
    """Shared body of the decode / prefill ops: launches only; see the module docstring."""
    T, Hi, Di = q_idx.shape
    if T == 0:
        return out
    if T != s.num_rows:
        raise ValueError(f"the select schedule was planned for {s.num_rows} rows, got {T}")
    Kb, n_cols, chunk, tiles, decode = block_topk, s.num_cols, s.chunk, s.tiles, s.decode
    rows, n_tiles = tiles["rows"], s.n_tiles
    scores, hist, state, counts = s.scores, s.hist, s.state, s.counts
    bf16_dot = not s.interpret and q_idx.dtype in _EXACT_DOT_DTYPES and compressed.dtype in _EXACT_DOT_DTYPES
    scan = dict(BLOCK=tiles["scan"], ROWS=rows, num_warps=8 if tiles["scan"] >= 2048 else 4)
    for row0 in range(0, T, chunk):
        n = min(chunk, T - row0)
        scan_grid = (triton.cdiv(n, rows), n_tiles)
        if s.scored:
            args = (
                q_idx, compressed, block_table, token_to_req, visible_blocks, scores,
                row0, *(() if decode else (n,)), n_cols, math.sqrt(Di),
                q_idx.stride(0), q_idx.stride(1), q_idx.stride(2),
                compressed.stride(0), compressed.stride(1), compressed.stride(2),
                block_table.stride(0), block_table.stride(1), scores.stride(0),
            )
            common = dict(HI=Hi, DI=Di, DP=triton.next_power_of_2(Di), PAGE=page_size, R=compress_ratio, KB=Kb,
                          BLOCK_G=tiles["block_g"], DOT_DTYPE=tl.bfloat16 if bf16_dot else tl.float32)
            col_tiles = triton.cdiv(n_cols, tiles["block_g"])
            if decode:
                _scores_decode_kernel[(n, col_tiles)](
                    *args, HM=max(16, triton.next_power_of_2(Hi)), **common, num_warps=4)
            else:
                _scores_prefill_kernel[(triton.cdiv(n, tiles["block_r"]), col_tiles)](
                    *args, BLOCK_R=tiles["block_r"], **common, num_warps=8)
        if s.fused:
            _topk_row_kernel[(n,)](
                scores, visible_blocks, out, row0, n_cols, scores.stride(0), out.stride(0), out.stride(1),
                KB=Kb, KBP=triton.next_power_of_2(Kb), BINS=_BINS, BLOCK=scan["BLOCK"], num_warps=8,
            )
            continue
        if s.scored:
            for i, (shift, width) in enumerate(_PASSES):
                radix = dict(KB=Kb, FIRST=i == 0, SHIFT=shift, WIDTH=width, BINS=_BINS)
                _hist_kernel[scan_grid](
                    scores, visible_blocks, state, hist, row0, n, n_cols, scores.stride(0), **radix, **scan,
                )
                _resolve_kernel[(triton.cdiv(n, tiles["resolve_rows"]),)](
                    visible_blocks, state, hist, row0, n, n_cols, **radix, ROWS=tiles["resolve_rows"],
                )
            _count_kernel[scan_grid](
                scores, visible_blocks, state, counts, row0, n, n_cols, n_tiles, scores.stride(0), KB=Kb, **scan,
            )
        _emit_kernel[scan_grid](
            scores, visible_blocks, state, counts, out, row0, n, n_cols, n_tiles, scores.stride(0),
            out.stride(0), out.stride(1), KB=Kb, KBP=triton.next_power_of_2(Kb), PREV=64, **scan,
        )
    return out


def qsa_select_decode(
    q_idx: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    visible_blocks: torch.Tensor,
    *,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    out: torch.Tensor,
    schedule: SelectSchedule,
) -> torch.Tensor:
    """Decode rows: q_idx [Td, Hi, Di], compressed [pages, page_size / r, Di] (any page / row
    stride) -> out int32 [Td, Kb].

    schedule: `plan_select(Td, max_seq_len // r, Kb, decode=True, ...)`; launches only.
    """
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size,
                   compress_ratio, block_topk, out, schedule)


def qsa_select_prefill(
    q_idx: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    visible_blocks: torch.Tensor,
    *,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    out: torch.Tensor,
    schedule: SelectSchedule,
) -> torch.Tensor:
    """Prefill rows (same contract as decode); scores in row chunks under a memory cap.

    schedule: `plan_select(Tp, max_seq_len // r, Kb, decode=False, ...)`; launches only.
    """
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size,
                   compress_ratio, block_topk, out, schedule)
