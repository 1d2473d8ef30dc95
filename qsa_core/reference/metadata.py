"""Reference of the metadata-build op: design.md §3's derived fields, as tensor ops."""

from __future__ import annotations

import torch


# Bits of the guard flag: why rows were made inert (`QSAPlanner.check_guard` names them).
GUARD_MAX_SEQ_LEN = 1  # seq_len > max_seq_len (the column bound of selection)
GUARD_SEQ_LEN = 2  # seq_len < the request's query length
GUARD_QUERY_START_LOC = 4  # query_start_loc[-1] != num_live_rows (a request past the live rows)
GUARD_SLOT = 8  # a slot_mapping entry outside [-1, num_slots)
GUARD_RING_INDEX = 16  # ring_index outside [0, num_ring_rows)
GUARD_PAGE = 32  # a block_table page the request uses outside [0, num_pages)
GUARD_MAX_QUERY_LEN = 64  # a request's query length > max_query_len (the step's bound on rows per request)
# A decode request (one of the first num_decodes) with neither decode_query_len nor 0 rows, or
# whose rows do not start at a multiple of decode_query_len (MTP score programs take whole requests).
GUARD_DECODE_ROWS = 128
GUARD_SHARED_SLOT = 256  # a live row's slot (>= 0) is also another live row's: K/V written twice
GUARD_SHARED_RING = 512  # two requests with rows in the step have the same ring_index
# A live row's slot in [0, num_slots) is not its position's slot through the request's block
# table (block_table[req, pos // page_size] * page_size + pos % page_size): its K/V would land
# where the attention never reads it, or in another request's page.
GUARD_SLOT_TABLE = 1024
# A slot claim packs the step counter above the row (`slot_claims`): rows per step < 2**24.
CLAIM_ROW_BITS = 24
# The bits above by the field names of `qsa_kernels.metadata.GuardBits`: the Triton build
# takes them from here (the kernels import nothing from the core).
GUARD_BITS = dict(
    max_seq_len=GUARD_MAX_SEQ_LEN, seq_len=GUARD_SEQ_LEN, query_start_loc=GUARD_QUERY_START_LOC, slot=GUARD_SLOT,
    ring_index=GUARD_RING_INDEX, page=GUARD_PAGE, max_query_len=GUARD_MAX_QUERY_LEN, decode_rows=GUARD_DECODE_ROWS,
    shared_slot=GUARD_SHARED_SLOT, shared_ring=GUARD_SHARED_RING, slot_table=GUARD_SLOT_TABLE,
    claim_row_bits=CLAIM_ROW_BITS,
)


