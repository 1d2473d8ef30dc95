"""Triton write side (the fused prepare: group compression, ring and K/V stores) vs the reference.

Realistic steps come from `QSAPlanner` + `QSACacheLayout`: chunked prefills that end
inside a group and are longer than the ring, decodes, speculative ring capacity, MRoPE
positions, fp8 index and main-KV dtypes, NaN-poisoned padding rows. Each step runs the
reference on a copy of the caches and the kernel on the caches; all three caches and the
returned tensors are compared.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qsa_core import reference  # noqa: E402
from qsa_core.cache import QSACacheLayout, QSALayerCache, ring_capacity, ring_store_fuses  # noqa: E402
from qsa_core.config import QSAConfig, resolve_dtype  # noqa: E402
from qsa_core import QSAPlanner, QSAStepInputs  # noqa: E402
import entry  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.interpreter  # (TRITON_INTERPRET=1, CPU tensors: tests/conftest.py)

# Max |a - b| allowed per dtype: one unit in the last place (relative) plus a subnormal step.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float8_e4m3fn: dict(rtol=0.13, atol=2**-8),
    torch.float8_e5m2: dict(rtol=0.26, atol=2**-15),
}


# On the GPU the reference's rsqrt and fp32 sums differ from the kernel's in the last bits,
# which now and then flips one bf16 rounding of an intermediate (normed value, pooled key);
# RoPE's a*cos + b*sin can then cancel to a small result. Such rows may be off by a few bf16
# ulps of the intermediate (|x| < 8): rare, and bounded by GPU_FLIP_ATOL.
GPU_FLIP_FRACTION = 1e-4
GPU_FLIP_ATOL = 0.07


# In the interpreter the kernels round every bf16 / fp8 intermediate as the reference does; only
# the fp32 rsqrt and summation order differ, which flips one intermediate rounding in a rare
# element (seen: 1 of 12288; RoPE's a*cos + b*sin may carry the flip into a few output steps).
INTERP_FLIP_FRACTION = 1e-3


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Interpreter, low-precision dtype: bitwise except at most INTERP_FLIP_FRACTION of the
    elements, which stay within the dtype's tolerance. fp32 and the GPU: the tolerances above."""
    if not actual.is_cuda and dtype != torch.float32:
        assert actual.dtype == expected.dtype == dtype, what
        a, e = actual.float(), expected.float()
        same = (a == e) | (a.isnan() & e.isnan())
        frac = float((~same).float().mean()) if same.numel() else 0.0
        assert frac <= INTERP_FLIP_FRACTION, f"{what}: {frac:.2e} of the elements are not bitwise equal"
        torch.testing.assert_close(a, e, **TOL[dtype], equal_nan=True, msg=lambda m: f"{what}: {m}")
        return
    a, e = actual.float(), expected.float()
    tol = TOL[dtype]
    if a.is_cuda and dtype != torch.float32:
        off = ~torch.isclose(a, e, **tol)
        frac = off.float().mean().item() if off.numel() else 0.0
        assert frac <= GPU_FLIP_FRACTION, f"{what}: {frac:.2e} of the elements off"
        tol = dict(tol, atol=max(tol["atol"], GPU_FLIP_ATOL))
    torch.testing.assert_close(a, e, **tol, msg=lambda m: f"{what}: {m}")


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise (NaN == NaN): pure stores and casts round the same on every device."""
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    assert actual.dtype == expected.dtype and bool(same.all()), (
        f"{what}: {int((~same).sum())} of {same.numel()} elements differ"
    )


def small_config(mrope: bool, index_dtype: str = "auto", kv_dtype: str = "auto") -> QSAConfig:
    return QSAConfig(
        hidden_size=64, num_heads=6, num_kv_heads=2, head_dim=32, index_n_heads=2, index_head_dim=32,
        token_topk=16, compress_ratio=4, rotary_dim=16, rope_theta=10000.0,
        mrope_section=(3, 3, 2) if mrope else None, index_dtype=index_dtype, kv_cache_dtype=kv_dtype,
    )


def production_config(mrope: bool, index_dtype: str = "auto", kv_dtype: str = "auto", Hq: int = 24) -> QSAConfig:
    return QSAConfig(
        hidden_size=2048, num_heads=Hq, num_kv_heads=2, head_dim=256, index_n_heads=4, index_head_dim=128,
        token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=10_000_000.0,
        mrope_section=(11, 11, 10) if mrope else None, index_dtype=index_dtype, kv_cache_dtype=kv_dtype,
    )


class Scheduler:
    """A tiny engine: pages, ring rows and seq_lens per request; builds step metadata."""

    def __init__(self, cfg: QSAConfig, layout: QSACacheLayout, device: str, seed: int) -> None:
        self.cfg, self.layout, self.device = cfg, layout, device
        self.C = layout.ring_capacity(cfg)
        # Metadata only (the kernels under test are called directly): the reference build.
        self.planner = QSAPlanner(
            cfg, dtype=torch.float32, page_size=layout.page_size, ring_capacity=self.C,
            max_num_tokens=layout.num_slots + 64, max_model_len=layout.num_slots, device=device,
            backend="reference",
        )
        self.free_pages = list(range(layout.num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.free_rings = list(range(layout.ring_rows))[::-1]
        self.reqs: dict[str, dict] = {}

    def rope(self, rid: str, pos: torch.Tensor) -> torch.Tensor:
        """3-axis MRoPE positions that differ from the logical ones, per request."""
        k = sum(map(ord, rid)) % 5
        return torch.stack((pos + 7 + k, (pos * 5 + k) % 11, pos // 3 + 2 * k))

    def step(self, chunks: list[tuple[str, int]], num_pad: int, num_decodes: int):
        """chunks: (request, rows) in batch order (decodes first). Returns meta, rope_positions."""
        ps = self.layout.page_size
        slots, qlens, seqs, rings, tables, ropes = [], [], [], [], [], []
        for rid, n in chunks:
            if rid not in self.reqs:
                self.reqs[rid] = dict(ring=self.free_rings.pop(), pages=[], seq_len=0)
            req = self.reqs[rid]
            pos = torch.arange(req["seq_len"], req["seq_len"] + n)
            while len(req["pages"]) * ps < req["seq_len"] + n:
                req["pages"].append(self.free_pages.pop())
            pages = torch.tensor(req["pages"])
            slots.append(pages[pos // ps] * ps + pos % ps)
            qlens.append(n)
            seqs.append(req["seq_len"] + n)
            rings.append(req["ring"])
            tables.append(req["pages"])
            ropes.append(self.rope(rid, pos) if self.cfg.uses_mrope else pos)
            req["seq_len"] += n
        slots.append(torch.full((num_pad,), -1))
        ropes.append(torch.zeros((3, num_pad) if self.cfg.uses_mrope else (num_pad,), dtype=torch.int64))
        width = max(len(t) for t in tables) + 2
        table = torch.full((len(chunks), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        meta = self.planner.plan(QSAStepInputs(
            query_start_loc=torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(dev),
            seq_lens=torch.tensor(seqs, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            slot_mapping=torch.cat(slots).to(torch.int64).to(dev),
            ring_index=torch.tensor(rings, dtype=torch.int32, device=dev),
            rope_positions=torch.cat(ropes, -1).to(dev) if self.cfg.uses_mrope else None,
            num_decodes=num_decodes,
            decode_query_len=1 + self.layout.num_speculative_tokens,
            max_query_len=max(qlens),
            max_seq_len=max(seqs),
            num_padding_rows=num_pad,
        )).meta
        return meta, meta.rope_positions

    def truncate(self, rid: str, seq_len: int) -> None:
        """Rejected speculative drafts: roll the request back to seq_len."""
        self.reqs[rid]["seq_len"] = seq_len


def interleaved(t: torch.Tensor) -> torch.Tensor:
    """A paged view like t whose pages sit between another layer's (page stride 2x): engines
    pack several layers' pages into one block. The neighbour's rows hold random background."""
    base = torch.randn(t.shape[0], 2, *t.shape[1:], device=t.device)
    base = base.to(t.dtype) if t.dtype.is_floating_point else base.mul(50).to(t.dtype)
    return base[:, 1]


def random_caches(cfg: QSAConfig, layout: QSACacheLayout, dtype: torch.dtype, device: str, fp8_scales: bool):
    """Two identical cache sets filled with random background (so stray writes show); the
    compressed keys, ring and ring positions are interleaved with a neighbour layer's."""
    a = layout.allocate(cfg, dtype, device)[0]
    for name in ("compressed", "ring", "ring_positions"):
        if getattr(a, name) is not None:
            setattr(a, name, interleaved(getattr(a, name)))
    for name in ("k", "v"):
        t = getattr(a, name)
        t.copy_(torch.randn(t.shape, device=device).to(t.dtype))
    b = QSALayerCache(**{
        name: (value._base.clone()[:, 1] if name in ("compressed", "ring", "ring_positions") else value.clone())
        if isinstance(value, torch.Tensor) else value
        for name, value in vars(a).items()
    })
    b.k, b.v = a.k.clone(), a.v.clone()
    if fp8_scales:
        a.k_scale = b.k_scale = 0.75
        a.v_scale = b.v_scale = 1.5
    return a, b


