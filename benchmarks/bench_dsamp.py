"""Decode selection of long rows from per-row samples (issue 12 item 1, `QSA_DECODE_SAMPLES`)
against main's routes: bit-exact first, then timed (CUDA-graph replays, L2 flushed before each).

    python benchmarks/bench_dsamp.py [--shapes 128k-b4,...] [--variants seg4k,...]
    TRITON_INTERPRET=1 python benchmarks/bench_dsamp.py --dry --shapes tiny   # CPU: checks only

Per shape two planners over the same caches and queries: "main" (QSA_DECODE_SAMPLES=0 when it
is made: the radix passes or `select_topk`'s segments, as `plan_select` routes them today) and
"dsamp" (=1: the decode score launch also writes per-row samples, one `select_prefill` top-k
launch resolves exactly from them). "select" = `qsa_select` of the step (score + top-k writing
the packed rows), as a served layer launches it. Before timing, dsamp's rows must equal main's
bit for bit on random queries and on integer-valued queries and keys (crowds of ties, ReLU
zeros). Mixed shapes: one request at the plan's context and three shorter (a short row in a long
plan). Variants: dsamp with `decode_tiles` overrides (timed after the table, if asked).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qsa import GEOM, GraphTimer, qsa_config  # noqa: E402

from qsa_core import QSALayerCache, QSAPlanner, QSAStepInputs, qsa_select, ring_capacity  # noqa: E402
from qsa_kernels import select as sel  # noqa: E402
from qsa_kernels import select_prefill as sp  # noqa: E402
from qsa_kernels import select_score as ss  # noqa: E402

K, M = 1 << 10, 1 << 20
# name: (seq_lens of the requests, decode rows per request)
SHAPES = {
    "128k-b4": ([128 * K] * 4, 1),
    "1m-b4": ([M] * 4, 1),
    "1m-b4x4": ([M] * 4, 4),
    "128k-b64": ([128 * K] * 64, 1),
    "1m+3x256k": ([M] + [256 * K] * 3, 1),
    "1m+3x64k": ([M] + [64 * K] * 3, 1),
    "128k+3x16k": ([128 * K] + [16 * K] * 3, 1),
    # more rows than the route's chunk cap (--max-rows raises it)
    "128k-b128": ([128 * K] * 128, 1),
    "128k-b256": ([128 * K] * 256, 1),
    "32k-b256": ([32 * K] * 256, 1),
    "64k-b128": ([64 * K] * 128, 1),
    "128k-b16x4": ([128 * K] * 16, 4),
    # chunks of 16-64 rows, where main takes the segment route
    "32k-b16": ([32 * K] * 16, 1), "32k-b64": ([32 * K] * 64, 1), "64k-b32": ([64 * K] * 32, 1),
    "128k-b16": ([128 * K] * 16, 1), "128k-b32": ([128 * K] * 32, 1), "256k-b16": ([256 * K] * 16, 1),
    "256k-b64": ([256 * K] * 64, 1), "512k-b16": ([512 * K] * 16, 1), "1m-b16": ([M] * 16, 1),
    "tiny": ([6000, 2100, 100], 2),  # --dry
}
VARIANTS = {"skip": dict(skip=1), "skip4k": dict(skip=1, seg=4096), "seg4k": dict(seg=4096), "seg16k": dict(seg=16384), "w16": dict(warps=16), "w4": dict(warps=4),
            "cap2k": dict(cap=2048), "lb31": dict(lbits=31),
            # the bracket search (2^sbits counts a step until isolated) for the bound (bound 2) and/or the resolve
            "br3": dict(bound=2, sbits=3), "rs3": dict(rsbits=3), "fast": dict(bound=2, sbits=3, rsbits=3),
            "fast2": dict(bound=2, sbits=2, rsbits=2), "fast-skip": dict(bound=2, sbits=3, rsbits=3, skip=1),
            "fast-seg4k": dict(bound=2, sbits=3, rsbits=3, seg=4096),
            "fast-seg2k": dict(bound=2, sbits=3, rsbits=3, seg=2048),
            "fast-skip4k": dict(bound=2, sbits=3, rsbits=3, skip=1, seg=4096),
            "fast-w4": dict(bound=2, sbits=3, rsbits=3, warps=4),
            # the row's bound searched once, in a bound launch per chunk (bound 3), with narrower segments
            "b3": dict(bound=3), "b3-seg4k": dict(bound=3, seg=4096), "b3-seg2k": dict(bound=3, seg=2048),
            # 2^row_s samples per row (the least with >= 4 Kb is the default: 2^11 at Kb 512)
            "rs12": dict(row_s=12), "rs13": dict(row_s=13), "rs12-seg16k": dict(row_s=12, seg=16384),
            "rs12-cap512": dict(row_s=12, cap=512),
            # the candidate kernel's registers capped (4 / 3 / 2 programs of 8 warps an SM)
            "r64": dict(regs=64), "r80": dict(regs=80), "r96": dict(regs=96),
            "sb4": dict(sbits=4, rsbits=4), "b3-w4": dict(bound=3, warps=4),
            "b3-seg4k-w4": dict(bound=3, seg=4096, warps=4),
            # one compaction step where 1M rows' slowest segment takes two (2048-column steps; a 1M row's
            # ~512 live runs of 128 columns over 32 segments: the fullest holds ~23)
            "blk4k": dict(block=4096), "blk4k-w16": dict(block=4096, warps=16),
            "again": {}}  # the default tiles timed a second time (the shape's noise)
TILES = sp.decode_tiles


class MixedStep:
    """One decode step of requests at seq_lens (rows decode rows each) over shared random
    caches: `plans[route]` from a planner made with QSA_DECODE_SAMPLES = route ("0" / "1")."""

    def __init__(self, seq_lens: list[int], rows: int, dev: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        cfg = self.cfg = qsa_config("bf16")
        P, B = GEOM.page_size, len(seq_lens)
        self.max_len = max(seq_lens)
        per_req = math.ceil(self.max_len / P)
        pages = per_req * B + 1
        C = self.C = ring_capacity(cfg.compress_ratio, rows - 1)
        self.T, self.rows, self.dev = B * rows, rows, dev
        Hkv, D, Di = cfg.num_kv_heads, cfg.head_dim, cfg.index_head_dim
        self.cache = QSALayerCache(
            k=torch.empty(pages, P, Hkv, D, device=dev, dtype=torch.bfloat16),
            v=torch.empty(pages, P, Hkv, D, device=dev, dtype=torch.bfloat16),
            compressed=torch.randn(pages, P // cfg.compress_ratio, Di, device=dev, dtype=torch.bfloat16),
            ring=torch.zeros(B, C, Di, device=dev, dtype=torch.bfloat16), ring_positions=None)
        perm = torch.randperm(pages - 1, device=dev).to(torch.int32) + 1
        table = perm[: per_req * B].view(B, per_req)
        slots = torch.cat([table[i].long()[(p := torch.arange(s - rows, s, device=dev)) // P] * P + p % P
                           for i, s in enumerate(seq_lens)])
        self.inputs = QSAStepInputs(
            query_start_loc=torch.arange(0, self.T + 1, rows, device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, device=dev, dtype=torch.int32), block_table=table, slot_mapping=slots,
            ring_index=torch.arange(B, device=dev, dtype=torch.int32), num_decodes=B, decode_query_len=rows,
            max_query_len=rows, max_seq_len=self.max_len)
        self.q_idx = torch.randn(self.T, cfg.index_n_heads, Di, device=dev, dtype=torch.bfloat16)
        self.plans: dict[str, object] = {}
        self.out = torch.empty(self.T, cfg.packed_width, dtype=torch.int32, device=dev)

    def plan(self, route: str):
        os.environ["QSA_DECODE_SAMPLES"] = route
        planner = QSAPlanner(self.cfg, dtype=torch.bfloat16, page_size=GEOM.page_size, ring_capacity=self.C,
                             max_num_tokens=self.T, max_model_len=self.max_len, device=self.dev, backend="triton")
        plan = planner.plan(self.inputs)
        taken = plan.schedule.select_decode.decode_samples is not None
        if taken != (route == "1"):
            raise RuntimeError(f"route {route}: the per-row-samples route {'not ' if not taken else ''}taken")
        self.plans[route] = (planner, plan)  # (the planner owns the plan's workspace)
        return plan

    def select(self, route: str):
        plan = self.plans[route][1]
        return lambda: qsa_select(plan, self.q_idx, self.cache, out=self.out)

    def tie_data(self) -> None:
        """Integer-valued queries and keys: crowds of equal scores, many ReLU zeros."""
        g = torch.Generator(device=self.dev).manual_seed(1)
        comp = self.cache.compressed
        comp.copy_(torch.randint(-2, 3, comp.shape, generator=g, device=self.dev).to(comp.dtype))
        self.q_idx.copy_(torch.randint(-2, 3, self.q_idx.shape, generator=g, device=self.dev).to(self.q_idx.dtype))


def route_of(step: MixedStep, route: str) -> str:
    s = step.plans[route][1].schedule.select_decode
    if s.decode_samples is not None:
        t = s.decode_samples_tiles
        return f"dsamp(seg {t['seg']}, 2^{t['row_s']} samples, cap {t['cap']}, w{t['warps']})"
    return "topk-seg" if s.topk is not None else "radix"


def run_shape(key: str, variants: list[str], timer, stamp, dev) -> dict:
    seq_lens, rows = SHAPES[key]
    step = MixedStep(seq_lens, rows, dev)
    sp.decode_tiles = TILES
    for route in ("0", "1"):
        step.plan(route)
    res = dict(shape=key, main_route=route_of(step, "0"))
    outs = {}
    for data in ("random", "ties"):
        if data == "ties":
            step.tie_data()
        for route in ("0", "1"):
            fn = step.select(route)
            fn()
            fn()  # twice: arrival counters and scratch reused
            outs[data, route] = step.out.clone()
    same = {d: torch.equal(outs[d, "0"], outs[d, "1"]) for d in ("random", "ties")}
    res["exact"] = all(same.values())
    print(f"{stamp()} {key:11s} main={res['main_route']} new={route_of(step, '1')} bits "
          + " ".join(f"{d} {'equal' if ok else 'DIFFER'}" for d, ok in same.items()), flush=True)
    if not res["exact"]:
        bad = (outs["random", "0"] != outs["random", "1"]).any(1).nonzero().flatten().tolist()
        print(f"{stamp()} {key:11s} differing rows (random): {bad[:16]}", flush=True)
        return res
    torch.manual_seed(0)
    step.q_idx.copy_(torch.randn_like(step.q_idx))  # timing on random data (ties are a check only)
    step.cache.compressed.copy_(torch.randn_like(step.cache.compressed))
    res["main"] = timer(step.select("0"))
    res["dsamp"] = timer(step.select("1"))
    print(f"{stamp()} {key:11s} select us: main {res['main']:7.1f}  dsamp {res['dsamp']:7.1f}", flush=True)
    for v in variants:
        sp.decode_tiles = lambda *a, _v=VARIANTS[v], **k: {**TILES(*a, **k), **_v}
        try:
            step.plan("1")
            fn = step.select("1")
            fn()
            step_ok = _check_variant(step, outs)
            res[v] = timer(fn) if step_ok else float("nan")
            print(f"{stamp()} {key:11s} variant {v:7s} {res[v]:7.1f}" + ("" if step_ok else " DIFFERS"), flush=True)
        except Exception as exc:  # keep the other variants' figures
            print(f"{stamp()} {key:11s} variant {v} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        sp.decode_tiles = TILES
    del step
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    return res


def _check_variant(step: MixedStep, outs: dict) -> bool:
    """A variant's rows equal main's on the random data (timed data differ: recomputed here)."""
    fn0, fn1 = step.select("0"), step.select("1")
    fn0()
    want = step.out.clone()
    fn1()
    return torch.equal(step.out, want)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="128k-b4,1m-b4,1m-b4x4,1m+3x256k,1m+3x64k,128k+3x16k,128k-b64")
    ap.add_argument("--variants", default="")
    ap.add_argument("--dry", action="store_true", help="CPU, TRITON_INTERPRET=1: checks only, no timing")
    ap.add_argument("--max-rows", type=int, default=0, help="the route's chunk cap (select._DECODE_SAMPLES_MAX_ROWS)")
    ap.add_argument("--mtp-score", default="", help="MTP rows' score tiles: a sweep_decode_scores.PACKED name")
    args = ap.parse_args(argv)
    if args.max_rows:
        sel._DECODE_SAMPLES_MAX_ROWS = args.max_rows
    if args.mtp_score:
        from sweep_decode_scores import PACKED
        fields = PACKED[args.mtp_score]
        default = ss.score_tiles
        ss.score_tiles = lambda decode, tiles, interpret, *a, **k: (
            ss.ScoreTiles(**fields) if decode and tiles.get("rows_per_request", 1) > 1 and not interpret
            else default(decode, tiles, interpret, *a, **k))
    t0 = time.time()
    stamp = lambda: f"[{time.time() - t0:6.1f}s]"  # noqa: E731
    dev = torch.device("cpu" if args.dry else "cuda")
    timer = (lambda fn: (fn(), float("nan"))[1]) if args.dry else GraphTimer(flush_l2=True, reps=15, budget_ms=200)
    print("us, CUDA-graph median, L2 flushed: select = score + top-k writing packed rows (qsa_select)", flush=True)
    rows = []
    for key in args.shapes.split(","):
        try:
            rows.append(run_shape(key, [v for v in args.variants.split(",") if v], timer, stamp, dev))
        except Exception as exc:
            print(f"{stamp()} {key} failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    print("\nshape        main route  exact   main us  dsamp us   ratio")
    for r in rows:
        m, d = r.get("main", float("nan")), r.get("dsamp", float("nan"))
        print(f"{r['shape']:12s} {r['main_route']:10s}  {'yes' if r['exact'] else 'NO':5s} {m:9.1f} {d:9.1f} "
              f"{d / m if m == m and m else float('nan'):7.3f}")
    print(f"{stamp()} done", flush=True)


if __name__ == "__main__":
    main()
