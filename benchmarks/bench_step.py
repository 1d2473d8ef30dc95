"""One layer's whole step on the GPU under switches, and where its time goes.

    python benchmarks/bench_step.py [--cases 8k-b1,128k-b4,...] [--variants base,pdl,...] [--profile]

For each case (bench_qsa's configurations, by short name) and each variant (switches read
when a planner and its launches are made: `nopdl`; `pdl` / `late` = programmatic dependent
launch signalling at each program's start / end, `launch`'s modes 1 / 2; `samples` =
QSA_DECODE_SAMPLES=1 with PDL 2; `auto` = the default routes with PDL 2, `auto-early` with PDL 1;
the others force
QSA_DECODE_SAMPLES=0; a suffix `-w<mask>` sets QSA_L2_WARM, the L2 warms of `qsa_kernels.warm`,
else they take its default), the step (`bench_qsa.Step.full`:
prepare + select + attention, every launch in one CUDA graph) is built anew, its attention
output must equal the first variant's bit for bit, and its graph replays are timed (median us,
L2 flushed; `--flush write,read` times each variant after both of bench_qsa's flushes), variants
interleaved over `--rounds` rounds so that drift hits them alike.
`--profile` also records `--replays` replays per variant with torch.profiler (CUPTI) and prints
each kernel's time per step (and launches per step), the step's span (first kernel start to last kernel end) and the
idle time between its kernels.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_qsa as bq  # noqa: E402
from bench_report import Case  # noqa: E402

import qsa_kernels.launch as launch  # noqa: E402

M = 1 << 20
CASES = {
    "8k-b1": Case("decode", 8192, 1, 1), "32k-b4": Case("decode", 32768, 4, 1),
    "128k-b4": Case("decode", 131072, 4, 1), "128k-b4-fp8": Case("decode", 131072, 4, 1, "fp8_e4m3"),
    "128k-b64": Case("decode", 131072, 64, 1), "1m-b4": Case("decode", M, 4, 1),
    "1m-b4-fp8": Case("decode", M, 4, 1, "fp8_e4m3"),
    "1m-b4x4": Case("decode", M, 4, 4), "128k-b16x4": Case("decode", 131072, 16, 4),
    "p16k": Case("prefill", 16384, 1, 16384),
}
# variant -> (PDL mode, QSA_DECODE_SAMPLES)
VARIANTS = {"nopdl": (0, "0"), "pdl": (1, "0"), "late": (2, "0"), "samples": (2, "1"), "samples-nopdl": (0, "1"),
            "auto": (2, "auto"), "auto-early": (1, "auto")}


def build(case: Case, variant: str) -> bq.Step:
    """The step of `case` with the variant's switches (read while its planner and launches are made)."""
    base, _, warm = variant.partition("-w")
    pdl, samples = VARIANTS[base]
    launch._pdl = pdl
    os.environ["QSA_DECODE_SAMPLES"] = samples
    if warm:
        os.environ["QSA_L2_WARM"] = warm
    else:
        os.environ.pop("QSA_L2_WARM", None)
    step = bq.Step(case, torch.device("cuda"))
    step.full()  # binds and compiles under these switches
    torch.cuda.synchronize()
    return step


def profile(step: bq.Step, replays: int) -> tuple[dict[str, tuple[float, int]], float, float]:
    """({kernel name: (mean us per launch, launches per replay)}, median span us, median idle us
    between kernels) of graph replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.full()
    graph.replay()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    spans, idles, per = [], [], defaultdict(list)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    n = len(events) // replays if replays else 0
    for r in range(replays):
        run = events[r * n:(r + 1) * n]
        if not run:
            continue
        spans.append(run[-1].time_range.end - run[0].time_range.start)
        busy = sum(e.time_range.end - e.time_range.start for e in run)
        idles.append(spans[-1] - busy)
        for e in run:
            per[e.name[:60]].append(e.time_range.end - e.time_range.start)
    del graph
    return ({k: (statistics.mean(v), len(v) // replays) for k, v in per.items()},
            statistics.median(spans) if spans else 0.0,
            statistics.median(idles) if idles else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="8k-b1,32k-b4,128k-b4,128k-b4-fp8,128k-b64,1m-b4,1m-b4x4")
    ap.add_argument("--variants", default="nopdl,pdl,late")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--flush", default="write",
                    help="comma list of bench_qsa.FLUSHES: how L2 is flushed before a replay; with two, every "
                    "variant is timed under each (columns VARIANT/FLUSH), interleaved")
    args = ap.parse_args()
    variants = args.variants.split(",")
    flushes = args.flush.split(",")
    timers = {f: bq.GraphTimer(reps=25, flush=f) for f in flushes}
    columns = [v if len(flushes) == 1 else f"{v}/{f}" for v in variants for f in flushes]
    table = []
    for name in args.cases.split(","):
        case = CASES[name]
        try:
            steps = {v: build(case, v) for v in variants}
            want = None
            for v, step in steps.items():
                out = step.full()
                torch.cuda.synchronize()
                if want is None:
                    want = out.clone()
                elif not torch.equal(out, want):
                    raise AssertionError(f"{name} {v}: attention output differs from {variants[0]}")
            times = defaultdict(list)
            for _ in range(args.rounds):
                for v, step in steps.items():
                    for f, timer in timers.items():
                        times[v if len(flushes) == 1 else f"{v}/{f}"].append(timer(step.full))
            row = {c: statistics.median(t) for c, t in times.items()}
            table.append((name, row, {c: (min(t), max(t)) for c, t in times.items()}))
            print(f"{name}: " + "  ".join(f"{c} {row[c]:.1f} us ({min(times[c]):.1f}-{max(times[c]):.1f})"
                                          for c in columns), flush=True)
            if args.profile:
                for v, step in steps.items():
                    kernels, span, idle = profile(step, args.replays)
                    print(f"  profile {name} {v}: span {span:.1f} us, idle between kernels {idle:.1f} us")
                    for k, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
                        print(f"    {us * n:8.1f} us  {k}" + (f" ({n} launches of {us:.1f})" if n > 1 else ""))
            del steps
            gc.collect()  # as bench_qsa: the next case starts from an empty allocator
            torch.cuda.empty_cache()
        except Exception as e:  # one failing case must not stop the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    print("\ncase      " + "".join(f"{c:>16}" for c in columns))
    for name, row, _ in table:
        print(f"{name:10}" + "".join(f"{row[c]:16.1f}" for c in columns))


if __name__ == "__main__":
    main()
