"""Triton metadata build vs the reference: every derived field bitwise, padding rows inert."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core import QSAConfig, QSAPlanner, QSAStepInputs  # noqa: E402
from qsa_core.reference import qsa_build_metadata as reference_build  # noqa: E402
from kernel_options import OPTS  # noqa: E402
from entry import build_metadata as qsa_build_metadata  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.interpreter  # (TRITON_INTERPRET=1, CPU tensors: tests/conftest.py)

FIELDS = ("token_to_req", "positions", "visible_blocks", "ring_slot", "compressed_slot")


def make_step(qlens, context, num_pad, gen, device, num_slots=10_000, ring_rows=64):
    """Engine inputs of a step with the given query lengths (0 allowed) and contexts."""
    R = len(qlens)
    qsl = torch.tensor([0] + list(qlens), dtype=torch.int64).cumsum(0).to(torch.int32)
    seq = torch.tensor([c + q for c, q in zip(context, qlens)], dtype=torch.int32)
    T = int(qsl[-1]) + num_pad
    slots = torch.randint(0, num_slots, (T,), generator=gen)
    slots[torch.rand(T, generator=gen) < 0.15] = -1  # rows without a main slot
    slots[T - num_pad :] = -1
    ring = torch.randperm(ring_rows, generator=gen)[:R].to(torch.int32)
    return [t.to(device) for t in (qsl, seq, slots, ring)]


def guard_args(qsl, seq, slots, width=None):
    """Guard inputs of a well-formed step: pages of one slot, and a block table whose entry at
    each live row's position is that row's slot (so any slot agrees with it) and page 0
    elsewhere, `width` (default the longest seq_len) columns; loose bounds. Reads the step on
    the host."""
    dev = slots.device
    R = seq.shape[0]
    width = width or (max(1, int(seq.max())) if R else 1)
    table = torch.zeros(R, width, dtype=torch.int32)
    qlens = (qsl[1:] - qsl[:-1]).long().cpu()
    n = int(qlens.sum())
    req = torch.repeat_interleave(torch.arange(R), qlens)
    pos = (seq.long().cpu() - qlens)[req] + torch.arange(n) - qsl[:-1].long().cpu()[req]
    live = slots[:n].cpu()
    put = (live >= 0) & (pos >= 0) & (pos < width)
    table[req[put], pos[put]] = live[put].to(torch.int32)
    return dict(
        block_table=table.to(dev), page_size=1, num_live_rows=int(qsl[-1]), num_slots=1 << 31,
        num_ring_rows=1 << 40, kv_slot=torch.empty(slots.shape[0], dtype=torch.int64, device=dev),
        request_flags=torch.zeros(max(R, 1), dtype=torch.int32, device=dev),
    )


def build(fn, qsl, seq, slots, ring, r, C, outs, max_seq_len=1 << 30, guard=None, max_query_len=1 << 30, **extra):
    """Run a metadata build `fn` into outs (the five derived fields, then optionally kv_slot);
    returns the guard flag. extra: guard inputs (default `guard_args` of the step)."""
    guard = torch.zeros(1, dtype=torch.int32, device=slots.device) if guard is None else guard
    kw = extra or guard_args(qsl, seq, slots)
    if len(outs) > len(FIELDS):
        kw = dict(kw, kv_slot=outs[len(FIELDS)])
    table = kw.pop("block_table")
    fn(qsl, seq, slots, ring, table, compress_ratio=r, ring_capacity=C, max_seq_len=max_seq_len,
       max_query_len=max_query_len, guard=guard, **kw, **dict(zip(FIELDS, outs)))
    return guard


def run_both(qsl, seq, slots, ring, r, C, max_seq_len=1 << 30):
    """(kernel outputs, reference outputs); kernel buffers start as garbage."""
    T = slots.shape[0]
    dev = slots.device

    def buffers(fill):
        return [
            torch.full((T,), fill, dtype=torch.int32, device=dev),
            torch.full((T,), fill, dtype=torch.int64, device=dev),
            torch.full((T,), fill, dtype=torch.int32, device=dev),
            torch.full((T,), fill, dtype=torch.int64, device=dev),
            torch.full((T,), fill, dtype=torch.int64, device=dev),
            torch.full((T,), fill, dtype=torch.int64, device=dev),  # kv_slot
        ]

    got, want = buffers(12345), buffers(0)
    flags = [build(qsa_build_metadata, qsl, seq, slots, ring, r, C, got, max_seq_len),
             build(reference_build, qsl, seq, slots, ring, r, C, want, max_seq_len)]
    return got + [flags[0]], want + [flags[1]]


def assert_same(got, want):
    for name, g, w in zip(FIELDS + ("kv_slot", "guard"), got, want):
        assert g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@interp
@pytest.mark.parametrize("r,C", [(4, 4), (4, 8), (2, 6), (3, 3)])
def test_ragged_batches(r, C):
    gen = torch.Generator().manual_seed(r * 10 + C)
    cases = [
        ([1, 1, 1, 5, 17, 2], [30, 3, 0, 0, 11, 6], 4),  # decodes then prefills, padding
        ([4, 4, 9, 1], [8, 21, 0, 3], 0),
        ([3, 0, 6, 0, 2], [1, 5, 2, 0, 9], 3),  # zero-length requests
        ([300], [1000], 5),  # one long chunk: ring only on its last C rows
        ([1] * 40 + [7, 13], list(range(40)) + [2, 0], 9),  # more rows than one block
    ]
    for qlens, ctx, pad in cases:
        got, want = run_both(*make_step(qlens, ctx, pad, gen, "cpu"), r, C)
        assert_same(got, want)
        assert got[-1].item() == 0  # a well-formed step trips no guard


@interp
def test_idle_step_all_padding():
    """R == 0: every row is padding (request 0, position -1, everything inert)."""
    gen = torch.Generator().manual_seed(0)
    qsl, seq, slots, ring = make_step([], [], 7, gen, "cpu")
    got, want = run_both(qsl, seq, slots, ring, 4, 4)
    assert_same(got, want)
    assert torch.equal(got[1], torch.full((7,), -1))


@interp
def test_empty_step():
    gen = torch.Generator().manual_seed(0)
    got, want = run_both(*make_step([], [], 0, gen, "cpu"), 4, 4)
    assert_same(got, want)


@interp
@pytest.mark.parametrize("bound", [0, 5, 13, 29])
def test_column_bound_guard(bound):
    """Requests with seq_len > max_seq_len become inert and trip the flag, kernel as reference."""
    gen = torch.Generator().manual_seed(bound)
    qlens = torch.tensor([1, 1, 5, 17, 2])
    step = make_step(qlens.tolist(), [30, 3, 0, 11, 6], 4, gen, "cpu")
    got, want = run_both(*step, 4, 8, max_seq_len=bound)
    assert_same(got, want)
    assert got[-1].item() == 1
    long_rows = step[1].repeat_interleave(qlens) > bound  # seq_len of each live row's request
    assert long_rows.any() and (got[1][:26][long_rows] == -1).all() and (got[2][:26][long_rows] == 0).all()
    assert (got[1][:26][~long_rows] >= 0).all()


@interp
@pytest.mark.parametrize("qlens, num_decodes, dq, flagged", [
    ([4, 2, 4, 4, 5], 4, 4, [1, 2, 3]),  # request 1 has 2 rows: it, and the decodes its rows shift
    ([4, 0, 4, 3], 3, 4, []),  # a 0-row decode (CUDA-graph padding), then a prefill
    ([1, 1, 1, 6], 3, 1, []),
    ([3, 3, 2], 3, 3, [2]),
])
def test_decode_rows_guard(qlens, num_decodes, dq, flagged):
    """Decode requests (the first num_decodes) of other than decode_query_len or 0 rows, or
    starting off a multiple of it, become inert and trip GUARD_DECODE_ROWS, kernel as reference."""
    gen = torch.Generator().manual_seed(len(qlens))
    qsl, seq, slots, ring = make_step(qlens, [20] * len(qlens), 2, gen, "cpu")
    T = slots.shape[0]
    outs = {}
    for name, fn in (("kernel", qsa_build_metadata), ("reference", reference_build)):
        bufs = [torch.full((T,), 7, dtype=dt) for dt in (torch.int32, torch.int64, torch.int32, torch.int64,
                                                         torch.int64, torch.int64)]
        extra = dict(guard_args(qsl, seq, slots), num_decodes=num_decodes, decode_query_len=dq)
        outs[name] = bufs + [build(fn, qsl, seq, slots, ring, 4, 8, bufs, **extra)]
    assert_same(outs["kernel"], outs["reference"])
    guard, positions = outs["kernel"][-1], outs["kernel"][1]
    req = torch.repeat_interleave(torch.tensor(qlens))
    inert = torch.isin(req, torch.tensor(flagged, dtype=torch.long))
    assert guard.item() == (128 if flagged else 0)
    assert (positions[: len(req)][inert] == -1).all() and (positions[: len(req)][~inert] >= 0).all()


SHARED_SLOT, SHARED_RING = 256, 512
# (query lengths, the live rows' slots, ring_index, flagged requests, guard): one build each,
# in order, on one claim table.
SHARED_STEPS = [
    ([2, 3, 1], [0, 1, 2, 3, 4, 5], [0, 1, 2], [], 0),
    ([3, 2, 1], [0, 1, 2, 3, 4, 5], [1, 2, 0], [], 0),  # the same slots again, by other requests
    ([2, 2, 2], [7, 8, 9, 7, 10, 11], [0, 1, 2], [0, 1], SHARED_SLOT),  # rows 0 and 3
    ([2, 0, 2], [12, 13, 14, 15], [3, 3, 4], [], 0),  # a request without rows shares ring row 3
    ([1, 1, 2], [20, -1, -1, 21], [5, 6, 5], [0, 2], SHARED_RING),  # -1 repeats freely
    ([3, 1], [30, 31, 30, 40], [0, 1], [0], SHARED_SLOT),  # two rows of one request
    ([2, 1, 1], [41, 42, 43, 41], [0, 0, 1], [0, 1, 2], SHARED_SLOT | SHARED_RING),
    ([1, 1], [50, 51], [0, 1], [], 0),  # two padding rows carry slot 50 too: never claimed
]


@interp
def test_shared_slot_and_ring_guards_over_steps():
    """Live rows sharing a write slot and requests with rows sharing a ring row make every
    request concerned inert and trip their bit, kernel as reference (request flags included).
    The kernel's claim table persists between builds: a slot written again in a later step,
    by any request, is not shared."""
    num_slots, pad = 64, 2
    claims = torch.zeros(num_slots + 1, dtype=torch.int64)
    for qlens, live_slots, rings, flagged, bits in SHARED_STEPS:
        R = len(qlens)
        qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
        seq = torch.tensor([q + 8 for q in qlens], dtype=torch.int32)
        slots = torch.tensor(live_slots + [50] * pad, dtype=torch.int64)
        ring = torch.tensor(rings, dtype=torch.int32)
        T = slots.shape[0]
        outs = {}
        for name, fn, table in (("kernel", qsa_build_metadata, claims), ("reference", reference_build, claims[:1])):
            bufs = [torch.full((T,), 7, dtype=dt) for dt in (torch.int32, torch.int64, torch.int32, torch.int64,
                                                             torch.int64, torch.int64)]
            extra = dict(guard_args(qsl, seq, slots), num_slots=num_slots, slot_claims=table)
            extra["num_live_rows"] = T - pad
            guard = build(fn, qsl, seq, slots, ring, 4, 8, bufs, **extra)
            outs[name] = bufs + [guard, extra["request_flags"][:R].clone()]
        assert_same(outs["kernel"][:7], outs["reference"][:7])
        assert torch.equal(outs["kernel"][7], outs["reference"][7]), (outs["kernel"][7], outs["reference"][7])
        guard, positions, flags = outs["kernel"][6], outs["kernel"][1], outs["kernel"][7]
        assert guard.item() == bits, qlens
        assert [i for i in range(R) if flags[i] != 0] == flagged
        inert = torch.isin(torch.repeat_interleave(torch.tensor(qlens)), torch.tensor(flagged, dtype=torch.long))
        assert (positions[: T - pad][inert] == -1).all() and (positions[: T - pad][~inert] >= 0).all()


# (query lengths, ring_index, null_ring_row, flagged requests, guard): requests 1 and 3 on ring
# row 0, vLLM's null block, as its dummy runs put every request.
NULL_RING_STEPS = [
    ([2, 3, 1, 2], [4, 0, 5, 0], 0, [], 0),  # padding requests: inert, unflagged
    ([2, 3, 1, 2], [4, 0, 5, 0], -1, [1, 3], SHARED_RING),  # without a null ring row: flagged
    ([2, 3, 1, 2], [0, 0, 0, 0], 0, [], 0),  # a dummy run: every request on it
    ([2, 3, 1, 2], [4, 0, 4, 0], 0, [0, 2], SHARED_RING),  # others still may not share a ring row
    ([2, 3, 1, 2], [4, 0, 70, 0], 0, [2], 16),  # nor leave the ring (16: GUARD_RING_INDEX)
]


@interp
@pytest.mark.parametrize("qlens,rings,null,flagged,bits", NULL_RING_STEPS)
def test_null_ring_row_requests_are_inert_and_unflagged(qlens, rings, null, flagged, bits):
    """A request on the planner's null_ring_row (an engine's padding request) is inert: every
    field of its rows as a padding row's (to_req 0, position -1, nothing visible, no ring,
    compressed or K/V slot) and no flag; kernel as reference, request flags included."""
    R, pad = len(qlens), 2
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    seq = torch.tensor([q + 9 for q in qlens], dtype=torch.int32)
    T = int(qsl[-1]) + pad
    slots = torch.arange(T, dtype=torch.int64) * 4 + 3  # every live row closes a group
    slots[-pad:] = -1
    ring = torch.tensor(rings, dtype=torch.int32)
    outs = {}
    for name, fn in (("kernel", qsa_build_metadata), ("reference", reference_build)):
        bufs = [torch.full((T,), 7, dtype=dt) for dt in (torch.int32, torch.int64, torch.int32, torch.int64,
                                                         torch.int64, torch.int64)]
        extra = dict(guard_args(qsl, seq, slots), num_ring_rows=64, null_ring_row=null, num_live_rows=T - pad)
        guard = build(fn, qsl, seq, slots, ring, 4, 8, bufs, **extra)
        outs[name] = bufs + [guard, extra["request_flags"][:R].clone()]
    assert_same(outs["kernel"][:7], outs["reference"][:7])
    assert torch.equal(outs["kernel"][7], outs["reference"][7]), (outs["kernel"][7], outs["reference"][7])
    to_req, positions, visible, ring_slot, comp_slot, kv_slot, guard, flags = outs["kernel"]
    assert guard.item() == bits
    assert [i for i in range(R) if flags[i] != 0] == flagged
    req = torch.repeat_interleave(torch.tensor(qlens))
    inert = torch.isin(req, torch.tensor(flagged, dtype=torch.long)) | (ring[req] == null)
    live = T - pad
    for field, empty in ((to_req, 0), (positions, -1), (visible, 0), (ring_slot, -1), (comp_slot, -1),
                         (kv_slot, -1)):
        assert (field[:live][inert] == empty).all(), field
    assert (positions[:live][~inert] >= 0).all() and (kv_slot[:live][~inert] >= 0).all()


# (query lengths, seq_lens, ring_index, live rows' slots): requests on ring row 0, the null ring
# row, carrying values every guard refuses elsewhere. SGLang's prefill-graph capture: one request
# on its request-pool row 0, every row writing its padding slot 0; dummies writing one slot with
# each other and with a live request; a dummy whose seq_len is below its query length and whose
# slots leave the cache (64 slots).
PAD_VALUE_STEPS = [
    ([6], [6], [0], [0] * 6),
    ([2, 2, 2], [9, 4, 9], [0, 3, 0], [9, 9, 9, 10, 9, 9]),
    ([3, 1], [1, 5], [0, 2], [-5, 70, 1, 11]),
]


@interp
@pytest.mark.parametrize("qlens,seqs,rings,live_slots", PAD_VALUE_STEPS)
def test_null_ring_row_requests_are_not_checked(qlens, seqs, rings, live_slots):
    """The engine's padding requests are inert whatever their values: no guard looks at them
    (slot claims included), so they flag nothing and the live requests run; kernel as reference.
    The same step without a null ring row is flagged."""
    num_slots, pad = 64, 2
    R = len(qlens)
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    seq = torch.tensor(seqs, dtype=torch.int32)
    slots = torch.tensor(live_slots + [-1] * pad, dtype=torch.int64)
    ring = torch.tensor(rings, dtype=torch.int32)
    T = slots.shape[0]
    req = torch.repeat_interleave(torch.tensor(qlens))
    dummy = ring[req] == 0
    for null in (0, -1):
        outs = {}
        for name, fn, claims in (("kernel", qsa_build_metadata, torch.zeros(num_slots + 1, dtype=torch.int64)),
                                 ("reference", reference_build, torch.zeros(1, dtype=torch.int64))):
            bufs = [torch.full((T,), 7, dtype=dt) for dt in (torch.int32, torch.int64, torch.int32, torch.int64,
                                                             torch.int64, torch.int64)]
            extra = dict(guard_args(qsl, seq, slots), num_slots=num_slots, num_ring_rows=64, slot_claims=claims,
                         null_ring_row=null, num_live_rows=T - pad)
            guard = build(fn, qsl, seq, slots, ring, 4, 8, bufs, **extra)
            outs[name] = bufs + [guard, extra["request_flags"][:R].clone()]
        assert_same(outs["kernel"][:7], outs["reference"][:7])
        assert torch.equal(outs["kernel"][7], outs["reference"][7]), (outs["kernel"][7], outs["reference"][7])
        positions, kv_slot, guard, flags = outs["kernel"][1], outs["kernel"][5], outs["kernel"][6], outs["kernel"][7]
        if null < 0:
            assert guard.item() != 0 and bool(flags.ne(0).any())
            continue
        assert guard.item() == 0 and not bool(flags.ne(0).any())
        live = T - pad
        assert (positions[:live][dummy] == -1).all() and (kv_slot[:live][dummy] == -1).all()
        assert (positions[:live][~dummy] >= 0).all() and torch.equal(kv_slot[:live][~dummy], slots[:live][~dummy])


SLOT_TABLE = 1024


@interp
@pytest.mark.parametrize("row, change, flagged", [
    (None, 0, []),  # every slot its position's through the block table
    (5, 1, [1]),  # request 1's third row one slot along its page
    (5, 8, [1]),  # the same offset in the next page
    (0, 1, [0]),  # request 0's first row
    (5, None, []),  # -1: no write, nothing to agree with
])
def test_a_slot_off_its_block_table_position_is_flagged(row, change, flagged):
    """A live row whose slot is not block_table[req, pos // page_size] * page_size + pos %
    page_size (its K/V would land where no read of the request looks) makes its request inert
    with GUARD_SLOT_TABLE, kernel as reference; request flags included."""
    page, qlens, ctx, pad = 8, [3, 4, 2], [5, 12, 0], 2
    R = len(qlens)
    qsl = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    seq = torch.tensor([c + q for c, q in zip(ctx, qlens)], dtype=torch.int32)
    table = torch.tensor([[7, 2, 0], [4, 9, 5], [11, 0, 0]], dtype=torch.int32)
    req = torch.repeat_interleave(torch.tensor(qlens))
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, qlens)])
    slots = torch.cat([table[req, pos // page].long() * page + pos % page, torch.full((pad,), -1)])
    if row is not None:
        slots[row] = -1 if change is None else slots[row] + change
    T = slots.shape[0]
    outs = {}
    for name, fn in (("kernel", qsa_build_metadata), ("reference", reference_build)):
        bufs = [torch.full((T,), 7, dtype=dt) for dt in (torch.int32, torch.int64, torch.int32, torch.int64,
                                                         torch.int64, torch.int64)]
        extra = dict(guard_args(qsl, seq, slots), block_table=table, page_size=page, num_slots=16 * page,
                     num_live_rows=T - pad)
        guard = build(fn, qsl, seq, slots, torch.arange(R, dtype=torch.int32), 4, 8, bufs, **extra)
        outs[name] = bufs + [guard, extra["request_flags"][:R].clone()]
    assert_same(outs["kernel"][:7], outs["reference"][:7])
    assert torch.equal(outs["kernel"][7], outs["reference"][7]), (outs["kernel"][7], outs["reference"][7])
    positions, guard, flags = outs["kernel"][1], outs["kernel"][6], outs["kernel"][7]
    assert guard.item() == (SLOT_TABLE if flagged else 0)
    assert [i for i in range(R) if flags[i] != 0] == flagged
    inert = torch.isin(req, torch.tensor(flagged, dtype=torch.long))
    assert (positions[: len(req)][inert] == -1).all() and (positions[: len(req)][~inert] >= 0).all()


@interp
def test_planner_persistent_buffers(monkeypatch):
    """The planner path (ops dispatch to Triton) fills its persistent buffers in place."""
    monkeypatch.setenv("QSA_BACKEND", "triton")
    gen = torch.Generator().manual_seed(1)
    config = QSAConfig(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=16, index_n_heads=2,
                       index_head_dim=16, token_topk=8, compress_ratio=4, rotary_dim=8, rope_theta=1e4)
    planner = QSAPlanner(config, dtype=torch.float32, page_size=8, ring_capacity=8, max_num_tokens=64,
                         max_model_len=64)
    assert planner.backend.name == "triton"
    for qlens, ctx, pad in (([1, 1, 6], [9, 4, 0], 3), ([2, 9], [5, 14], 0)):
        qsl, seq, slots, ring = make_step(qlens, ctx, pad, gen, "cpu", num_slots=200, ring_rows=4)
        table = torch.arange(len(qlens) * 4, dtype=torch.int32).view(len(qlens), 4)
        # An engine's slots: each live row's (but -1) is its position's through the block
        # table (the planner's value checks on CPU tensors require it).
        req = torch.repeat_interleave(torch.tensor(qlens))
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, qlens)])
        slots[: len(req)] = torch.where(slots[: len(req)] >= 0, table[req, pos // 8].long() * 8 + pos % 8, -1)
        meta = planner.plan(QSAStepInputs(
            query_start_loc=qsl, seq_lens=seq, block_table=table, slot_mapping=slots, ring_index=ring,
            num_decodes=2 if qlens[0] == 1 else 0, max_query_len=max(qlens), max_seq_len=int(seq.max()),
            num_padding_rows=pad,
        )).meta
        _, want = run_both(qsl, seq, slots, ring, 4, 8)
        assert_same([getattr(meta, f) for f in FIELDS], want[:5])


def compiled_variants(kernel) -> int:
    """Number of compiled specializations of a Triton kernel on the current device."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_production_batch_gpu():
    """256 decodes with 3 drafts, a few long prefills and CUDA-graph padding, on the GPU;
    batch-varying R and T compile one variant only."""
    from qsa_kernels.metadata import _metadata_kernel

    gen = torch.Generator().manual_seed(2)
    qlens = [4] * 256 + [8192, 1, 3001, 513]
    ctx = torch.randint(1, 131072, (256,), generator=gen).tolist() + [0, 70000, 4096, 2]
    qsl, seq, slots, ring = make_step(qlens, ctx, 77, gen, "cuda", num_slots=1 << 22, ring_rows=512)
    got, want = run_both(qsl, seq, slots, ring, 4, 8)
    assert_same(got, want)
    assert got[-1].item() == 0  # a well-formed step trips no guard
    before = compiled_variants(_metadata_kernel)
    for qlens, ctx, pad in (([1] * 17, list(range(17)), 15), ([16, 1, 32], [0, 5, 7], 0), ([], [], 33)):
        assert_same(*run_both(*make_step(qlens, ctx, pad, gen, "cuda"), 4, 8))
    assert compiled_variants(_metadata_kernel) == before


@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    """Captured once, replayed on new step values of the same shape."""
    gen = torch.Generator().manual_seed(3)
    qlens, ctx = [4] * 8 + [100, 37], [50] * 8 + [0, 900]
    static = make_step(qlens, ctx, 11, gen, "cuda")
    T = static[2].shape[0]
    dtypes = (torch.int32, torch.int64, torch.int32, torch.int64, torch.int64)
    outs = [torch.empty(T, dtype=d, device="cuda") for d in dtypes]
    extra = guard_args(*static[:3], width=1024)  # host reads and allocations stay outside the capture
    build(qsa_build_metadata, *static, 4, 8, outs, **extra)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build(qsa_build_metadata, *static, 4, 8, outs, **extra)
    for qlens, ctx in (([4] * 8 + [120, 17], [9] * 8 + [3, 0]), ([4] * 8 + [137, 0], [1] * 8 + [0, 5])):
        fresh = make_step(qlens, ctx, 11, gen, "cuda")
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        extra["block_table"].copy_(guard_args(*fresh[:3], width=1024)["block_table"])
        graph.replay()
        want = [torch.empty_like(o) for o in outs]
        build(reference_build, *fresh, 4, 8, want)
        assert_same(outs, want)


@interp
@pytest.mark.parametrize("rope_axes", [0, 1, 3])
def test_static_stage_copies_a_step_in_one_launch(rope_axes):
    """Every input lands in its fixed buffer (a strided block table included); entries past
    the step keep their old values; the views returned have the inputs' shapes."""
    from qsa_kernels.metadata import StaticStage

    gen = torch.Generator().manual_seed(rope_axes)
    R, T, P = 5, 300, 7  # more rows than one block
    buffers = dict(
        query_start_loc=torch.full((9,), -7, dtype=torch.int32), seq_lens=torch.full((8,), -7, dtype=torch.int32),
        block_table=torch.full((8, 10), -7, dtype=torch.int32), slot_mapping=torch.full((320,), -7),
        ring_index=torch.full((8,), -7, dtype=torch.int32), rope_positions=torch.full((3, 320), -7),
    )
    before = {k: v.clone() for k, v in buffers.items()}
    inputs = (
        torch.randint(0, 99, (R + 1,), generator=gen, dtype=torch.int32),
        torch.randint(0, 99, (R,), generator=gen, dtype=torch.int32),
        torch.randint(0, 99, (P, R + 2), generator=gen, dtype=torch.int32).t(),  # [R + 2, P], column-major
        torch.randint(-1, 999, (T,), generator=gen),
        torch.randint(0, 9, (R,), generator=gen, dtype=torch.int32),
        None if rope_axes == 0 else torch.randint(0, 999, (T,) if rope_axes == 1 else (3, T), generator=gen),
    )
    views = StaticStage(**buffers, options=OPTS)(*inputs)
    want = list(inputs)
    want[2] = inputs[2][:R]
    for got, src in zip(views, want):
        assert (got is None) == (src is None)
        if src is not None:
            assert torch.equal(got, src)
    staged = dict(query_start_loc=(R + 1,), seq_lens=(R,), slot_mapping=(T,), ring_index=(R,))
    for name, (n,) in staged.items():
        assert torch.equal(buffers[name][n:], before[name][n:]), name
    assert torch.equal(buffers["block_table"][R:], before["block_table"][R:])
    assert torch.equal(buffers["block_table"][:, P:], before["block_table"][:, P:])
    assert torch.equal(buffers["rope_positions"][:, T:], before["rope_positions"][:, T:])
    if rope_axes < 3:
        assert torch.equal(buffers["rope_positions"][rope_axes:], before["rope_positions"][rope_axes:])


SM90_COMPILE = """
from qsa_kernels import metadata as m
from sm90 import compile_sm90
from qsa_core.reference import metadata as g
consts = dict(r=4, C=8, BLOCK=m.BLOCK_ROWS, SEARCH_STEPS=31, BLOCK_P=m.BLOCK_PAGES, BLOCK_S=m.BLOCK_SLOTS,
              MAX_SEQ=g.GUARD_MAX_SEQ_LEN, SEQ=g.GUARD_SEQ_LEN, QSL=g.GUARD_QUERY_START_LOC, RING=g.GUARD_RING_INDEX,
              PAGE=g.GUARD_PAGE, SLOT=g.GUARD_SLOT, MAX_QUERY=g.GUARD_MAX_QUERY_LEN, DEC=g.GUARD_DECODE_ROWS,
              SHARED_RING=g.GUARD_SHARED_RING, SHARED_SLOT=g.GUARD_SHARED_SLOT, SLOT_TABLE=g.GUARD_SLOT_TABLE,
              ROW_BITS=g.CLAIM_ROW_BITS, PDL=2)
i64 = ("slot_ptr", "pos_ptr", "ring_slot_ptr", "comp_slot_ptr", "kv_slot_ptr", "claims_ptr")
# without and with the shared-slot claim table; with a null ring row (vLLM's, SGLang's)
for claims, null in ((0, -1), (1, -1), (1, 0)):
    k = compile_sm90(m._metadata_kernel, dict(consts, CLAIMS=claims, NULL_RING=null), dict.fromkeys(i64, "*i64"),
                     launch_pdl=True)
    print(k.asm["ptx"].count("atom.global"))
"""


@pytest.mark.sm90
def test_metadata_kernel_compiles_for_sm90():
    """The build compiles for the H200 here, without a GPU: the interpreter accepts what the
    compiler rejects (a loop variable that changes type, a constexpr without a value)."""
    from sm90 import run as run_script

    run = run_script(SM90_COMPILE, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    plain, claims, null = (int(n) for n in run.stdout.split()[-3:])
    assert 0 < plain < claims == null  # the arrival counter and the guard's atomics; then the slot claims
