"""Triton selection: group scores over compressed keys, then an exact top-k in a total order.

Contract: `qsa_core/reference/select.py`. Per chunk of rows (host ints only, no sync):

1. `_scores_kernel` (grid: row tiles x column tiles) writes s(t, g) = sum_h relu(q[t,h].k_g)
   / sqrt(Di) in fp32 into a capped scratch [chunk rows, max_seq_len // r], only for rows
   with visible > Kb and only for columns g < visible. Nothing else of the scratch is read.
2. Radix select on the score bit pattern (scores >= 0, -0.0 folded into +0.0, so the int32
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

import torch
import triton
import triton.language as tl

# Cap on the fp32 score scratch of one chunk of rows (bytes); never [rows, all columns].
SCORE_SCRATCH_BYTES = 256 << 20

_BINS = 256
# (shift, width) of the radix digits of a non-negative fp32 bit pattern (bit 31 is 0).
_PASSES = ((23, 8), (15, 8), (7, 8), (0, 7))
_EXACT_DOT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _score_scratch(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """fp32 [rows, cols] score scratch (uninitialised; tests poison it with NaN)."""
    return torch.empty(rows, cols, dtype=torch.float32, device=device)


def _tiles(num_heads_p2: int, decode: bool) -> dict[str, int]:
    """Tile sizes. The interpreter uses small tiles so that tests cross tile borders."""
    if _interpreting():
        return dict(block_r=max(1, 16 // num_heads_p2), block_g=16, scan=32)
    rows = 16 if decode else 128
    return dict(block_r=max(1, rows // num_heads_p2), block_g=128 if decode else 64, scan=4096)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "stride_sr"])
def _scores_kernel(
    q_ptr, k_ptr, bt_ptr, req_ptr, vis_ptr, s_ptr,
    row0, n_rows, n_cols, norm,
    stride_qt, stride_qh, stride_qd, stride_kr, stride_kd, stride_btr, stride_btp, stride_sr,
    HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, KB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Scores of rows [row0 + pid0*BLOCK_R, +BLOCK_R) x groups [pid1*BLOCK_G, +BLOCK_G).

    q [T, HI, DI], keys [rows, DI] (bf16 / fp8 / fp32) -> s fp32 [chunk rows, n_cols].
    A row tile may span requests: each request in it loads its own keys once.
    """
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
        h = tl.arange(0, HP)
        d = tl.arange(0, DP)
        q_off = (rows.to(tl.int64)[:, None, None] * stride_qt + h[None, :, None] * stride_qh
                 + d[None, None, :] * stride_qd)
        q_mask = active[:, None, None] & (h[None, :, None] < HI) & (d[None, None, :] < DI)
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(DOT_DTYPE)
        q = tl.reshape(q, (BLOCK_R * HP, DP))
        g = col0 + tl.arange(0, BLOCK_G)
        tok = g * R
        cur = req_lo
        while cur <= req_hi:  # (a while loop: the interpreter cannot range over reductions)
            mine = active & (req == cur)
            g_end = tl.max(tl.where(mine, vis, 0), 0)
            if g_end > col0:
                g_mask = g < g_end
                page = tl.load(bt_ptr + cur.to(tl.int64) * stride_btr + (tok // PAGE) * stride_btp,
                               mask=g_mask, other=0)
                krow = page.to(tl.int64) * (PAGE // R) + (tok % PAGE) // R
                keys = tl.load(k_ptr + krow[:, None] * stride_kr + d[None, :] * stride_kd,
                               mask=g_mask[:, None] & (d[None, :] < DI), other=0.0).to(DOT_DTYPE)
                dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # fp32 [BLOCK_R*HP, BLOCK_G]
                dots = tl.reshape(tl.maximum(dots, 0.0), (BLOCK_R, HP, BLOCK_G))
                s = tl.math.div_rn(tl.sum(dots, 1), norm)
                s = tl.where(s == 0.0, 0.0, s)  # -0.0 == +0.0: one bit pattern for ties
                s_off = lr.to(tl.int64)[:, None] * stride_sr + g[None, :]
                tl.store(s_ptr + s_off, s, mask=mine[:, None] & (g[None, :] < vis[:, None]))
            cur += 1


@triton.jit
def _row_visible(vis_ptr, row, n_cols):
    return tl.minimum(tl.load(vis_ptr + row), n_cols)


@triton.jit
def _keys(s_ptr, lr, cols, col_mask, stride_sr):
    """int32 keys of scores (>= 0, or NaN): the bit pattern orders like the value."""
    s = tl.load(s_ptr + lr.to(tl.int64) * stride_sr + cols, mask=col_mask, other=0.0)
    return s.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr"])
def _hist_kernel(
    s_ptr, vis_ptr, state_ptr, hist_ptr, row0, n_cols, stride_sr,
    KB: tl.constexpr, FIRST: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
    BINS: tl.constexpr, BLOCK: tl.constexpr,
):
    """One radix pass, one tile: histogram of digit (key >> SHIFT) & (2^WIDTH - 1) over keys
    whose bits above SHIFT + WIDTH equal the row's prefix; hist int32 [rows, BINS] += ."""
    lr = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    vis = _row_visible(vis_ptr, row0 + lr, n_cols)
    if FIRST:
        prefix = 0
        refine = vis > KB
    else:
        prefix = tl.load(state_ptr + lr * 4)
        refine = tl.load(state_ptr + lr * 4 + 3) != 0
    if refine & (start < vis):
        cols = start + tl.arange(0, BLOCK)
        col_mask = cols < vis
        key = _keys(s_ptr, lr, cols, col_mask, stride_sr)
        match = col_mask & ((key >> (SHIFT + WIDTH)) == prefix)
        digit = (key >> SHIFT) & ((1 << WIDTH) - 1)
        counts = tl.histogram(digit, BINS, mask=match)
        tl.atomic_add(hist_ptr + lr * BINS + tl.arange(0, BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit(do_not_specialize=["row0", "n_cols"])
def _resolve_kernel(
    vis_ptr, state_ptr, hist_ptr, row0, n_cols,
    KB: tl.constexpr, FIRST: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
    BINS: tl.constexpr,
):
    """Pick the digit holding the need-th largest key; state int32 [rows, 4] =
    (prefix, need: keys still to take from the prefix's bin, shift of the prefix, refine)."""
    lr = tl.program_id(0)
    vis = _row_visible(vis_ptr, row0 + lr, n_cols)
    if FIRST:
        prefix = vis * 0
        need = vis * 0 + KB
        shift = vis * 0 + 31
        refine = vis > KB
    else:
        prefix = tl.load(state_ptr + lr * 4)
        need = tl.load(state_ptr + lr * 4 + 1)
        shift = tl.load(state_ptr + lr * 4 + 2)
        refine = tl.load(state_ptr + lr * 4 + 3) != 0
    bins = tl.arange(0, BINS)
    counts = tl.load(hist_ptr + lr * BINS + bins)
    tl.store(hist_ptr + lr * BINS + bins, counts * 0)  # zero for the next pass / chunk
    at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
    b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    in_b = tl.sum(tl.where(bins == b, counts, 0), 0)
    above_b = tl.sum(tl.where(bins == b, at_or_above, 0), 0) - in_b
    new_need = need - above_b
    tl.store(state_ptr + lr * 4, tl.where(refine, (prefix << WIDTH) | b, prefix))
    tl.store(state_ptr + lr * 4 + 1, tl.where(refine, new_need, need))
    tl.store(state_ptr + lr * 4 + 2, tl.where(refine, SHIFT, shift))
    tl.store(state_ptr + lr * 4 + 3, (refine & (in_b > new_need)).to(tl.int32))


@triton.jit
def _take(key, col_mask, prefix, shift):
    """(above, equal) int32 masks of keys against the threshold prefix."""
    top = key >> shift
    return (col_mask & (top > prefix)).to(tl.int32), (col_mask & (top == prefix)).to(tl.int32)


@triton.jit(do_not_specialize=["row0", "n_cols", "n_tiles", "stride_sr"])
def _count_kernel(
    s_ptr, vis_ptr, state_ptr, cnt_ptr, row0, n_cols, n_tiles, stride_sr,
    KB: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per tile: keys above the threshold and keys equal to it; cnt int32 [rows, tiles, 2]."""
    lr = tl.program_id(0)
    tile = tl.program_id(1)
    vis = _row_visible(vis_ptr, row0 + lr, n_cols)
    start = tile * BLOCK
    if (vis > KB) & (start < vis):
        cols = start + tl.arange(0, BLOCK)
        col_mask = cols < vis
        key = _keys(s_ptr, lr, cols, col_mask, stride_sr)
        above, equal = _take(key, col_mask, tl.load(state_ptr + lr * 4), tl.load(state_ptr + lr * 4 + 2))
        base = (lr.to(tl.int64) * n_tiles + tile) * 2
        tl.store(cnt_ptr + base, tl.sum(above, 0))
        tl.store(cnt_ptr + base + 1, tl.sum(equal, 0))


@triton.jit(do_not_specialize=["row0", "n_cols", "n_tiles", "stride_sr"])
def _emit_kernel(
    s_ptr, vis_ptr, state_ptr, cnt_ptr, out_ptr, row0, n_cols, n_tiles, stride_sr,
    stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, BLOCK: tl.constexpr, PREV: tl.constexpr,
):
    """Write the chosen groups of one tile at their ascending-order positions in out
    int32 [T, KB]; tile 0 of a row with visible <= KB writes 0..visible-1 then -1."""
    lr = tl.program_id(0)
    tile = tl.program_id(1)
    row = row0 + lr
    vis = _row_visible(vis_ptr, row, n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    start = tile * BLOCK
    if vis <= KB:
        if tile == 0:
            j = tl.arange(0, KBP)
            tl.store(out_row + j * stride_oc, tl.where(j < vis, j, -1), mask=j < KB)
    elif start < vis:
        taken = 0
        equal_before = 0
        cnt_row = cnt_ptr + lr.to(tl.int64) * n_tiles * 2
        t0 = 0
        while t0 < tile:
            t = t0 + tl.arange(0, PREV)
            t_mask = t < tile
            taken += tl.sum(tl.load(cnt_row + t * 2, mask=t_mask, other=0), 0)
            equal_before += tl.sum(tl.load(cnt_row + t * 2 + 1, mask=t_mask, other=0), 0)
            t0 += PREV
        need = tl.load(state_ptr + lr * 4 + 1)
        cols = start + tl.arange(0, BLOCK)
        col_mask = cols < vis
        key = _keys(s_ptr, lr, cols, col_mask, stride_sr)
        above, equal = _take(key, col_mask, tl.load(state_ptr + lr * 4), tl.load(state_ptr + lr * 4 + 2))
        # Ties at the threshold: the lowest group indices first (exclusive running rank).
        tie_rank = equal_before + tl.cumsum(equal, 0) - equal
        chosen = (above + equal * (tie_rank < need).to(tl.int32)) > 0
        taken += tl.minimum(equal_before, need)
        pos = taken + tl.cumsum(chosen.to(tl.int32), 0) - chosen.to(tl.int32)
        tl.store(out_row + pos * stride_oc, cols, mask=chosen)


def _select(
    q_idx: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    visible_blocks: torch.Tensor,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    max_seq_len: int,
    out: torch.Tensor,
    decode: bool,
) -> torch.Tensor:
    """Shared body of the decode / prefill ops; see the module docstring."""
    T, Hi, Di = q_idx.shape
    if T == 0:
        return out
    dev = q_idx.device
    Kb = block_topk
    n_cols = max(max_seq_len // compress_ratio, 1)
    HP = triton.next_power_of_2(Hi)
    tiles = _tiles(HP, decode)
    scan = tiles["scan"]
    n_tiles = triton.cdiv(n_cols, scan)
    scored = n_cols > Kb  # else every row takes all its visible groups
    chunk = min(T, max(1, SCORE_SCRATCH_BYTES // (4 * n_cols))) if scored else T
    if scored:
        scores = _score_scratch(chunk, n_cols, dev)
        hist = torch.zeros(chunk, _BINS, dtype=torch.int32, device=dev)
        state = torch.empty(chunk, 4, dtype=torch.int32, device=dev)
        counts = torch.empty(chunk, n_tiles, 2, dtype=torch.int32, device=dev)
    else:
        scores = hist = state = counts = out  # never dereferenced: every row has visible <= Kb
    bf16_dot = not _interpreting() and q_idx.dtype in _EXACT_DOT_DTYPES and compressed.dtype in _EXACT_DOT_DTYPES
    scan_warps = 8 if scan >= 2048 else 4
    for row0 in range(0, T, chunk):
        n = min(chunk, T - row0)
        if scored:
            grid = (triton.cdiv(n, tiles["block_r"]), triton.cdiv(n_cols, tiles["block_g"]))
            _scores_kernel[grid](
                q_idx, compressed, block_table, token_to_req, visible_blocks, scores,
                row0, n, n_cols, math.sqrt(Di),
                q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), compressed.stride(0), compressed.stride(1),
                block_table.stride(0), block_table.stride(1), scores.stride(0),
                HI=Hi, DI=Di, HP=HP, DP=triton.next_power_of_2(Di), PAGE=page_size, R=compress_ratio, KB=Kb,
                BLOCK_R=tiles["block_r"], BLOCK_G=tiles["block_g"],
                DOT_DTYPE=tl.bfloat16 if bf16_dot else tl.float32, num_warps=4 if decode else 8,
            )
            for i, (shift, width) in enumerate(_PASSES):
                _hist_kernel[(n, n_tiles)](
                    scores, visible_blocks, state, hist, row0, n_cols, scores.stride(0),
                    KB=Kb, FIRST=i == 0, SHIFT=shift, WIDTH=width, BINS=_BINS, BLOCK=scan, num_warps=scan_warps,
                )
                _resolve_kernel[(n,)](
                    visible_blocks, state, hist, row0, n_cols, KB=Kb, FIRST=i == 0, SHIFT=shift, WIDTH=width, BINS=_BINS,
                )
            _count_kernel[(n, n_tiles)](
                scores, visible_blocks, state, counts, row0, n_cols, n_tiles, scores.stride(0),
                KB=Kb, BLOCK=scan, num_warps=scan_warps,
            )
        _emit_kernel[(n, n_tiles)](
            scores, visible_blocks, state, counts, out, row0, n_cols, n_tiles, scores.stride(0),
            out.stride(0), out.stride(1),
            KB=Kb, KBP=triton.next_power_of_2(Kb), BLOCK=scan, PREV=64, num_warps=scan_warps,
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
    max_seq_len: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode rows: q_idx [Td, Hi, Di], compressed [rows, Di] -> out int32 [Td, Kb]."""
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size,
                   compress_ratio, block_topk, max_seq_len, out, decode=True)


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
    max_seq_len: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Prefill rows (same contract as decode); scores in row chunks under a memory cap."""
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size,
                   compress_ratio, block_topk, max_seq_len, out, decode=False)
