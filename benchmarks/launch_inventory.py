"""The launches one decode step schedules with the kernels' GPU defaults, on a CPU.

Per case: the step's own launches (stage, metadata build) and one layer's, in launch order,
each with its grid, as the planner binds them for an sm_90 GPU of 132 SMs (`KernelOptions()`,
PDL and the L2 warm on; tests/kernels/sm90.py's `recording`: nothing is compiled or launched).
Production geometry (Hq 24, Hkv 2, D 256, indexer 4 x 128, Kb 512, r 4, page 64), bf16,
plans made with static=True as the engines' CUDA graphs do. Run without TRITON_INTERPRET:

    python benchmarks/launch_inventory.py
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

import sm90  # noqa: E402
from qsa_core import QSAConfig, QSALayerCache, QSANormWeights, QSAPlanner, QSAStepInputs  # noqa: E402
from qsa_core.layer import qsa_attention, qsa_indexer  # noqa: E402
from qsa_kernels import launch  # noqa: E402

# (context, requests, rows per request): the decode rows of issue 43's targets.
CASES = ((8192, 1, 1), (131072, 4, 1), (131072, 64, 1), (1 << 20, 4, 1), (1 << 20, 4, 4))
PAGE = 64


def _config() -> QSAConfig:
    return QSAConfig(hidden_size=2048, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4,
                     index_head_dim=128, token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7)


def inventory(context: int, batch: int, rows: int) -> tuple[list, list]:
    """(step launches, layer launches) of one decode step, each (kernel name, grid), in order."""
    log: list[tuple[str, tuple[int, ...]]] = []

    class Logged:
        def __init__(self, launcher, grid, values, options, free, checked=(), *, fast_launch=True):
            self.entry = (launcher.fn.__name__, tuple(grid))

        def __call__(self, *free):
            log.append(self.entry)

    cfg, T, ring = _config(), batch * rows, 8 if rows > 1 else 4
    with sm90.recording():
        launch.BoundLaunch = Logged  # recording() restores the real one
        bf16 = dict(dtype=torch.bfloat16)
        cache = QSALayerCache(k=torch.zeros(2, PAGE, 2, 256, **bf16), v=torch.zeros(2, PAGE, 2, 256, **bf16),
                              compressed=torch.zeros(2, PAGE // 4, 128, **bf16),
                              ring=torch.zeros(batch, ring, 128, **bf16), ring_positions=None)
        planner = QSAPlanner(cfg, dtype=torch.bfloat16, page_size=PAGE, ring_capacity=ring, max_num_tokens=T,
                             max_model_len=context, max_num_reqs=batch, backend="triton", value_checks=False)
        step = QSAStepInputs(
            query_start_loc=torch.arange(0, T + 1, rows, dtype=torch.int32),
            seq_lens=torch.full((batch,), context, dtype=torch.int32),
            block_table=torch.zeros(batch, math.ceil(context / PAGE), dtype=torch.int32),
            slot_mapping=torch.zeros(T, dtype=torch.int64), ring_index=torch.arange(batch, dtype=torch.int32),
            num_decodes=batch, decode_query_len=rows, max_query_len=rows, max_seq_len=context)
        plan = planner.plan(step, static=True)
        step_launches = list(log)
        log.clear()
        norms = QSANormWeights(*(torch.zeros(n) for n in (128, 128, 256, 256)))
        proj = [torch.zeros(T, w, **bf16) for w in (640, 12288, 512, 512)]
        qsa_attention(plan, qsa_indexer(plan, norms, *proj, cache), cache)
    return step_launches, list(log)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the inventory is of the GPU's tile choices")
    for context, batch, rows in CASES:
        step, layer = inventory(context, batch, rows)
        print(f"decode context {context} B{batch} x {rows} rows: {len(layer)} launches a layer, {len(step)} a step")
        print("  step: " + "; ".join(f"{n} {g}" for n, g in step))
        for i, (name, grid) in enumerate(layer, 1):
            print(f"  {i}. {name} grid {grid} ({math.prod(grid)} programs)")


if __name__ == "__main__":
    main()
