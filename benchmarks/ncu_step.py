"""One eager layer step of a `bench_step` case inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off [sections] python benchmarks/ncu_step.py --case 1m-b4-fp8 [--variant auto]

The step is built with the variant's switches (`bench_step.build`), run `--warmup` times,
then L2 is flushed (256 MB written) and the next step runs between cudaProfilerStart and
cudaProfilerStop: ncu sees exactly one cold step's kernels (select them with --kernel-name).
The flush is outside the range, so it is not profiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="1m-b4-fp8", choices=sorted(bench_step.CASES))
    ap.add_argument("--variant", default="auto")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    step = bench_step.build(bench_step.CASES[args.case], args.variant)
    for _ in range(args.warmup):
        step.full()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    flush.zero_()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step.full()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one cold step of {args.case} ({args.variant})")


if __name__ == "__main__":
    main()
