"""Reference of the metadata-build op: SPEC.md section 3's derived fields, as tensor ops."""

from __future__ import annotations

import torch


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
    """Fill the derived per-row fields in place (no host reads, no Python loop over rows).

    Inputs: query_start_loc int32 [R+1], seq_lens int32 [R], slot_mapping int64 [T],
    ring_index int32 [R]. Outputs, all [T]: token_to_req int32, positions int64 (logical,
    -1 for padding), visible_blocks int32, ring_slot int64, compressed_slot int64 (-1 = none).
    Rows at or past query_start_loc[R] are padding: request 0, position -1, everything inert.
    Guard: rows of a request with seq_len > max_seq_len (the column bound of selection) are
    made inert the same way and guard int32 [1] is set to 1 (sticky; never cleared here).
    """
    T = slot_mapping.shape[0]
    r, C = compress_ratio, ring_capacity
    if seq_lens.shape[0] == 0:  # idle step: every row is padding
        token_to_req.zero_()
        for t in (positions, ring_slot, compressed_slot):
            t.fill_(-1)
        visible_blocks.zero_()
        return
    rows = torch.arange(T, device=slot_mapping.device)
    ends = query_start_loc[1:].to(torch.int64)
    req = torch.searchsorted(ends, rows, right=True)
    live = rows < query_start_loc[-1].to(torch.int64)
    req = torch.where(live, req, 0).clamp_(max=max(seq_lens.shape[0] - 1, 0))
    over = live & (seq_lens.to(torch.int64)[req] > max_seq_len)
    torch.maximum(guard, over.any().to(guard.dtype).view(1), out=guard)
    live = live & ~over
    req = torch.where(live, req, 0)
    start = query_start_loc[:-1].to(torch.int64)[req]
    end = ends[req]
    seq = seq_lens.to(torch.int64)[req]
    pos = seq - (end - start) + (rows - start)
    pos = torch.where(live, pos, -1)
    vis = torch.minimum((pos + 1) // r, seq // r).clamp_(min=0)
    vis = torch.where(live, vis, 0)
    ring = ring_index.to(torch.int64)[req] * C + pos.remainder(C)
    ring = torch.where(live & (rows >= end - C), ring, -1)
    closes = live & ((pos + 1) % r == 0) & (slot_mapping >= 0)
    comp = torch.where(closes, slot_mapping // r, -1)
    token_to_req.copy_(req)
    positions.copy_(pos)
    visible_blocks.copy_(vis)
    ring_slot.copy_(ring)
    compressed_slot.copy_(comp)
