"""Triton metadata build: SPEC.md section 3's derived per-row fields, guarded.

Mirrors `qsa_core.reference.metadata.qsa_build_metadata`. Three launches after clearing the
per-request flags, all CUDA-graph safe (grids from T, R and the block-table width only, no
host reads, batch-varying ints not specialized):
1. `_request_guard_kernel`, grid (R, page blocks): the per-request guards (seq_len bounds,
   rows past the live rows, ring_index, the block-table pages the request uses);
2. `_row_guard_kernel`, grid (row blocks): each row finds its request by a binary search of
   `query_start_loc` and flags it when the row's slot is outside the cache;
3. `_metadata_kernel`, grid (row blocks): the derived fields, with every row of a flagged
   request inert (as padding) and its reasons OR-ed into the guard.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa_core.reference.metadata import (
    GUARD_MAX_SEQ_LEN,
    GUARD_PAGE,
    GUARD_QUERY_START_LOC,
    GUARD_RING_INDEX,
    GUARD_SEQ_LEN,
    GUARD_SLOT,
)

BLOCK_ROWS = 256
BLOCK_PAGES = 1024


@triton.jit(do_not_specialize=["P", "max_seq_len", "num_live", "num_pages", "num_ring_rows", "stride_bt0",
                               "stride_bt1"])
def _request_guard_kernel(
    qsl_ptr, seq_ptr, ring_index_ptr, bt_ptr, stride_bt0, stride_bt1, flags_ptr,
    P, max_seq_len, num_live, num_pages, num_ring_rows, page_size,
    BLOCK: tl.constexpr,
    MAX_SEQ: tl.constexpr, SEQ: tl.constexpr, QSL: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    seq = tl.load(seq_ptr + i).to(tl.int64)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    used = (cols < P) & (cols.to(tl.int64) * page_size < seq)
    page = tl.load(bt_ptr + i * stride_bt0 + cols * stride_bt1, mask=used, other=0).to(tl.int64)
    bad = ((page < 0) | (page >= num_pages)) & used
    flag = tl.max(bad.to(tl.int32), 0) * PAGE
    if block == 0:
        start = tl.load(qsl_ptr + i).to(tl.int64)
        end = tl.load(qsl_ptr + i + 1).to(tl.int64)
        ring = tl.load(ring_index_ptr + i).to(tl.int64)
        flag = flag | (seq > max_seq_len).to(tl.int32) * MAX_SEQ
        flag = flag | (seq < end - start).to(tl.int32) * SEQ
        flag = flag | (end > num_live).to(tl.int32) * QSL
        flag = flag | ((ring < 0) | (ring >= num_ring_rows)).to(tl.int32) * RING
        flag = flag | ((seq + page_size - 1) // page_size > P).to(tl.int32) * PAGE
    tl.atomic_or(flags_ptr + i, flag, mask=flag != 0)


@triton.jit(do_not_specialize=["R", "T", "num_live", "stray_end", "num_slots"])
def _row_guard_kernel(
    qsl_ptr, slot_ptr, to_req_ptr, flags_ptr, guard_ptr, R, T, num_live, stray_end, num_slots,
    BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr, SLOT: tl.constexpr, QSL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < T
    owned = tl.load(qsl_ptr + R).to(tl.int64)
    live = tl.where(R > 0, in_range & (rows < owned) & (rows < num_live), False)
    # req = number of request ends (query_start_loc[1:]) <= row: searchsorted(right=True).
    # A fixed step count (enough for any int32 R) keeps R out of the compiled code; the
    # interpreter cannot run loops bounded by a kernel argument either.
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + R
    for _ in range(SEARCH_STEPS):
        active = live & (lo < hi)
        mid = (lo + hi) // 2
        end_mid = tl.load(qsl_ptr + mid + 1, mask=active, other=0).to(tl.int64)
        go_right = active & (end_mid <= rows)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    req = tl.where(live, lo, 0)
    slot = tl.load(slot_ptr + rows, mask=in_range, other=-1)
    bad = live & ((slot < -1) | (slot >= num_slots))
    tl.atomic_or(flags_ptr + req, tl.full([BLOCK], SLOT, tl.int32), mask=bad)
    stray = in_range & (rows >= owned) & (rows < stray_end)  # live rows that no request owns
    tl.atomic_or(guard_ptr + rows * 0, tl.full([BLOCK], QSL, tl.int32), mask=stray)
    tl.store(to_req_ptr + rows, req, mask=in_range)


@triton.jit(do_not_specialize=["R", "T", "num_live"])
def _metadata_kernel(
    qsl_ptr, seq_ptr, slot_ptr, ring_index_ptr, flags_ptr,
    to_req_ptr, pos_ptr, vis_ptr, ring_slot_ptr, comp_slot_ptr, kv_slot_ptr, guard_ptr,
    R, T, num_live,
    r: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < T
    # tl.where, not `& (R > 0)`: triton 3.9's interpreter refuses a block mask & a scalar.
    live = tl.where(R > 0, in_range & (rows < tl.load(qsl_ptr + R).to(tl.int64)) & (rows < num_live), False)
    req = tl.load(to_req_ptr + rows, mask=live, other=0)
    # Guards: every row of a flagged request becomes inert (as padding); the reasons go to
    # the sticky flag. Such a request is never run on malformed values.
    flags = tl.load(flags_ptr + req, mask=live, other=0)
    tl.atomic_or(guard_ptr + rows * 0, flags, mask=live & (flags != 0))
    live = live & (flags == 0)
    req = tl.where(live, req, 0)
    seq = tl.load(seq_ptr + req, mask=live, other=0).to(tl.int64)
    start = tl.load(qsl_ptr + req, mask=live, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1, mask=live, other=0).to(tl.int64)
    pos = seq - (end - start) + (rows - start)
    # Truncating // equals the reference's floor here: both sides are clamped at 0.
    vis = tl.maximum(tl.minimum((pos + 1) // r, seq // r), 0)
    ring_mod = pos % C
    ring_mod = tl.where(ring_mod < 0, ring_mod + C, ring_mod)  # Python-style remainder
    base = tl.load(ring_index_ptr + req, mask=live, other=0).to(tl.int64) * C
    ring = tl.where(live & (rows >= end - C), base + ring_mod, -1)
    slot = tl.where(live, tl.load(slot_ptr + rows, mask=in_range, other=-1), -1)
    closes = live & ((pos + 1) % r == 0) & (slot >= 0)
    comp = tl.where(closes, slot // r, -1)
    tl.store(to_req_ptr + rows, req.to(tl.int32), mask=in_range)
    tl.store(pos_ptr + rows, tl.where(live, pos, -1), mask=in_range)
    tl.store(vis_ptr + rows, tl.where(live, vis, 0).to(tl.int32), mask=in_range)
    tl.store(ring_slot_ptr + rows, ring, mask=in_range)
    tl.store(comp_slot_ptr + rows, comp, mask=in_range)
    tl.store(kv_slot_ptr + rows, slot, mask=in_range)


def qsa_build_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    ring_index: torch.Tensor,
    block_table: torch.Tensor,
    *,
    compress_ratio: int,
    ring_capacity: int,
    max_seq_len: int,
    page_size: int,
    num_live_rows: int,
    num_slots: int,
    num_ring_rows: int,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    visible_blocks: torch.Tensor,
    ring_slot: torch.Tensor,
    compressed_slot: torch.Tensor,
    kv_slot: torch.Tensor,
    request_flags: torch.Tensor,
    guard: torch.Tensor,
) -> None:
    """Fill the derived per-row fields in place; same contract as the reference.

    Inputs: query_start_loc int32 [R+1], seq_lens int32 [R], slot_mapping int64 [T],
    ring_index int32 [R] (all contiguous), block_table int32 [>= R, P] (any strides).
    Outputs, contiguous [T]: token_to_req int32, positions int64, visible_blocks int32,
    ring_slot int64, compressed_slot int64, kv_slot int64; guard int32 [1] gets the GUARD_*
    bits of the malformed requests (never cleared here); request_flags int32 [>= R] scratch.
    """
    T = slot_mapping.shape[0]
    R = seq_lens.shape[0]
    if T == 0:
        return
    live_bound = T if num_live_rows < 0 else num_live_rows  # -1: query_start_loc[R] alone bounds
    flags = request_flags[:R]
    flags.zero_()
    rows_grid = (triton.cdiv(T, BLOCK_ROWS),)
    if R:
        P = block_table.shape[1]
        _request_guard_kernel[(R, max(1, triton.cdiv(P, BLOCK_PAGES)))](
            query_start_loc, seq_lens, ring_index, block_table, block_table.stride(0), block_table.stride(1), flags,
            P, max_seq_len, live_bound, num_slots // page_size, num_ring_rows, page_size,
            BLOCK=BLOCK_PAGES, MAX_SEQ=GUARD_MAX_SEQ_LEN, SEQ=GUARD_SEQ_LEN, QSL=GUARD_QUERY_START_LOC,
            RING=GUARD_RING_INDEX, PAGE=GUARD_PAGE,
        )
    _row_guard_kernel[rows_grid](
        query_start_loc, slot_mapping, token_to_req, flags, guard, R, T, live_bound, num_live_rows, num_slots,
        BLOCK=BLOCK_ROWS, SEARCH_STEPS=31, SLOT=GUARD_SLOT, QSL=GUARD_QUERY_START_LOC,
    )
    _metadata_kernel[rows_grid](
        query_start_loc, seq_lens, slot_mapping, ring_index, flags,
        token_to_req, positions, visible_blocks, ring_slot, compressed_slot, kv_slot, guard,
        R, T, live_bound,
        r=compress_ratio, C=ring_capacity, BLOCK=BLOCK_ROWS,
    )