def step_inputs(cfg: QSAConfig, T: int, num_pad: int, dtype: torch.dtype, device: str) -> dict:
    """Projections of one step as the layer slices them; padding rows are NaN."""
    Hi, Di, Hq, Hkv, D = cfg.index_n_heads, cfg.index_head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    index_qk = torch.randn(T, (Hi + 1) * Di, device=device).to(dtype)
    kv = torch.randn(T, 2 * Hkv * D, device=device).to(dtype)
    q_gate = torch.randn(T, Hq * 2 * D, device=device).to(dtype)
    for t in (index_qk, kv, q_gate):
        t[T - num_pad :] = float("nan")
    return dict(
        index_q=index_qk[:, : Hi * Di], raw_keys=index_qk[:, Hi * Di :], q_gate=q_gate,
        k=kv[:, : Hkv * D], v=kv[:, Hkv * D :],
    )


def layer_weights(cfg: QSAConfig, dtype: torch.dtype, device: str) -> dict:
    w = lambda n: (torch.randn(n, device=device) * 0.3).to(dtype)  # noqa: E731
    return dict(
        index_q_norm=w(cfg.index_head_dim), index_k_norm=w(cfg.index_head_dim),
        q_norm=w(cfg.head_dim), k_norm=w(cfg.head_dim), eps=cfg.rms_norm_eps,
        inv_freq=cfg.inv_freq().to(device), rope_axes=cfg.rope_axes().to(device),
    )


