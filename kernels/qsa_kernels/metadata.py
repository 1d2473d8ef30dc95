"""Triton metadata build: SPEC.md section 3's derived per-row fields in one launch.

Mirrors `qsa_core.reference.metadata.qsa_build_metadata`. Each program handles a block of
rows; a row finds its request by a binary search of `query_start_loc`, so the launch is
CUDA-graph safe (grid from T only, no host reads, batch-varying ints not specialized).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 256


@triton.jit(do_not_specialize=["R", "T", "max_seq_len"])
def _metadata_kernel(
    qsl_ptr, seq_ptr, slot_ptr, ring_index_ptr,
    to_req_ptr, pos_ptr, vis_ptr, ring_slot_ptr, comp_slot_ptr, guard_ptr,
    R, T, max_seq_len,
    r: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < T
    num_live = tl.load(qsl_ptr + R).to(tl.int64)
    live = in_range & (rows < num_live) & (R > 0)
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
    seq = tl.load(seq_ptr + req, mask=live, other=0).to(tl.int64)
    # Guard: a request longer than the column bound of selection becomes inert (as padding)
    # and raises the sticky flag; it is never silently truncated.
    over = live & (seq > max_seq_len)
    tl.store(guard_ptr + rows * 0, tl.full([BLOCK], 1, tl.int32), mask=over)
    live = live & ~over
    req = tl.where(live, req, 0)
    start = tl.load(qsl_ptr + req, mask=live, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1, mask=live, other=0).to(tl.int64)
    pos = seq - (end - start) + (rows - start)
    # Truncating // equals the reference's floor here: both sides are clamped at 0.
    vis = tl.maximum(tl.minimum((pos + 1) // r, seq // r), 0)
    ring_mod = pos % C
    ring_mod = tl.where(ring_mod < 0, ring_mod + C, ring_mod)  # Python-style remainder
    base = tl.load(ring_index_ptr + req, mask=live, other=0).to(tl.int64) * C
    ring = tl.where(live & (rows >= end - C), base + ring_mod, -1)
    slot = tl.load(slot_ptr + rows, mask=in_range, other=-1)
    closes = live & ((pos + 1) % r == 0) & (slot >= 0)
    comp = tl.where(closes, slot // r, -1)
    tl.store(to_req_ptr + rows, req.to(tl.int32), mask=in_range)
    tl.store(pos_ptr + rows, tl.where(live, pos, -1), mask=in_range)
    tl.store(vis_ptr + rows, tl.where(live, vis, 0).to(tl.int32), mask=in_range)
    tl.store(ring_slot_ptr + rows, ring, mask=in_range)
    tl.store(comp_slot_ptr + rows, comp, mask=in_range)


def qsa_build_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    ring_index: torch.Tensor,
    *,
    compress_ratio: int,
    ring_capacity: int,
    max_seq_len: int,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    visible_blocks: torch.Tensor,
    ring_slot: torch.Tensor,
    compressed_slot: torch.Tensor,
    guard: torch.Tensor,
) -> None:
    """Fill the derived per-row fields in place; same contract as the reference.

    Inputs: query_start_loc int32 [R+1], seq_lens int32 [R], slot_mapping int64 [T],
    ring_index int32 [R] (all contiguous). Outputs, contiguous [T]: token_to_req int32,
    positions int64, visible_blocks int32, ring_slot int64, compressed_slot int64; guard
    int32 [1] is set to 1 (never cleared here) when a request has seq_len > max_seq_len.
    """
    T = slot_mapping.shape[0]
    if T == 0:
        return
    R = seq_lens.shape[0]
    grid = (triton.cdiv(T, BLOCK_ROWS),)
    _metadata_kernel[grid](
        query_start_loc, seq_lens, slot_mapping, ring_index,
        token_to_req, positions, visible_blocks, ring_slot, compressed_slot, guard,
        R, T, max_seq_len,
        r=compress_ratio, C=ring_capacity, BLOCK=BLOCK_ROWS, SEARCH_STEPS=31,
    )
