"""Triton exact top-k of scored rows, in the total order of design.md §2.7 (ties: lowest group).

Contract: `qsa_core.reference.select` (the top-k of group scores). Input: a chunk's fp32
score scratch [chunk rows, num_cols] (scores >= 0, -0.0 folded into +0.0, so the int32 bits
order like the values); output: the chosen groups of each row in ascending order, -1 padded.

- Fused (`_topk_row_kernel`, grid: rows; for few rows over few columns): one program per
  row runs the four radix passes over its scores with in-register histograms, then emits
  the chosen groups - one launch.
- Radix (few rows over very many columns, where one program per row would idle the GPU):
  four passes of `_hist_kernel` (grid: rows x column tiles, atomic 256-bin histograms of
  the next digit among keys that match the prefix so far; the last program of a row block
  to arrive picks the digit holding the k-th largest key); a row stops refining once every
  key of its bin is taken. Then `_count_kernel` + `_emit_kernel` (grid: rows x column
  tiles) take every key above the threshold prefix and the lowest-index keys equal to it
  (per-tile counts give each tile's output offset). Rows with visible <= Kb take groups
  0..visible-1 without scores.

`TopkLaunch` binds one chunk's launches (`launch.py`); per call only the chunk's first row.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .select_common import packed_groups, packed_tail
from .launch import BoundLaunch, Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions

BINS = 256
# (shift, width) of the radix digits of a non-negative fp32 bit pattern (bit 31 is 0).
PASSES = ((23, 8), (15, 8), (7, 8), (0, 7))


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


@triton.jit
def _resolve_rows(lr, in_chunk, vis, state_ptr, hist_ptr, KB: tl.constexpr, FIRST: tl.constexpr,
                  SHIFT: tl.constexpr, WIDTH: tl.constexpr, BINS: tl.constexpr):
    """Pick the digit holding each row's need-th largest key from its finished histogram
    (zeroed here for the next pass); state int32 [rows, 4] = (prefix, need: keys still to
    take from the prefix's bin, shift of the prefix, refine)."""
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
    counts = tl.load(hist_ptr + h_off, mask=in_chunk[:, None], other=0, cache_modifier=".cg")
    tl.store(hist_ptr + h_off, counts * 0, mask=in_chunk[:, None])
    at_or_above = tl.sum(counts, 1)[:, None] - tl.cumsum(counts, 1) + counts
    b = tl.max(tl.where(at_or_above >= need[:, None], bins, -1), 1)
    in_b = tl.sum(tl.where(bins == b[:, None], counts, 0), 1)
    new_need = need - (tl.sum(tl.where(bins == b[:, None], at_or_above, 0), 1) - in_b)
    tl.store(state_ptr + lr * 4, tl.where(refine, (prefix << WIDTH) | b, prefix), mask=in_chunk)
    tl.store(state_ptr + lr * 4 + 1, tl.where(refine, new_need, need), mask=in_chunk)
    tl.store(state_ptr + lr * 4 + 2, tl.where(refine, SHIFT, shift), mask=in_chunk)
    tl.store(state_ptr + lr * 4 + 3, (refine & (in_b > new_need)).to(tl.int32), mask=in_chunk)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "n_tiles", "stride_sr"])
def _hist_kernel(
    s_ptr, vis_ptr, state_ptr, hist_ptr, arrive_ptr, row0, n_rows, n_cols, n_tiles, stride_sr,
    KB: tl.constexpr, FIRST: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
    BINS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """One radix pass over one column tile of ROWS rows: histogram of the digit
    (key >> SHIFT) & (2^WIDTH - 1) of keys whose bits above SHIFT + WIDTH equal the row's
    prefix; hist int32 [rows, BINS] += (row r's digits are binned at r * BINS + digit). The
    last of the row block's n_tiles programs to arrive (arrive int32 [row blocks], zero
    between passes) resolves the pass for its rows (`_resolve_rows`)."""
    pdl_start(PDL)
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
    tl.debug_barrier()  # this program's histogram adds before its arrival
    block = tl.program_id(0)
    if tl.atomic_add(arrive_ptr + block, 1, sem="acq_rel", scope="gpu") == n_tiles - 1:
        tl.store(arrive_ptr + block, 0)  # zero for the next pass
        _resolve_rows(lr, in_chunk, vis, state_ptr, hist_ptr, KB, FIRST, SHIFT, WIDTH, BINS)
    pdl_end(PDL)


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
    PDL: tl.constexpr = 0,
):
    """Per row and tile: keys above the threshold and keys equal to it; cnt int32 [rows, tiles, 2]."""
    pdl_start(PDL)
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
    pdl_end(PDL)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "n_tiles", "stride_sr"])