def compare_caches(got: QSALayerCache, want: QSALayerCache, cfg: QSAConfig) -> None:
    """All caches, the interleaved neighbour layer's rows included (nothing strays there)."""
    assert torch.equal(got.ring._base, want.ring._base), "ring differs"
    if want.ring_positions is not None:
        assert torch.equal(got.ring_positions._base, want.ring_positions._base), "ring positions differ"
    assert torch.equal(got.compressed._base[:, 0], want.compressed._base[:, 0]), "a neighbour's compressed keys changed"
    assert_close(got.compressed, want.compressed, got.compressed.dtype, "compressed keys")
    assert_close(got.k, want.k, got.k.dtype, "K cache")
    assert_same(got.v, want.v, "V cache")


def run_prepare_step(cfg, sched, caches, weights, chunks, num_pad, num_decodes, dtype, device):
    """One step through reference and kernel; compares outputs and caches."""
    got_cache, want_cache = caches
    meta, rope = sched.step(chunks, num_pad, num_decodes)
    inputs = step_inputs(cfg, meta.num_tokens, num_pad, dtype, device)
    index_dtype = resolve_dtype(cfg.index_dtype, dtype)
    args = [inputs[k] for k in ("index_q", "raw_keys", "q_gate", "k", "v")] + [rope]
    kw = dict(weights, index_dtype=index_dtype, meta=meta)
    want = reference.qsa_prepare(*args, **kw, cache=want_cache)
    got = entry.prepare(*args, **kw, cache=got_cache)
    live = meta.positions >= 0
    assert got[0].dtype == index_dtype and got[0].shape == want[0].shape
    assert_close(got[0][live], want[0][live], index_dtype, "q_idx")
    assert_close(got[1][live], want[1][live], dtype, "q")
    assert got[2].shape == want[2].shape and torch.equal(got[2][live], want[2][live]), "gate"
    compare_caches(got_cache, want_cache, cfg)
    return meta


