"""The selection's score launches alone on the GPU: this tree's kernels over a sweep of tiles
against a baseline `select_score.py` (main's), on the production geometry (Hi 4, Di 128, r 4,
page 64, Kb 512; shuffled pages, random data).

Per case, every variant is first checked against the baseline on the GPU (same scratch cells
written, the rest left NaN; bits equal or within 1e-5 relative), then timed as the median of
CUDA-graph replays with L2 flushed before each (bench_qsa.GraphTimer). A case times all of a
select call's score launches: one per row chunk of `plan_select`'s schedule (its 64 MiB
scratch cap), without the top-k. Kernels are compiled first, in parallel processes.

    python benchmarks/bench_score.py --baseline main_select_score.py [--out FILE.json] [--big]
    TRITON_INTERPRET=1 python benchmarks/bench_score.py --baseline ... --dry   # CPU: tiny cases, no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qsa_kernels import select as sel  # noqa: E402
from qsa_kernels import select_score as ss  # noqa: E402
from qsa_kernels.select_score import ScoreTiles  # noqa: E402

R, PAGE, HI, DI, KB = 4, 64, 4, 128, 512
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}

# Variants: name -> (tiles or None: the baseline's ScoreLaunch, score scratch cap in bytes or
# None: select.py's). Spans are runtime arguments: variants differing in span share a compile.
CAP = 256 << 20
DECODE = {
    "main": (None, None),
    "new g128 s3 sp256": (ScoreTiles(1, 128, 256, 3, 4), None),
    "new g128 s3 auto": (ScoreTiles(1, 128, 0, 3, 4), None),
    "new g64 s4 sp256": (ScoreTiles(1, 64, 256, 4, 4), None),
    "new g256 s3 sp512 w8": (ScoreTiles(1, 256, 512, 3, 8), None),
    "rows4 g128 s3 auto": (ScoreTiles(4, 128, 0, 3, 4, True), None),
    "rows4 g128 s3 sp256": (ScoreTiles(4, 128, 256, 3, 4, True), None),
    "rows4 g128 s3 sp1K": (ScoreTiles(4, 128, 1024, 3, 4, True), None),
    "rows4 g64 s4 auto": (ScoreTiles(4, 64, 0, 4, 4, True), None),
    "rows4 g256 s3 auto w8": (ScoreTiles(4, 256, 0, 3, 8, True), None),
}
PREFILL = {
    "main": (None, None),
    "new r64 g128 s3 w8": (ScoreTiles(64, 128, 0, 3, 8), None),
    "pk r64 g64 s3 w8": (ScoreTiles(64, 64, 0, 3, 8, True), None),
    "pk r64 g64 s3 w8 fdiv": (ScoreTiles(64, 64, 0, 3, 8, True, True), None),
    "pk r64 g64 s3 w8 sp512": (ScoreTiles(64, 64, 512, 3, 8, True), None),
    "pk r64 g64 s3 w8 sp2K": (ScoreTiles(64, 64, 2048, 3, 8, True), None),
    "pk r32 g64 s4 w4": (ScoreTiles(32, 64, 0, 4, 4, True), None),
    "pk r32 g64 s4 w4 fdiv": (ScoreTiles(32, 64, 0, 4, 4, True, True), None),
    "pk r64 g128 s2 w8": (ScoreTiles(64, 128, 0, 2, 8, True), None),
    "km r32 g64 s3 w4": (ScoreTiles(32, 64, 0, 3, 4, True, False, True), None),
    "km r32 g64 s3 w4 fdiv": (ScoreTiles(32, 64, 0, 3, 4, True, True, True), None),
    "km r32 g64 s3 w4 sp2K": (ScoreTiles(32, 64, 2048, 3, 4, True, False, True), None),
    "km r32 g128 s3 w8": (ScoreTiles(32, 128, 0, 3, 8, True, False, True), None),
    "km r32 g128 s3 w8 fdiv": (ScoreTiles(32, 128, 0, 3, 8, True, True, True), None),
    "km r32 g128 s3 w8 sp512": (ScoreTiles(32, 128, 512, 3, 8, True, False, True), None),
    "km r32 g128 s3 w8 sp2K": (ScoreTiles(32, 128, 2048, 3, 8, True, False, True), None),
    "km r32 g128 s3 w4 fdiv": (ScoreTiles(32, 128, 0, 3, 4, True, True, True), None),
    "main cap256M": (None, CAP),
    "km r32 g128 s3 w8 cap256M": (ScoreTiles(32, 128, 0, 3, 8, True, False, True), CAP),
}


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "prefill"
    context: int
    batch: int
    rows: int  # query rows per request (the last `rows` positions)
    dtype: str = "bf16"  # q and keys

    @property
    def name(self) -> str:
        ctx = f"{self.context >> 20}M" if self.context >= 1 << 20 else f"{self.context >> 10}K"
        return f"{self.kind} {ctx} B{self.batch}x{self.rows} {self.dtype}"


def cases(big: bool, dry: bool) -> list[Case]:
    if dry:
        return [Case("decode", 4096, 2, 2), Case("decode", 4096, 2, 1, "fp8"), Case("prefill", 4096, 1, 200)]
    M = 1 << 20
    out = [Case("decode", 131072, 4, 1), Case("decode", 131072, 4, 1, "fp8"), Case("decode", 131072, 64, 1),
           Case("decode", 131072, 64, 1, "fp8"), Case("decode", M, 4, 1), Case("decode", M, 4, 1, "fp8"),
           Case("decode", M, 4, 4), Case("prefill", 16384, 1, 16384), Case("prefill", 131072, 1, 16384)]
    return out + ([Case("prefill", M, 1, 16384)] if big else [])


def problem(c: Case, seed: int = 0):
    """q [T, Hi, Di], compressed [pages, PAGE / R, Di], block_table int32, token_to_req, visible."""
    dev, dt = torch.device(DEV), DTYPES[c.dtype]
    g = torch.Generator(device=dev).manual_seed(seed)
    per_req = c.context // PAGE
    table = torch.randperm(c.batch * per_req, generator=g, device=dev).view(c.batch, per_req).int()
    comp = torch.randn(c.batch * per_req, PAGE // R, DI, generator=g, device=dev).to(dt)
    pos = torch.arange(c.context - c.rows, c.context, device=dev).repeat(c.batch)
    to_req = torch.arange(c.batch, device=dev).repeat_interleave(c.rows).int()
    vis = torch.clamp(torch.minimum((pos + 1) // R, torch.tensor(c.context // R, device=dev)), min=0).int()
    q = torch.randn(c.batch * c.rows, HI, DI, generator=g, device=dev).to(dt)
    return q, comp, table, to_req, vis


class Scores:
    """All score launches of one select call (one per row chunk), on a NaN-filled scratch."""

    def __init__(self, module, c: Case, data, tiles: ScoreTiles | None, cap: int | None = None) -> None:
        q, comp, table, to_req, vis = data
        decode = c.kind == "decode"
        keep = sel.SCORE_SCRATCH_BYTES
        sel.SCORE_SCRATCH_BYTES = cap or keep
        try:
            self.s = sel.plan_select(q.shape[0], c.context // R, KB, decode=decode, device=DEV)
        finally:
            sel.SCORE_SCRATCH_BYTES = keep
        self.s.scores.fill_(float("nan"))
        self.q, self.table = q, table
        extra = {} if tiles is None else {"score": tiles}
        self.launches = []
        for row0 in range(0, q.shape[0], self.s.chunk):
            n = min(self.s.chunk, q.shape[0] - row0)
            self.launches.append((row0, module.ScoreLaunch(
                q, comp, table, to_req, vis, self.s.scores, row0=row0, rows=n, num_cols=self.s.num_cols,
                page_size=PAGE, compress_ratio=R, block_topk=KB, decode=decode, tiles=self.s.tiles,
                interpret=self.s.interpret, **extra)))

    def __call__(self) -> None:
        for row0, launch in self.launches:
            launch(self.q, self.table, row0)



def check(ref: Scores, run: Scores, max_chunks: int = 24) -> tuple[bool, float, float]:
    """Run both chunk by chunk (at most max_chunks of them, spread over the call) and compare
    the scratch after each: (same cells written, fraction bit-equal, max relative difference)."""
    n = len(ref.launches)
    ref.s.scores.fill_(float("nan"))
    run.s.scores.fill_(float("nan"))
    picked = sorted({i * (n - 1) // max(1, max_chunks - 1) for i in range(min(n, max_chunks))})
    same, eq, rel = True, 1.0, 0.0
    for i in picked:
        (row0, a), (_, b) = ref.launches[i], run.launches[i]
        a(ref.q, ref.table, row0)
        b(run.q, run.table, row0)
        s, e, r = compare(ref.s.scores, run.s.scores)
        same, eq, rel = same and s, min(eq, e), max(rel, r)
    return same, eq, rel


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("qsa_kernels._score_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "qsa_kernels"
    spec.loader.exec_module(mod)
    return mod


def _warm(args) -> str:
    """Compile one variant (a worker process): bind it on a small case of the same dtypes."""
    baseline, kind, dtype, name = args
    tiles = (DECODE if kind == "decode" else PREFILL)[name][0]
    mod = load_module(baseline) if tiles is None else ss
    c = Case(kind, 8192, 2, 1 if kind == "decode" else 256, dtype)
    try:
        Scores(mod, c, problem(c), tiles)()
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # a variant that does not compile (resources) is reported, not fatal
        return f"{kind} {dtype} {name}: {type(exc).__name__}: {str(exc)[:200]}"


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[bool, float, float]:
    """(same cells written, fraction of written cells bit-equal, max |a - b| / (1e-5 + 1e-5 |a|):
    <= 1 is the select tests' tolerance)."""
    wr, wg = ~ref.isnan(), ~got.isnan()
    same = bool(torch.equal(wr, wg))
    a, b = ref[wr & wg], got[wr & wg]
    if a.numel() == 0:
        return same, 1.0, 0.0
    eq = (a.view(torch.int32) == b.view(torch.int32)).float().mean().item()
    rel = ((a - b).abs() / (1e-5 + 1e-5 * a.abs())).max().item()
    return same, eq, rel


def measures(c: Case, data) -> tuple[float, float]:
    """(FLOP, bytes) of the scores: keys read once per request, scores written once."""
    q, comp, _, to_req, vis = data
    v = torch.where(vis > KB, vis, 0).double()
    flop = float(v.sum()) * HI * DI * 2
    key_groups = float(torch.zeros(c.batch, dtype=torch.float64, device=DEV).scatter_reduce(
        0, to_req.long(), v, "amax").sum())
    return flop, key_groups * DI * comp.element_size() + float(v.sum()) * 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="main's select_score.py")
    ap.add_argument("--out", default=None)
    ap.add_argument("--big", action="store_true", help="also prefill 16K rows at 1M")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--dry", action="store_true", help="CPU interpreter: tiny cases, checks only")
    a = ap.parse_args()
    t0 = time.time()
    if a.dry:
        timer = lambda fn: (fn(), float("nan"))[1]  # noqa: E731
    else:
        from bench_qsa import GraphTimer

        jobs = {(c.kind, c.dtype) for c in cases(a.big, a.dry)}
        work = []
        for k, d in sorted(jobs):
            by_compile = {}  # one name per compiled kernel (tiles without the span)
            for n, (t, _) in (DECODE if k == "decode" else PREFILL).items():
                by_compile.setdefault(None if t is None else dataclasses.replace(t, span=0), n)
            work += [(a.baseline, k, d, n) for n in by_compile.values()]
        with ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn")) as pool:
            errors = [e for e in pool.map(_warm, work) if e]
        print(f"compiled {len(work)} variants in {time.time() - t0:.0f} s; failed: {errors or 'none'}", flush=True)
        timer = GraphTimer(reps=15, budget_ms=400)
    base = load_module(a.baseline)
    results, failed = [], []
    for c in cases(a.big, a.dry):
        data = problem(c)
        flop, nbytes = measures(c, data)
        refs = {}  # scratch cap -> the baseline's launches
        for name, (tiles, cap) in (DECODE if c.kind == "decode" else PREFILL).items():
            if cap not in refs:
                refs[cap] = Scores(base, c, data, None, cap)
            ref = refs[cap]
            try:
                run = ref if tiles is None else Scores(ss, c, data, tiles, cap)
                same, eq, rel = (True, 1.0, 0.0) if tiles is None else check(ref, run)
                ok = same and rel <= 1.0
                us = timer(run) if ok else float("nan")
            except Exception as exc:  # e.g. OutOfResources at the first launch
                print(f"{c.name:24s} {name:22s} skipped: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            if not ok:
                failed.append(f"{c.name} {name}")
            r = dict(case=c.name, variant=name, us=us, tflops=flop / us / 1e6, gbs=nbytes / us / 1e3,
                     chunks=len(run.launches), same_cells=same, bit_equal=eq, max_rel=rel)
            results.append(r)
            print(f"{c.name:24s} {name:22s} {us:9.1f} us {r['tflops']:7.1f} TF/s {r['gbs']:7.0f} GB/s "
                  f"bits={eq:.4f} rel={rel:.1e}{'' if ok else ' MISMATCH'}", flush=True)
            del run
        del ref, refs, data
        torch.cuda.empty_cache()
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"total {time.time() - t0:.0f} s; mismatches: {failed or 'none'}")
    print("best per case (us; x = speed-up over main; TF/s, GB/s of the best):")
    for cname in dict.fromkeys(r["case"] for r in results):
        rows = [r for r in results if r["case"] == cname]
        main_us = rows[0]["us"]
        top = sorted((r for r in rows if r["variant"] != "main" and r["us"] == r["us"]), key=lambda r: r["us"])[:3]
        if top:
            print(f"  {cname:26s} main {main_us:8.1f} | " + " | ".join(
                f"{r['variant']} {r['us']:.1f} ({main_us / r['us']:.2f}x)" for r in top)
                + f" | {top[0]['tflops']:.0f} TF/s {top[0]['gbs']:.0f} GB/s")

if __name__ == "__main__":
    main()