def _emit_kernel(
    s_ptr, vis_ptr, state_ptr, cnt_ptr, out_ptr, pos_ptr, row0, n_rows, n_cols, n_tiles, stride_sr,
    stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, BLOCK: tl.constexpr, PREV: tl.constexpr, ROWS: tl.constexpr,
    PACKED: tl.constexpr, R: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Write the chosen groups of one tile at their ascending-order positions in out
    int32 [T, KB]; tile 0 of a row with visible <= KB writes 0..visible-1 then -1.
    PACKED: out is the packed selection [T, W + 1] instead (each group's R tokens; tile 0
    writes every row's open tail, padding and count from positions int64 [T])."""
    pdl_start(PDL)
    lr, in_chunk, vis = _rows_state(vis_ptr, row0, n_rows, n_cols, ROWS)
    tile = tl.program_id(1)
    out_row = out_ptr + (row0 + lr).to(tl.int64)[:, None] * stride_or
    short = in_chunk & (vis <= KB)
    if tile == 0:
        j = tl.arange(0, KBP)[None, :]
        if PACKED:
            packed_groups(out_row, j, j, short[:, None] & (j < vis[:, None]), R)
            p = tl.load(pos_ptr + row0 + lr, mask=in_chunk, other=-1)
            packed_tail(out_row, tl.minimum(vis, KB)[:, None], vis[:, None], p[:, None], in_chunk[:, None],
                         R, W, BLOCK_W)
        else:
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
        put = (chosen > 0) & (pos.to(tl.uint32) < KB)  # the row's KB columns, whatever the counts say
        if PACKED:
            packed_groups(out_row, cols + lr[:, None] * 0, pos, put, R)
        else:
            tl.store(out_row + pos * stride_oc, cols + lr[:, None] * 0, mask=put)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr"])
def _topk_row_kernel(
    s_ptr, vis_ptr, out_ptr, pos_ptr, row0, n_cols, stride_sr, stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr,
    PACKED: tl.constexpr, R: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Whole top-k of one row in one program: four radix passes over the bytes of the fp32
    score bits (high byte first) with in-register histograms narrow the threshold to the
    exact k-th key; one more sweep writes keys above it and the lowest-index ties, ascending
    (PACKED: as the packed selection row, as `_emit_kernel`)."""
    pdl_start(PDL)
    lr = tl.program_id(0)
    row = row0 + lr
    vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    s_row = s_ptr + lr.to(tl.int64) * stride_sr
    j = tl.arange(0, KBP)
    if PACKED:
        packed_tail(out_row, tl.minimum(vis, KB), vis, tl.load(pos_ptr + row), True, R, W, BLOCK_W)
    if vis <= KB:
        if PACKED:
            packed_groups(out_row, j, j, j < vis, R)
        else:
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
            put = (chosen > 0) & (pos.to(tl.uint32) < KB)  # the row's KB columns, whatever the counts say
            if PACKED:
                packed_groups(out_row, cols, pos, put, R)
            else:
                tl.store(out_row + pos * stride_oc, cols, mask=put)
            taken += tl.sum(chosen, 0)
            ties += tl.sum(equal, 0)
            start += BLOCK
    pdl_end(PDL)


_hist = Launcher(_hist_kernel)
_count = Launcher(_count_kernel)
_emit = Launcher(_emit_kernel)
_topk_row = Launcher(_topk_row_kernel)


def packed_write(out: torch.Tensor, positions: torch.Tensor | None, visible_blocks: torch.Tensor,
                 compress_ratio: int) -> tuple[dict, torch.Tensor]:
    """The top-k writers' constexprs and position tensor: with positions int64 [T], out is the
    packed selection [T, W + 1] (contiguous rows); without, out holds the chosen groups and
    the (unread) position argument is visible_blocks."""
    packed = positions is not None
    if packed and out.stride(1) != 1:
        raise ValueError(f"the packed selection must have contiguous rows, got strides {out.stride()}")
    W = out.shape[1] - 1 if packed else 1
    write = dict(PACKED=packed, R=compress_ratio if packed else 1, W=W, BLOCK_W=min(1024, triton.next_power_of_2(W + 1)))
    return write, positions if packed else visible_blocks


class ChunkLaunches:
    """The bound top-k launches of one chunk of rows, each with whether it writes `out`;
    `__call__(row0, out, out_row_stride[, block_table])` runs them in order (the block table:
    for launches bound to warm the attention's K/V, `select_prefill.PrefillTopkLaunch`)."""

    _launches: list[tuple[BoundLaunch, bool]]

    def __call__(self, row0: int, out: torch.Tensor, out_row_stride: int, block_table: torch.Tensor | None = None) -> None:
        for launch, writes in self._launches:
            if writes:
                launch(row0, out, out_row_stride)
            else:
                launch(row0)


class TopkLaunch(ChunkLaunches):
    """The top-k launches of one chunk of `rows` rows (from a free first row `row0`) bound
    to the score scratch fp32 [>= rows, num_cols], visible_blocks int32 [T] and the radix
    scratch (hist int32 [>= rows, BINS] and arrive int32 [>= row blocks], zero; state int32
    [>= rows, 4]; counts int32 [>= rows, n_tiles, 2]); `__call__(row0, out, out_row_stride)` launches them into out:
    int32 [T, Kb] (any strides) or, with `positions` int64 [T] given, the packed selection
    int32 [T, W + 1] (contiguous rows; W = width - 1, r = compress_ratio).

    fused: the one-program-per-row kernel; else the radix passes (scored) and the emit
    (which alone writes rows with visible <= Kb when nothing is scored)."""

    def __init__(self, scores: torch.Tensor, visible_blocks: torch.Tensor, out: torch.Tensor, state: torch.Tensor,
                 hist: torch.Tensor, arrive: torch.Tensor, counts: torch.Tensor, *, row0: int, rows: int, num_cols: int, n_tiles: int,
                 block_topk: int, scored: bool, fused: bool, tiles: Any, positions: torch.Tensor | None = None,
                 compress_ratio: int = 1, options: KernelOptions = DEFAULT) -> None:
        Kb, KBP, sr = block_topk, triton.next_power_of_2(block_topk), scores.stride(0)
        write, pos = packed_write(out, positions, visible_blocks, compress_ratio)
        free = ("row0",)
        out_free = ("row0", "out_ptr", "stride_or")
        if fused:
            self._launches: list[tuple[BoundLaunch, bool]] = [(_topk_row.bind(
                (rows,), scores, visible_blocks, out, pos, row0, num_cols, sr, out.stride(0), out.stride(1),
                free=out_free, options=options, KB=Kb, KBP=KBP, BINS=BINS, BLOCK=tiles.scan, **write, num_warps=8,
            ), True)]
            return
        per = tiles.rows
        scan_grid = (triton.cdiv(rows, per), n_tiles)
        scan = dict(BLOCK=tiles.scan, ROWS=per, num_warps=8 if tiles.scan >= 2048 else 4)
        self._launches = []
        if scored:
            for i, (shift, width) in enumerate(PASSES):
                radix = dict(KB=Kb, FIRST=i == 0, SHIFT=shift, WIDTH=width, BINS=BINS)
                self._launches.append((_hist.bind(
                    scan_grid, scores, visible_blocks, state, hist, arrive, row0, rows, num_cols, n_tiles, sr,
                    free=free, options=options, **radix, **scan,
                ), False))
            self._launches.append((_count.bind(
                scan_grid, scores, visible_blocks, state, counts, row0, rows, num_cols, n_tiles, sr, free=free, options=options,
                KB=Kb, **scan,
            ), False))
        self._launches.append((_emit.bind(
            scan_grid, scores, visible_blocks, state, counts, out, pos, row0, rows, num_cols, n_tiles, sr,
            out.stride(0), out.stride(1), free=out_free, options=options, KB=Kb, KBP=KBP, PREV=64, **scan, **write,
        ), True))