def run_scenario(cfg, layout, dtype, device, schedule, seed=0):
    """schedule: list of (chunks, num_pad, num_decodes, truncate {rid: seq_len} or None)."""
    torch.manual_seed(seed)
    sched = Scheduler(cfg, layout, device, seed)
    caches = random_caches(cfg, layout, dtype, device, fp8_scales=cfg.kv_cache_dtype != "auto")
    weights = layer_weights(cfg, dtype, device)
    closed = 0
    for chunks, num_pad, num_decodes, truncate in schedule:
        meta = run_prepare_step(cfg, sched, caches, weights, chunks, num_pad, num_decodes, dtype, device)
        closed += int((meta.compressed_slot >= 0).sum())
        for rid, n in (truncate or {}).items():
            sched.truncate(rid, n)
    assert closed > 0, "the scenario closed no group"


def chunked_schedule(spec: int) -> list:
    """Prefills whose chunks end inside groups and exceed the ring, then decodes.

    With spec > 0 the decodes carry drafts and some are rejected (seq_len rolled back).
    """
    dq = 1 + spec
    steps = [
        ([("a", 6), ("b", 13)], 3, 0, None),  # both end inside a group
        ([("a", dq), ("b", 11), ("c", 3)], 2, 1, None),  # b: chunk > C, first group from the ring
    ]
    if spec:
        return steps + [
            ([("a", dq), ("b", dq), ("c", dq)], 1, 3, {"a": 6 + 2 * dq - 1, "c": 3 + dq - 2}),
            ([("a", dq), ("b", dq), ("c", dq)], 0, 3, {"b": 24 + 2 * dq - 3}),
            ([("a", dq), ("b", dq), ("c", dq)], 2, 3, None),
        ]
    return steps + [([("a", 1), ("b", 1), ("c", 1)], i % 2, 3, None) for i in range(3)]


def test_ring_store_fuses_only_where_the_step_reads_no_slot_it_writes():
    """Prepare stores ring rows in its first launch only if no request's compression reads a
    ring slot (positions s-(r-1)..s-1, from earlier steps) that its rows (the last C of the
    step, positions < s + n) write: true for every n <= C - r + 1 at every ratio, and the
    bound is tight."""

    def meet(s: int, n: int, C: int, r: int) -> bool:
        reads = {(s - j) % C for j in range(1, r) if s - j >= 0}
        writes = {p % C for p in range(max(s, s + n - C), s + n)}
        return bool(reads & writes)

    for r in (2, 4, 5, 8):
        for C in (ring_capacity(r, spec) for spec in (0, 1, 3, 7)):
            for n in range(1, 2 * C + 2):
                if ring_store_fuses(n, C, r):
                    assert not any(meet(s, n, C, r) for s in range(3 * C)), (r, C, n)
            fused = max(n for n in range(1, 2 * C + 2) if ring_store_fuses(n, C, r))
            assert any(meet(s, fused + 1, C, r) for s in range(3 * C)), (r, C)  # one row more and they meet
    assert ring_store_fuses(1, 4, 4) and ring_store_fuses(4, 8, 4)  # decode, 3-draft MTP
    assert ring_store_fuses(8, 16, 8) and not ring_store_fuses(5, 8, 8)  # 7-draft; r 8 chunk


CASES = [
    # (mrope, model dtype, index dtype, kv dtype, spec)
    (False, torch.bfloat16, "auto", "auto", 3),
    (True, torch.bfloat16, "fp8_e4m3", "fp8_e4m3", 3),
    (True, torch.float32, "auto", "fp8_e5m2", 0),
]


@interp
@pytest.mark.parametrize("mrope,dtype,index_dtype,kv_dtype,spec", CASES)
def test_prepare_scenario(mrope, dtype, index_dtype, kv_dtype, spec):
    cfg = small_config(mrope, index_dtype, kv_dtype)
    layout = QSACacheLayout(num_layers=1, page_size=8, num_pages=24, ring_rows=5, num_speculative_tokens=spec)
    run_scenario(cfg, layout, dtype, "cpu", chunked_schedule(spec))


