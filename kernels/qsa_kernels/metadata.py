"""Triton metadata build: design.md §3's derived per-row fields, guarded.

Mirrors `qsa_core.reference.metadata.qsa_build_metadata`. One launch, CUDA-graph safe (grid
from T and R only, no host reads, batch-varying ints not specialized), no memset. Program p
1. (p < R) computes request p's guard bits (seq_len bounds, its query length against
   max_query_len, rows past the live rows, ring_index, the block-table pages it uses, the
   slots of its rows, a decode request's rows against decode_query_len, its ring_index against
   the other requests with rows, its rows' slots against its block-table row) into
   request_flags[p], and marks the step as having a flagged request;
2. (p < row blocks) derives the fields of rows [p * BLOCK, (p + 1) * BLOCK): each row finds
   its request by a binary search of `query_start_loc`; live rows no request owns are flagged;
   rows of a request on the null ring row (NULL_RING >= 0: the engine's padding requests, such
   as vLLM's dummy runs on its null block and SGLang's capture batches on its request-pool
   row 0) are inert, and such a request flags nothing, whatever its values.
   With a slot-claim table each live row writing a slot exchanges its claim (step counter,
   row) into the slot's entry; an entry already claimed in this step calls for the check below
   (the counter only keeps that check out of well-formed steps: the check alone decides).
The last program to arrive (an acq_rel counter it resets) flags the requests of rows whose
slot another row holds, makes every live row of a flagged request inert (as padding) and ORs
those requests' reasons into the guard: loops over the rows that run only in a step with a
flagged request, so a well-formed step pays one atomic (and one per writing row with claims).

`MetadataBuild` binds the launch (`qsa_kernels.launch`) to fixed outputs, once per (R, T).
`StaticStage` copies a step's inputs into a
planner's fixed buffers in one launch (`plan(static=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions

BLOCK_ROWS = 256
BLOCK_PAGES = 1024
BLOCK_SLOTS = 1024
_CACHE = 256  # bound (R, T) pairs kept per build


@triton.jit
def _request_flag(
    i, qsl_ptr, seq_ptr, ring_index_ptr, slot_ptr, bt_ptr, stride_bt0, stride_bt1,
    R, T, P, max_seq_len, max_query_len, num_live, num_pages, num_slots, num_ring_rows, page_size,
    num_decodes, decode_query_len,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    MAX_SEQ: tl.constexpr, SEQ: tl.constexpr, QSL: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr,
    SLOT: tl.constexpr, MAX_QUERY: tl.constexpr, DEC: tl.constexpr, SHARED_RING: tl.constexpr,
    SLOT_TABLE: tl.constexpr, NULL_RING: tl.constexpr,
):
    """Request i's guard bits (int32 scalar)."""
    seq = tl.load(seq_ptr + i).to(tl.int64)
    start = tl.load(qsl_ptr + i).to(tl.int64)
    end = tl.load(qsl_ptr + i + 1).to(tl.int64)
    ring = tl.load(ring_index_ptr + i).to(tl.int64)
    flag = (seq > max_seq_len).to(tl.int32) * MAX_SEQ
    flag = flag | (seq < end - start).to(tl.int32) * SEQ
    flag = flag | (end - start > max_query_len).to(tl.int32) * MAX_QUERY
    flag = flag | (end > num_live).to(tl.int32) * QSL
    n_rows = end - start
    flag = flag | ((i < num_decodes) & (((n_rows != decode_query_len) & (n_rows != 0))
                                        | (start % decode_query_len != 0))).to(tl.int32) * DEC
    flag = flag | ((ring < 0) | (ring >= num_ring_rows)).to(tl.int32) * RING
    # Another request with rows on the same ring row (requests without rows may share one, and
    # the engine's padding requests the null ring row).
    shared = tl.zeros([BLOCK_S], dtype=tl.int32)
    others = tl.where((n_rows > 0) & ((NULL_RING < 0) | (ring != NULL_RING)), R, 0)
    j0 = i * 0
    while j0 < others:
        js = j0 + tl.arange(0, BLOCK_S)
        m = js < others
        ring_j = tl.load(ring_index_ptr + js, mask=m, other=0).to(tl.int64)
        rows_j = tl.load(qsl_ptr + js + 1, mask=m, other=0) - tl.load(qsl_ptr + js, mask=m, other=0)
        shared = shared | (m & (js != i) & (rows_j > 0) & (ring_j == ring)).to(tl.int32)
        j0 += BLOCK_S
    flag = flag | tl.max(shared, 0) * SHARED_RING
    pages = (seq + page_size - 1) // page_size
    flag = flag | (pages > P).to(tl.int32) * PAGE
    # The pages it uses: the first min(ceil(seq / page_size), P) of its block-table row.
    used = tl.minimum(pages, P)
    bad = tl.zeros([BLOCK_P], dtype=tl.int32)
    c0 = seq * 0
    while c0 < used:
        cols = c0 + tl.arange(0, BLOCK_P)
        page = tl.load(bt_ptr + i * stride_bt0 + cols * stride_bt1, mask=cols < used, other=0).to(tl.int64)
        bad = bad | (((page < 0) | (page >= num_pages)) & (cols < used)).to(tl.int32)
        c0 += BLOCK_P
    flag = flag | tl.max(bad, 0) * PAGE
    # The slots of its rows: those a search of query_start_loc[1:] maps to it (request 0 also
    # owns rows before query_start_loc[0]), live (< query_start_loc[R], num_live and T). Each
    # in [0, num_slots) must be its position's slot through the request's block-table row.
    lo = tl.where(i == 0, 0, start)
    hi = tl.minimum(tl.minimum(end, tl.load(qsl_ptr + R).to(tl.int64)), tl.minimum(num_live, T))
    bad = tl.zeros([BLOCK_S], dtype=tl.int32)
    off = tl.zeros([BLOCK_S], dtype=tl.int32)
    r0 = lo
    while r0 < hi:
        rows = r0 + tl.arange(0, BLOCK_S)
        slot = tl.load(slot_ptr + rows, mask=rows < hi, other=-1)
        bad = bad | (((slot < -1) | (slot >= num_slots)) & (rows < hi)).to(tl.int32)
        pos = seq - n_rows + (rows - start)
        col = pos // page_size  # pos >= 0 where it is used
        look = (rows < hi) & (rows >= start) & (slot >= 0) & (slot < num_slots) & (pos >= 0) & (col < P)
        page = tl.load(bt_ptr + i * stride_bt0 + col * stride_bt1, mask=look, other=0).to(tl.int64)
        off = off | (look & (slot != page * page_size + pos % page_size)).to(tl.int32)
        r0 += BLOCK_S
    flag = flag | tl.max(bad, 0) * SLOT | tl.max(off, 0) * SLOT_TABLE
    if NULL_RING >= 0:  # the engine's padding request: inert whatever its values, unchecked
        flag = tl.where(ring == NULL_RING, 0, flag)
    return flag