def _rows_to_requests(req: torch.Tensor, rows: torch.Tensor, num_reqs: int, bit: int) -> torch.Tensor:
    """int64 [num_reqs]: `bit` for each request req[t] (int64 [T]) of a row t in rows (bool
    [T]), else 0 (no host read)."""
    hit = torch.zeros(num_reqs, dtype=torch.int64, device=req.device)
    return hit.scatter_reduce_(0, req, rows.to(torch.int64), "amax") * bit


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
    max_query_len: int,
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
    num_decodes: int = 0,
    decode_query_len: int = 1,
    slot_claims: torch.Tensor | None = None,
    null_ring_row: int = -1,
) -> None:
    """Fill the derived per-row fields in place (no host reads, no Python loop over rows).

    Inputs: query_start_loc int32 [R+1], seq_lens int32 [R], slot_mapping int64 [T],
    ring_index int32 [R], block_table int32 [>= R, P]. Outputs, all [T]: token_to_req int32,
    positions int64 (logical, -1 for padding), visible_blocks int32, ring_slot int64,
    compressed_slot int64 and kv_slot int64 (slot_mapping, -1 for inert rows).
    num_live_rows = T - padding rows, or -1 where the host does not know it (a CUDA graph
    replays with any number of padding rows): query_start_loc[R] alone then bounds the live
    rows and the two checks against it are off.
    Rows at or past query_start_loc[R] (or num_live_rows) are padding: request 0, position
    -1, everything inert. Guards: every row of a malformed request (seq_len > max_seq_len or
    < its query length, a query length > max_query_len, rows past num_live_rows, ring_index outside [0, num_ring_rows), a
    slot of its rows outside [-1, num_slots), a page among its first ceil(seq_len /
    page_size) outside [0, num_slots / page_size), one of the first num_decodes requests with
    neither decode_query_len nor 0 rows or whose rows do not start at a multiple of
    decode_query_len, two requests with rows sharing a ring_index, a live row whose slot in
    [0, num_slots) is another live row's or not its position's slot through its block-table row)
    is made inert the same way, and the reason's GUARD_*
    bit is OR-ed into guard int32 [1] (sticky; never cleared here).
    request_flags int32 [>= R] gets each request's bits. slot_claims int64 [num_slots + 1]:
    the Triton build's scratch for the shared-slot guard (unread here); None: no such guard.
    null_ring_row >= 0: a ring row no request owns (vLLM's null block, SGLang's request-pool
    row 0): a request on it is padding the engine added (a dummy run's, a graph capture's): its
    rows are inert and none of its values is checked (it reads and writes nothing), so it
    flags nothing; -1: none.
    """
    T = slot_mapping.shape[0]
    R = seq_lens.shape[0]
    r, C = compress_ratio, ring_capacity
    live_bound = T if num_live_rows < 0 else num_live_rows  # -1: query_start_loc[R] alone bounds
    if R == 0:  # idle step: every row is padding
        if num_live_rows > 0:
            guard.copy_(guard | GUARD_QUERY_START_LOC)
        token_to_req.zero_()
        for t in (positions, ring_slot, compressed_slot, kv_slot):
            t.fill_(-1)
        visible_blocks.zero_()
        return
    dev = slot_mapping.device
    qsl = query_start_loc.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    starts, ends = qsl[:-1], qsl[1:]
    # Per-request guards (bits), then the rows' own ones folded into their request.
    ring = ring_index.to(torch.int64)
    num_pages = num_slots // page_size
    pages_used = (seq + page_size - 1) // page_size
    cols = torch.arange(block_table.shape[1], device=dev)
    table = block_table[:R].to(torch.int64)
    bad_page = ((cols[None, :] < pages_used[:, None]) & ((table < 0) | (table >= num_pages))).any(1)
    bad_page |= pages_used > block_table.shape[1]
    flags = (
        torch.where(seq > max_seq_len, GUARD_MAX_SEQ_LEN, 0)
        | torch.where(seq < ends - starts, GUARD_SEQ_LEN, 0)
        | torch.where(ends - starts > max_query_len, GUARD_MAX_QUERY_LEN, 0)
        | torch.where(ends > live_bound, GUARD_QUERY_START_LOC, 0)
        | torch.where((ring < 0) | (ring >= num_ring_rows), GUARD_RING_INDEX, 0)
        | torch.where(bad_page, GUARD_PAGE, 0)
        | torch.where((torch.arange(R, device=dev) < num_decodes)
                      & ((ends - starts != decode_query_len) & (ends != starts) | (starts % decode_query_len != 0)),
                      GUARD_DECODE_ROWS, 0)
    )
    rows = torch.arange(T, device=dev)
    req = torch.searchsorted(ends, rows, right=True)
    live = (rows < qsl[-1]) & (rows < live_bound)
    req = torch.where(live, req, 0).clamp_(max=R - 1)
    # The engine's padding requests (on the null ring row) are inert whatever their values:
    # they claim no slot and flag nothing (their flags are cleared below).
    pad = ring == null_ring_row if null_ring_row >= 0 else torch.zeros_like(ring, dtype=torch.bool)
    bad_slot = live & ((slot_mapping < -1) | (slot_mapping >= num_slots))
    flags = flags | _rows_to_requests(req, bad_slot, R, GUARD_SLOT)
    if table.shape[1]:  # a slot must be its position's through the block table (where reads go)
        pos = (seq - (ends - starts))[req] + rows - starts[req]
        col = torch.div(pos, page_size, rounding_mode="floor")
        in_table = live & (slot_mapping >= 0) & (slot_mapping < num_slots) & (pos >= 0) & (col < table.shape[1])
        page = table[req, col.clamp(0, table.shape[1] - 1)]
        off_table = in_table & (slot_mapping != page * page_size + pos % page_size)
        flags = flags | _rows_to_requests(req, off_table, R, GUARD_SLOT_TABLE)
    # requests with rows (a CUDA-graph padding request has none and may share a ring row)
    runs = (ends > starts) & ~pad
    shared_ring = runs[:, None] & runs[None, :] & (ring[:, None] == ring[None, :])
    flags = flags | torch.where(shared_ring.sum(1) > 1, GUARD_SHARED_RING, 0)
    if slot_claims is not None:
        # Rows writing one slot sit side by side once sorted by slot (others: distinct keys < 0).
        writes = live & ~pad[req] & (slot_mapping >= 0) & (slot_mapping < num_slots)
        key = torch.where(writes, slot_mapping, -1 - rows)
        order = torch.argsort(key, stable=True)
        same = key[order][1:] == key[order][:-1]
        shared = torch.zeros(T, dtype=torch.bool, device=dev)
        shared[1:] |= same
        shared[:-1] |= same
        shared = torch.zeros_like(shared).scatter_(0, order, shared)
        flags = flags | _rows_to_requests(req, shared, R, GUARD_SHARED_SLOT)
    flags = torch.where(pad, 0, flags)
    stray = (rows >= qsl[-1]) & (rows < num_live_rows)  # live rows no request owns
    bits = torch.where(live, flags[req], 0)
    bits_any = torch.zeros((), dtype=torch.int64, device=dev)
    for bit in (GUARD_MAX_SEQ_LEN, GUARD_SEQ_LEN, GUARD_QUERY_START_LOC, GUARD_SLOT, GUARD_RING_INDEX, GUARD_PAGE,
                GUARD_MAX_QUERY_LEN, GUARD_DECODE_ROWS, GUARD_SHARED_SLOT, GUARD_SHARED_RING, GUARD_SLOT_TABLE):
        bits_any = bits_any | torch.where(((bits & bit) != 0).any(), bit, 0)
    bits_any = bits_any | torch.where(stray.any(), GUARD_QUERY_START_LOC, 0)
    guard.copy_(guard | bits_any.to(guard.dtype).view(1))
    request_flags[:R].copy_(flags.to(request_flags.dtype))
    live = live & (bits == 0) & ~pad[req]
    req = torch.where(live, req, 0)
    start = starts[req]
    end = ends[req]
    seq = seq[req]
    pos = seq - (end - start) + (rows - start)
    pos = torch.where(live, pos, -1)
    vis = torch.minimum((pos + 1) // r, seq // r).clamp_(min=0)
    vis = torch.where(live, vis, 0)
    ring_row = ring[req] * C + pos.remainder(C)
    ring_row = torch.where(live & (rows >= end - C), ring_row, -1)
    kv = torch.where(live, slot_mapping, -1)
    closes = live & ((pos + 1) % r == 0) & (kv >= 0)
    comp = torch.where(closes, kv // r, -1)
    token_to_req.copy_(req)
    positions.copy_(pos)
    visible_blocks.copy_(vis)
    ring_slot.copy_(ring_row)
    compressed_slot.copy_(comp)
    kv_slot.copy_(kv)