@interp
@pytest.mark.parametrize("ring_positions", [True, False])
def test_prepare_one_d_rope_differs_from_logical(ring_positions):
    """1-D model, RoPE positions != logical: queries and group keys use the RoPE positions;
    the second step closes a group whose first token the first step wrote (its position comes
    from cache.ring_positions, or without them from the closing row's position - (r - 1))."""
    cfg = small_config(False)
    layout = QSACacheLayout(num_layers=1, page_size=8, num_pages=8, ring_rows=2)
    torch.manual_seed(1)
    sched = Scheduler(cfg, layout, "cpu", 1)
    got_cache, want_cache = random_caches(cfg, layout, torch.bfloat16, "cpu", fp8_scales=False)
    if not ring_positions:
        got_cache.ring_positions = want_cache.ring_positions = None
    weights = layer_weights(cfg, torch.bfloat16, "cpu")
    for n in (11, 7):
        meta, _ = sched.step([("a", n)], 1, 0)
        rope = meta.positions * 3 + 5
        inputs = step_inputs(cfg, meta.num_tokens, 1, torch.bfloat16, "cpu")
        args = [inputs[k] for k in ("index_q", "raw_keys", "q_gate", "k", "v")] + [rope]
        kw = dict(weights, index_dtype=torch.bfloat16, meta=meta)
        want = reference.qsa_prepare(*args, **kw, cache=want_cache)
        got = entry.prepare(*args, **kw, cache=got_cache)
        live = meta.positions >= 0
        assert_close(got[0][live], want[0][live], torch.bfloat16, "q_idx")
        compare_caches(got_cache, want_cache, cfg)


@interp
@pytest.mark.parametrize("mrope", [False, True])
def test_prepare_compresses_groups_that_complete_from_the_ring(mrope):
    """Fused prepare over steps whose first group completes from the ring (the earlier step's
    raw keys), fp8 index keys: the compressed keys, ring and K/V match the reference."""
    cfg = small_config(mrope, "fp8_e4m3")
    layout = QSACacheLayout(num_layers=1, page_size=8, num_pages=12, ring_rows=3)
    torch.manual_seed(2)
    sched = Scheduler(cfg, layout, "cpu", 2)
    caches = random_caches(cfg, layout, torch.bfloat16, "cpu", fp8_scales=False)
    weights = layer_weights(cfg, torch.bfloat16, "cpu")
    closed_from_ring = 0
    for chunks, pad in (([("a", 7), ("b", 2)], 2), ([("b", 13), ("a", 10)], 1)):
        meta = run_prepare_step(cfg, sched, caches, weights, chunks, pad, 0, torch.bfloat16, "cpu")
        live = meta.positions >= 0
        start = meta.positions[meta.query_start_loc[meta.token_to_req.long()].long()]  # each row's chunk start
        from_ring = (meta.compressed_slot >= 0) & (meta.positions - (cfg.compress_ratio - 1) < start)
        closed_from_ring += int((from_ring & live).sum())
    assert closed_from_ring > 0, "no group completed from the ring"


def _out_of_range_slots(meta, num_slots: int, ring_rows: int, compressed_rows: int) -> None:
    """Point some live rows' writes outside their caches (past the end, or negative other than
    -1), in the planned metadata's own buffers: every store must skip them."""
    for slots, n in ((meta.slot_mapping, num_slots), (meta.ring_slot, ring_rows), (meta.compressed_slot,
                                                                                    compressed_rows)):
        live = (slots >= 0).nonzero().flatten()
        assert live.numel() >= 3
        slots[live[0]], slots[live[1]], slots[live[2]] = n, n + 7, -5