@triton.jit
def _derive_rows(
    rows, qsl_ptr, seq_ptr, slot_ptr, ring_index_ptr,
    to_req_ptr, pos_ptr, vis_ptr, ring_slot_ptr, comp_slot_ptr, kv_slot_ptr, guard_ptr, claims_ptr, arrive_ptr,
    R, T, num_live, stray_end, num_slots, epoch,
    r: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr, QSL: tl.constexpr,
    CLAIMS: tl.constexpr, ROW_BITS: tl.constexpr, NULL_RING: tl.constexpr,
):
    """The derived fields of rows int64 [BLOCK] (request flags not applied yet; rows of a
    request on the null ring row inert); with CLAIMS each live row's slot in [0, num_slots) is
    claimed for (epoch, row), a slot claimed before in this step raising arrive[1]."""
    in_range = rows < T
    owned = tl.load(qsl_ptr + R).to(tl.int64)
    # tl.where, not `& (R > 0)`: triton 3.9's interpreter refuses a block mask & a scalar.
    live = tl.where(R > 0, in_range & (rows < owned) & (rows < num_live), False)
    stray = in_range & (rows >= owned) & (rows < stray_end)  # live rows that no request owns
    tl.atomic_or(guard_ptr + rows * 0, tl.full([BLOCK], QSL, tl.int32), mask=stray)
    # req = number of request ends (query_start_loc[1:]) <= row: searchsorted(right=True).
    # A fixed step count (enough for any int32 R) keeps R out of the compiled code.
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
    ring_req = tl.load(ring_index_ptr + req, mask=live, other=0).to(tl.int64)
    if NULL_RING >= 0:  # the engine's padding requests (on the null ring row): inert, unflagged
        live = live & (ring_req != NULL_RING)
        req = tl.where(live, req, 0)
    seq = tl.load(seq_ptr + req, mask=live, other=0).to(tl.int64)
    start = tl.load(qsl_ptr + req, mask=live, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + req + 1, mask=live, other=0).to(tl.int64)
    pos = seq - (end - start) + (rows - start)
    # Truncating // equals the reference's floor here: both sides are clamped at 0.
    vis = tl.maximum(tl.minimum((pos + 1) // r, seq // r), 0)
    ring_mod = pos % C
    ring_mod = tl.where(ring_mod < 0, ring_mod + C, ring_mod)  # Python-style remainder
    ring = tl.where(live & (rows >= end - C), ring_req * C + ring_mod, -1)
    slot = tl.where(live, tl.load(slot_ptr + rows, mask=in_range, other=-1), -1)
    closes = live & ((pos + 1) % r == 0) & (slot >= 0)
    comp = tl.where(closes, slot // r, -1)
    if CLAIMS:
        writes = live & (slot >= 0) & (slot < num_slots)
        old = tl.atomic_xchg(claims_ptr + tl.where(writes, slot, 0), (epoch << ROW_BITS) | rows, mask=writes)
        clash = writes & ((old >> ROW_BITS) == epoch)
        tl.atomic_or(arrive_ptr + 1 + rows * 0, tl.full([BLOCK], 1, tl.int32), mask=clash, sem="relaxed")
    tl.store(to_req_ptr + rows, req.to(tl.int32), mask=in_range)
    tl.store(pos_ptr + rows, tl.where(live, pos, -1), mask=in_range)
    tl.store(vis_ptr + rows, tl.where(live, vis, 0).to(tl.int32), mask=in_range)
    tl.store(ring_slot_ptr + rows, ring, mask=in_range)
    tl.store(comp_slot_ptr + rows, comp, mask=in_range)
    tl.store(kv_slot_ptr + rows, slot, mask=in_range)


@triton.jit
def _flag_shared_slots(
    qsl_ptr, flags_ptr, to_req_ptr, kv_slot_ptr, claims_ptr, R, T, num_live, num_slots,
    BLOCK: tl.constexpr, ROW_BITS: tl.constexpr, SHARED: tl.constexpr,
):
    """A live row whose slot's claim holds another row: both rows' requests get SHARED (every
    claim of the step is in; a slot's last claimant holds it)."""
    n_live = tl.minimum(tl.minimum(tl.load(qsl_ptr + R).to(tl.int64), num_live), T)
    r0 = T * 0
    while r0 < n_live:
        rows = r0 + tl.arange(0, BLOCK)
        live = rows < n_live
        slot = tl.load(kv_slot_ptr + rows, mask=live, other=-1)
        writes = live & (slot >= 0) & (slot < num_slots)
        holder = tl.load(claims_ptr + tl.where(writes, slot, 0), mask=writes, other=0) & ((1 << ROW_BITS) - 1)
        shared = writes & (holder != rows)
        req = tl.load(to_req_ptr + rows, mask=shared, other=0)
        other = tl.load(to_req_ptr + holder, mask=shared, other=0)
        bit = tl.full([BLOCK], SHARED, tl.int32)
        tl.atomic_or(flags_ptr + req, bit, mask=shared, sem="relaxed")
        tl.atomic_or(flags_ptr + other, bit, mask=shared, sem="relaxed")
        r0 += BLOCK


@triton.jit
def _make_inert(
    qsl_ptr, flags_ptr, to_req_ptr, pos_ptr, vis_ptr, ring_slot_ptr, comp_slot_ptr, kv_slot_ptr, guard_ptr,
    R, T, num_live, BLOCK: tl.constexpr,
):
    """Every live row of a flagged request becomes padding; those requests' bits go to the
    guard."""
    bits = tl.zeros([BLOCK], dtype=tl.int32)
    n_live = tl.minimum(tl.minimum(tl.load(qsl_ptr + R).to(tl.int64), num_live), T)
    r0 = T * 0
    while r0 < n_live:
        rows = r0 + tl.arange(0, BLOCK)
        live = rows < n_live
        req = tl.load(to_req_ptr + rows, mask=live, other=0)
        flag = tl.load(flags_ptr + req, mask=live, other=0)
        inert = live & (flag != 0)
        bits = bits | flag
        tl.store(to_req_ptr + rows, tl.zeros([BLOCK], dtype=tl.int32), mask=inert)
        tl.store(pos_ptr + rows, tl.full([BLOCK], -1, tl.int64), mask=inert)
        tl.store(vis_ptr + rows, tl.zeros([BLOCK], dtype=tl.int32), mask=inert)
        tl.store(ring_slot_ptr + rows, tl.full([BLOCK], -1, tl.int64), mask=inert)
        tl.store(comp_slot_ptr + rows, tl.full([BLOCK], -1, tl.int64), mask=inert)
        tl.store(kv_slot_ptr + rows, tl.full([BLOCK], -1, tl.int64), mask=inert)
        r0 += BLOCK
    tl.atomic_or(guard_ptr, _or_all(bits))


@triton.jit
def _or_combine(a, b):
    return a | b


@triton.jit
def _or_all(x):
    return tl.reduce(x, 0, _or_combine)


@triton.jit(do_not_specialize=["R", "T", "P", "max_seq_len", "max_query_len", "num_live", "stray_end", "num_pages",
                               "num_slots", "num_ring_rows", "stride_bt0", "stride_bt1", "num_decodes",
                               "decode_query_len"])
def _metadata_kernel(
    qsl_ptr, seq_ptr, ring_index_ptr, slot_ptr, bt_ptr, stride_bt0, stride_bt1, flags_ptr, arrive_ptr,
    to_req_ptr, pos_ptr, vis_ptr, ring_slot_ptr, comp_slot_ptr, kv_slot_ptr, guard_ptr, claims_ptr,
    R, T, P, max_seq_len, max_query_len, num_live, stray_end, num_pages, num_slots, num_ring_rows, page_size,
    num_decodes, decode_query_len,
    r: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    MAX_SEQ: tl.constexpr, SEQ: tl.constexpr, QSL: tl.constexpr, RING: tl.constexpr, PAGE: tl.constexpr,
    SLOT: tl.constexpr, MAX_QUERY: tl.constexpr, DEC: tl.constexpr, SHARED_RING: tl.constexpr,
    SHARED_SLOT: tl.constexpr, SLOT_TABLE: tl.constexpr, CLAIMS: tl.constexpr, ROW_BITS: tl.constexpr,
    NULL_RING: tl.constexpr, PDL: tl.constexpr = 0,
):
    """arrive int32 [2], zero between launches: [arrived programs, a request was flagged].
    With CLAIMS, claims int64 [num_slots + 1]: each slot's last claim (step counter << ROW_BITS
    | row) and, last, the counter of the previous launch (this one's is one more)."""
    pdl_start(PDL)
    p = tl.program_id(0).to(tl.int64)
    epoch = p * 0
    if CLAIMS:
        epoch = tl.load(claims_ptr + num_slots) + 1
    if p < R:
        flag = _request_flag(p, qsl_ptr, seq_ptr, ring_index_ptr, slot_ptr, bt_ptr, stride_bt0, stride_bt1,
                             R, T, P, max_seq_len, max_query_len, num_live, num_pages, num_slots, num_ring_rows,
                             page_size, num_decodes, decode_query_len, BLOCK_P, BLOCK_S, MAX_SEQ, SEQ, QSL, RING,
                             PAGE, SLOT, MAX_QUERY, DEC, SHARED_RING, SLOT_TABLE, NULL_RING)
        tl.store(flags_ptr + p, flag)
        if flag != 0:
            tl.atomic_or(arrive_ptr + 1, 1, sem="relaxed")
    if p * BLOCK < T:
        _derive_rows(p * BLOCK + tl.arange(0, BLOCK), qsl_ptr, seq_ptr, slot_ptr, ring_index_ptr,
                     to_req_ptr, pos_ptr, vis_ptr, ring_slot_ptr, comp_slot_ptr, kv_slot_ptr, guard_ptr,
                     claims_ptr, arrive_ptr, R, T, num_live, stray_end, num_slots, epoch, r, C, BLOCK, SEARCH_STEPS,
                     QSL, CLAIMS, ROW_BITS, NULL_RING)
    tl.debug_barrier()  # this program's stores before its arrival
    if tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(arrive_ptr, 0)  # zero for the next step
        if CLAIMS:
            tl.store(claims_ptr + num_slots, epoch)  # every program has read it
        if tl.atomic_xchg(arrive_ptr + 1, 0, sem="relaxed") != 0:
            if CLAIMS:
                _flag_shared_slots(qsl_ptr, flags_ptr, to_req_ptr, kv_slot_ptr, claims_ptr, R, T, num_live,
                                   num_slots, BLOCK, ROW_BITS, SHARED_SLOT)
                tl.debug_barrier()  # the flags before they are applied
            _make_inert(qsl_ptr, flags_ptr, to_req_ptr, pos_ptr, vis_ptr, ring_slot_ptr, comp_slot_ptr, kv_slot_ptr,
                        guard_ptr, R, T, num_live, BLOCK)
    pdl_end(PDL)


@dataclass(frozen=True)
class GuardBits:
    """The guard flag's bits (one reason each, distinct powers of two) and the row field of a
    slot claim, as the caller's contract defines them (the core: `qsa_core.reference.metadata
    .GUARD_BITS`); the build ORs them into request_flags and the guard."""

    max_seq_len: int
    seq_len: int
    query_start_loc: int
    slot: int
    ring_index: int
    page: int
    max_query_len: int
    decode_rows: int
    shared_slot: int
    shared_ring: int
    slot_table: int
    claim_row_bits: int

    def __post_init__(self) -> None:
        bits = [getattr(self, f.name) for f in fields(self) if f.name != "claim_row_bits"]
        if any(b <= 0 or b & (b - 1) for b in bits) or len(set(bits)) != len(bits) or max(bits) >= 1 << 31:
            raise ValueError(f"GuardBits must be distinct powers of two below 2**31, got {bits}")
        if not 0 < self.claim_row_bits < 63:
            raise ValueError(f"GuardBits.claim_row_bits must be in [1, 62], got {self.claim_row_bits}")


_build = Launcher(_metadata_kernel)
_BUILD_INPUTS = ("qsl_ptr", "seq_ptr", "ring_index_ptr", "slot_ptr", "bt_ptr")  # the step's tensors
_BUILD_FREE = _BUILD_INPUTS + ("stride_bt0", "stride_bt1", "P", "max_seq_len", "max_query_len", "num_live",
                               "stray_end", "num_decodes", "decode_query_len")


class MetadataBuild:
    """The metadata build into fixed outputs (a planner's workspace), bound once per (R, T).

    Outputs, contiguous [>= T]: token_to_req int32, positions int64, visible_blocks int32,
    ring_slot int64, compressed_slot int64, kv_slot int64; request_flags int32 [>= R]
    scratch; arrive int32 [2] scratch, zero (the launch leaves it zero); guard int32 [1]
    (sticky). Geometry: compress_ratio r, ring_capacity C, page_size, num_slots and
    num_ring_rows (the bounds of the guards); null_ring_row >= 0: the ring row of the engine's
    padding requests (their rows inert, unflagged; -1: none). slot_claims int64 [num_slots + 1], zero when
    first used (then owned by the build): the shared-slot guard's table; None: no such guard.
    guards: the bits the build writes. inputs_checked: the caller guarantees the five input
    tensors' dtypes and device (a planner validated them), so a launch checks only their
    alignment. options: the kernels' options (launch).
    """

    def __init__(
        self, *, token_to_req: torch.Tensor, positions: torch.Tensor, visible_blocks: torch.Tensor,
        ring_slot: torch.Tensor, compressed_slot: torch.Tensor, kv_slot: torch.Tensor,
        request_flags: torch.Tensor, arrive: torch.Tensor, guard: torch.Tensor,
        compress_ratio: int, ring_capacity: int, page_size: int, num_slots: int, num_ring_rows: int,
        guards: GuardBits, slot_claims: torch.Tensor | None = None, inputs_checked: bool = False,
        null_ring_row: int = -1, options: KernelOptions = DEFAULT,
    ) -> None:
        if slot_claims is not None and (slot_claims.dtype != torch.int64 or slot_claims.numel() != num_slots + 1):
            raise ValueError(f"slot_claims must be int64 [num_slots + 1 = {num_slots + 1}], got "
                             f"{slot_claims.dtype} {tuple(slot_claims.shape)}")
        self.slot_claims, self.guards, self.options = slot_claims, guards, options
        self.outputs = (token_to_req, positions, visible_blocks, ring_slot, compressed_slot, kv_slot)
        self._checked = _BUILD_INPUTS if inputs_checked else ()
        self.request_flags, self.arrive, self.guard = request_flags, arrive, guard
        self.r, self.C, self.page_size = compress_ratio, ring_capacity, page_size
        self.num_slots, self.num_ring_rows, self.null_ring_row = num_slots, num_ring_rows, null_ring_row
        self._bound: dict[tuple[int, int], BoundLaunch] = {}

    def __call__(
        self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
        ring_index: torch.Tensor, block_table: torch.Tensor, max_seq_len: int, max_query_len: int,
        num_live_rows: int, num_decodes: int = 0, decode_query_len: int = 1,
    ) -> None:
        """Inputs as the reference's `qsa_build_metadata`; num_live_rows -1: query_start_loc[R] alone bounds."""
        T, R = slot_mapping.shape[0], seq_lens.shape[0]
        if T == 0:
            return
        live_bound = T if num_live_rows < 0 else num_live_rows
        launch = self._bound.get((R, T))
        if launch is None:
            launch = self._bind(query_start_loc, seq_lens, slot_mapping, ring_index, block_table, max_seq_len,
                                max_query_len, live_bound, num_live_rows, num_decodes, decode_query_len)
        bt0, bt1 = block_table.stride()
        launch(query_start_loc, seq_lens, ring_index, slot_mapping, block_table, bt0, bt1, block_table.shape[1],
               max_seq_len, max_query_len, live_bound, num_live_rows, num_decodes, decode_query_len)

    def _bind(self, qsl, seq, slots, ring, table, max_seq_len, max_query_len, live_bound, stray_end, num_decodes,
              decode_query_len) -> BoundLaunch:
        T, R, g = slots.shape[0], seq.shape[0], self.guards
        launch = _build.bind(
            (max(R, triton.cdiv(T, BLOCK_ROWS)),), qsl, seq, ring, slots, table, table.stride(0), table.stride(1),
            self.request_flags[: max(R, 1)], self.arrive, *(o[:T] for o in self.outputs), self.guard,
            self.outputs[5] if self.slot_claims is None else self.slot_claims,  # any int64 pointer when unused
            R, T, table.shape[1], max_seq_len, max_query_len, live_bound, stray_end, self.num_slots // self.page_size,
            self.num_slots, self.num_ring_rows, self.page_size, num_decodes, decode_query_len, free=_BUILD_FREE,
            checked=self._checked, options=self.options,
            r=self.r, C=self.C, BLOCK=BLOCK_ROWS, SEARCH_STEPS=31, BLOCK_P=BLOCK_PAGES, BLOCK_S=BLOCK_SLOTS,
            MAX_SEQ=g.max_seq_len, SEQ=g.seq_len, QSL=g.query_start_loc, RING=g.ring_index, PAGE=g.page, SLOT=g.slot,
            MAX_QUERY=g.max_query_len, DEC=g.decode_rows, SHARED_RING=g.shared_ring, SHARED_SLOT=g.shared_slot,
            SLOT_TABLE=g.slot_table,
            CLAIMS=int(self.slot_claims is not None), ROW_BITS=g.claim_row_bits, NULL_RING=self.null_ring_row,
        )
        if len(self._bound) >= _CACHE:
            self._bound.clear()
        self._bound[(R, T)] = launch
        return launch


@triton.jit(do_not_specialize=["R", "T", "P", "stride_bt0", "stride_bt1", "rope_stride_axis", "rope_stride_t"])
def _stage_kernel(
    qsl_ptr, seq_ptr, ring_index_ptr, bt_ptr, stride_bt0, stride_bt1, slot_ptr, rope_ptr, rope_stride_axis,
    rope_stride_t, qsl_dst, seq_dst, ring_index_dst, bt_dst, dst_bt0, slot_dst, rope_dst, rope_dst_axis,
    R, T, P,
    AXES: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Program p copies request p's entries and block-table row (p < R), and rows
    [p*BLOCK, (p+1)*BLOCK) of slot_mapping and the AXES rope-position rows (0: none)."""
    pdl_start(PDL)
    p = tl.program_id(0).to(tl.int64)
    if p < R:
        tl.store(seq_dst + p, tl.load(seq_ptr + p))
        tl.store(ring_index_dst + p, tl.load(ring_index_ptr + p))
        tl.store(qsl_dst + p + 1, tl.load(qsl_ptr + p + 1))
        if p == 0:
            tl.store(qsl_dst, tl.load(qsl_ptr))
        c0 = p * 0
        while c0 < P:
            cols = c0 + tl.arange(0, BLOCK_P)
            page = tl.load(bt_ptr + p * stride_bt0 + cols * stride_bt1, mask=cols < P)
            tl.store(bt_dst + p * dst_bt0 + cols, page, mask=cols < P)
            c0 += BLOCK_P
    rows = p * BLOCK + tl.arange(0, BLOCK)
    tl.store(slot_dst + rows, tl.load(slot_ptr + rows, mask=rows < T), mask=rows < T)
    for a in tl.static_range(AXES):
        pos = tl.load(rope_ptr + a * rope_stride_axis + rows * rope_stride_t, mask=rows < T)
        tl.store(rope_dst + a * rope_dst_axis + rows, pos, mask=rows < T)
    pdl_end(PDL)


_stage = Launcher(_stage_kernel)
_STAGE_FREE = ("qsl_ptr", "seq_ptr", "ring_index_ptr", "bt_ptr", "stride_bt0", "stride_bt1", "slot_ptr", "rope_ptr",
               "rope_stride_axis", "rope_stride_t")


class StaticStage:
    """Copies a step's inputs into fixed buffers (`QSAPlanner.plan(static=True)`) in one launch.

    Buffers (contiguous): query_start_loc int32 [>= R+1], seq_lens int32 [>= R], block_table
    int32 [>= R, >= P], slot_mapping int64 [>= T], ring_index int32 [>= R], rope_positions
    int64 [1 or 3, >= T]. Bound once per (R, T, P, rope rank).
    """

    def __init__(self, *, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 slot_mapping: torch.Tensor, ring_index: torch.Tensor, rope_positions: torch.Tensor,
                 options: KernelOptions = DEFAULT) -> None:
        self.options = options
        self.buffers = (query_start_loc, seq_lens, block_table, slot_mapping, ring_index, rope_positions)
        self._bound: dict[tuple[int, int, int, int], tuple[BoundLaunch, tuple]] = {}

    def __call__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 slot_mapping: torch.Tensor, ring_index: torch.Tensor, rope_positions: torch.Tensor | None,
                 ) -> tuple[torch.Tensor, ...]:
        """Stage the step (block_table's first R rows); returns the buffers' views
        (query_start_loc, seq_lens, block_table [R, P], slot_mapping, ring_index,
        rope_positions or None) in the inputs' shapes."""
        R, T, P = seq_lens.shape[0], slot_mapping.shape[0], block_table.shape[1]
        axes = 0 if rope_positions is None else (1 if rope_positions.dim() == 1 else 3)
        key = (R, T, P, axes)
        found = self._bound.get(key)
        if found is None:
            found = self._bind(key, query_start_loc, seq_lens, block_table, slot_mapping, ring_index, rope_positions)
        launch, views = found
        rope, rs_axis, rs_t = (slot_mapping, 0, 1) if rope_positions is None else (
            (rope_positions, 0, rope_positions.stride(0)) if axes == 1
            else (rope_positions, rope_positions.stride(0), rope_positions.stride(1)))
        if max(R, T):
            launch(query_start_loc, seq_lens, ring_index, block_table, block_table.stride(0), block_table.stride(1),
                   slot_mapping, rope, rs_axis, rs_t)
        return views

    def _bind(self, key, qsl, seq, table, slots, ring, rope_positions):
        R, T, P, axes = key
        qsl_b, seq_b, table_b, slots_b, ring_b, rope_b = self.buffers
        rope, rs_axis, rs_t = (slots, 0, 1) if rope_positions is None else (
            (rope_positions, 0, rope_positions.stride(0)) if axes == 1
            else (rope_positions, rope_positions.stride(0), rope_positions.stride(1)))
        launch = _stage.bind(
            (max(R, triton.cdiv(T, BLOCK_ROWS), 1),), qsl, seq, ring, table, table.stride(0), table.stride(1),
            slots, rope, rs_axis, rs_t, qsl_b, seq_b, ring_b, table_b, table_b.stride(0), slots_b, rope_b,
            rope_b.stride(0), R, T, P, free=_STAGE_FREE, options=self.options, AXES=axes, BLOCK_P=BLOCK_PAGES, BLOCK=BLOCK_ROWS,
        )
        rope_view = None if axes == 0 else (rope_b[0, :T] if axes == 1 else rope_b[:, :T])
        views = (qsl_b[: R + 1], seq_b[:R], table_b[:R, :P], slots_b[:T], ring_b[:R], rope_view)
        if len(self._bound) >= _CACHE:
            self._bound.clear()
        self._bound[key] = (launch, views)
        return launch, views
