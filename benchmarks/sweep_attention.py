"""Launch-config sweep of the sparse attention kernel on the H200 (tuning aid, not a test).

    python benchmarks/sweep_attention.py

For a prefill chunk and two decode batches at 128K context, times every (BLOCK_N,
num_warps, num_stages) and checks each output equals the default configuration's.
"""

from __future__ import annotations

import itertools

import torch

import bench_qsa as b
from qsa_kernels import attention

CASES = [("prefill 16K rows @128K", 131072, 1, 16384), ("decode B64 x4 @128K", 131072, 64, 4),
         ("decode B4 @128K", 131072, 4, 1)]
CONFIGS = list(itertools.product((16, 32, 64), (2, 4, 8), (1, 2)))


def main() -> None:
    default = attention._launch_config
    for name, ctx, batch, rows in CASES:
        step = b.Step(ctx, batch, rows)
        step.select()
        want = step.attention().clone()
        results = []
        for cfg in CONFIGS:
            attention._launch_config = lambda r, dp, cfg=cfg: cfg
            try:
                got = step.attention()
                same = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
                results.append((b.bench(step.attention) * 1e3, cfg, same))
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                results.append((float("inf"), cfg, type(e).__name__))
            finally:
                attention._launch_config = default
        results.sort(key=lambda x: x[0])
        print(f"{name}: default {default(step.q.shape[0], 256)} = {b.bench(step.attention) * 1e3:.1f} us")
        for us, cfg, same in results[:6]:
            print(f"  BLOCK_N {cfg[0]:>2} warps {cfg[1]} stages {cfg[2]}: {us:8.1f} us  same={same}")
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