@interp
@pytest.mark.parametrize("mrope,dtype,index_dtype,kv_dtype,spec", CASES)
def test_prepare_skips_slots_outside_the_caches(mrope, dtype, index_dtype, kv_dtype, spec):
    """K/V, ring (+ MRoPE positions) and compressed-key slots past the caches' ends or below
    -1 write nothing (every cache and its interleaved neighbour compared), in each cache dtype
    (bf16, fp8 with scales, fp32 / fp8_e5m2, int64 positions)."""
    cfg = small_config(mrope, index_dtype, kv_dtype)
    layout = QSACacheLayout(num_layers=1, page_size=8, num_pages=6, ring_rows=3, num_speculative_tokens=spec)
    torch.manual_seed(3)
    sched = Scheduler(cfg, layout, "cpu", 3)
    got_cache, want_cache = random_caches(cfg, layout, dtype, "cpu", fp8_scales=kv_dtype != "auto")
    weights = layer_weights(cfg, dtype, "cpu")
    meta, rope = sched.step([("a", 9), ("b", 6)], 2, 0)
    C = layout.ring_capacity(cfg)
    _out_of_range_slots(meta, layout.num_slots, layout.ring_rows * C, layout.num_slots // cfg.compress_ratio)
    inputs = step_inputs(cfg, meta.num_tokens, 2, dtype, "cpu")
    args = [inputs[k] for k in ("index_q", "raw_keys", "q_gate", "k", "v")] + [rope]
    kw = dict(weights, index_dtype=resolve_dtype(cfg.index_dtype, dtype), meta=meta)
    reference.qsa_prepare(*args, **kw, cache=want_cache)
    entry.prepare(*args, **kw, cache=got_cache)
    compare_caches(got_cache, want_cache, cfg)


@interp
def test_prepare_empty_step():
    cfg = small_config(False)
    layout = QSACacheLayout(num_layers=1, page_size=8, num_pages=4, ring_rows=2)
    sched = Scheduler(cfg, layout, "cpu", 0)
    got_cache, want_cache = random_caches(cfg, layout, torch.bfloat16, "cpu", fp8_scales=False)
    meta = sched.planner.plan(QSAStepInputs(
        query_start_loc=torch.zeros(1, dtype=torch.int32), seq_lens=torch.zeros(0, dtype=torch.int32),
        block_table=torch.zeros(0, 1, dtype=torch.int32), slot_mapping=torch.full((3,), -1),
        ring_index=torch.zeros(0, dtype=torch.int32), num_decodes=0, max_query_len=0, max_seq_len=0,
        num_padding_rows=3,
    )).meta
    inputs = step_inputs(cfg, 3, 3, torch.bfloat16, "cpu")
    args = [inputs[k] for k in ("index_q", "raw_keys", "q_gate", "k", "v")] + [meta.rope_positions]
    got = entry.prepare(*args, **layer_weights(cfg, torch.bfloat16, "cpu"), index_dtype=torch.bfloat16,
                              cache=got_cache, meta=meta)
    assert got[0].shape == (3, cfg.index_n_heads, cfg.index_head_dim)
    compare_caches(got_cache, want_cache, cfg)


# ----------------------------------------------------------------------------- GPU


def production_schedule(spec: int) -> list:
    """Decodes of long-running requests next to chunked prefills longer than the ring."""
    dq = 1 + spec
    return [
        ([("a", 1021), ("b", 2050), ("c", 7)], 16, 0, None),
        ([("a", dq), ("b", 3001), ("c", 514)], 8, 1, None),
        ([("a", dq), ("b", dq), ("c", dq)], 13, 3, {"b": 5051 + dq - 2} if spec else None),
        ([("a", dq), ("b", dq), ("c", dq), ("d", 4095)], 1, 3, None),
    ] + [([("a", dq), ("b", dq), ("c", dq), ("d", dq)], 4, 4, None) for _ in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mrope,index_dtype,kv_dtype,spec,Hq",
    [(False, "auto", "auto", 0, 24), (True, "fp8_e4m3", "fp8_e4m3", 3, 24), (False, "fp8_e4m3", "auto", 0, 16)],
)
def test_prepare_production_gpu(mrope, index_dtype, kv_dtype, spec, Hq):
    """Production shapes; steps of every size share one compiled variant of each kernel (the
    prepare kernel: one per ring mode, fused into it for decode steps or a launch of its own)."""
    cfg = production_config(mrope, index_dtype, kv_dtype, Hq)
    layout = QSACacheLayout(num_layers=1, page_size=64, num_pages=400, ring_rows=8, num_speculative_tokens=spec)
    from qsa_kernels import prepare as kernels

    before = {k: compiled_variants(k) for k in (kernels._prepare_kernel, kernels._ring_store_kernel)}
    run_scenario(cfg, layout, torch.bfloat16, "cuda", production_schedule(spec))
    for kernel, n in before.items():
        assert compiled_variants(kernel) <= n + (2 if kernel is kernels._prepare_kernel else 1), kernel


def compiled_variants(kernel) -> int:
    """Number of compiled specializations of a Triton kernel (all devices)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())
