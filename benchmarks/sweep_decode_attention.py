"""GPU sweep of the decode sparse attention: this tree's kernel (several launch configurations)
against another tree's (main's) and the PyTorch reference, at the issue's five decode shapes.

Every variant is checked before it is timed: against the reference on the first rows and
against the other tree's kernel on all rows (bf16, 2e-2 of the largest output), two runs
bitwise equal, and the output after the CUDA-graph replays bitwise equal to the first run
(the fused kernel's arrival counters reset). Timing: median of CUDA-graph replays, L2 flushed
before each replay (cold) and not (warm).

    python benchmarks/sweep_decode_attention.py --main-attention PATH/attention.py [--budget-s 100]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qsa import Case, GraphTimer, Step, attention_error  # noqa: E402

from qsa_core.reference import qsa_sparse_attention as ref_attention  # noqa: E402
from qsa_kernels import attention as new  # noqa: E402

SHAPES = [("128K B4", Case("decode", 131072, 4, 1)), ("1M B4x4", Case("decode", 1048576, 4, 4)),
          ("128K B64", Case("decode", 131072, 64, 1)), ("8K B1", Case("decode", 8192, 1, 1)),
          ("1M B4", Case("decode", 1048576, 4, 1))]  # the first one pays the compiles
# name: (fused, (BLOCK_N, num_warps, num_stages), max splits, programs per SM)
VARIANTS = {
    "fused bn32 w4 cap16": (True, (32, 4, 1), 16, 2),
    "fused bn32 w4 cap8": (True, (32, 4, 1), 8, 2),
    "fused bn32 w4 cap64 x3": (True, (32, 4, 1), 64, 3),
    "fused bn32 w8 cap16 x1": (True, (32, 8, 1), 16, 1),
    "fused bn64 w8 cap16": (True, (64, 8, 1), 16, 2),
    "2-launch bn32 w4 cap64": (False, (32, 4, 1), 64, 2),
    "2-launch bn64 w8 cap64": (False, (64, 8, 1), 64, 2),
}


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"qsa_kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def configure(variant) -> None:
    fused, cfg, cap, waves = variant
    new._FUSED, new._FUSED_MAX_SPLITS, new._SPLIT_WAVES = fused, cap, waves
    if not fused:
        new._MAX_SPLITS = cap
    new._decode_config = lambda dp, cfg=cfg: cfg


def runner(mod, step: Step, k=None, v=None):
    """A call of mod's attention on the step's tensors (planned once, out buffer fixed)."""
    cfg, meta = step.cfg, step.meta
    T = step.q.shape[0]
    sched = mod.plan_attention(T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.selection_width,
                               device=step.q.device)
    out = torch.empty(T, cfg.num_heads * cfg.head_dim, dtype=step.q.dtype, device=step.q.device)
    k = step.cache.k if k is None else k
    v = step.cache.v if v is None else v
    scales = {} if k.dtype == torch.bfloat16 else dict(k_scale=0.5, v_scale=2.0)
    args = (step.q, step.gate, k, v, meta.block_table, meta.token_to_req, meta.seq_lens, step.selection)
    launch = mod.AttentionLaunch(*args, softmax_scale=cfg.softmax_scale, out=out, schedule=sched, **scales)
    call = lambda: launch(step.q, step.gate, meta.block_table, meta.token_to_req, meta.seq_lens,  # noqa: E731
                          step.selection, out)
    return call, sched, scales


def reference(step: Step, rows: int, k, v, scales) -> torch.Tensor:
    m = step.meta
    return ref_attention(step.q[:rows], step.gate[:rows], k, v, m.block_table, m.token_to_req[:rows], m.seq_lens,
                         step.selection[:rows], softmax_scale=step.cfg.softmax_scale, **scales)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--main-attention", required=True, help="the other tree's kernels/qsa_kernels/attention.py")
    ap.add_argument("--budget-s", type=float, default=100.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    old = load_module(args.main_attention, "attention_main")
    cold, warm = GraphTimer(flush_l2=True), GraphTimer(flush_l2=False)
    defaults = (new._FUSED, new._FUSED_MAX_SPLITS, new._SPLIT_WAVES, new._MAX_SPLITS, new._decode_config)
    lines = [f"{'shape':9} {'variant':26} {'splits':>6} {'cold us':>8} {'warm us':>8}  check"]

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    print(lines[0])
    for label, case in SHAPES:
        if time.time() - t0 > args.budget_s:
            emit(f"{label:9} skipped (budget)")
            continue
        step = Step(case, torch.device("cuda"))
        step.select()
        rows = min(2, step.q.shape[0])
        want = reference(step, rows, step.cache.k, step.cache.v, {})
        main_call, main_sched, _ = runner(old, step)
        base = main_call().clone()
        err = attention_error(base[:rows], want)
        emit(f"{label:9} {'main':26} {main_sched.n_splits:>6} {cold(main_call):8.1f} {warm(main_call):8.1f}"
             f"  ref {err:.1e}")
        for name, variant in VARIANTS.items():
            if time.time() - t0 > args.budget_s:
                emit(f"{label:9} {name:26} skipped (budget)")
                continue
            configure(variant)
            try:
                call, sched, _ = runner(new, step)
                got = call().clone()
                again = call().clone()
                e_ref = attention_error(got[:rows], want)
                e_main = attention_error(got, base)
                us_c, us_w = cold(call), warm(call)
                replayed = call()
                ok = (e_ref <= 2e-2 and e_main <= 2e-2 and torch.equal(got, again) and torch.equal(got, replayed))
                emit(f"{label:9} {name:26} {sched.n_splits:>6} {us_c:8.1f} {us_w:8.1f}"
                     f"  {'ok' if ok else 'FAIL'} ref {e_ref:.1e} main {e_main:.1e}"
                     f" det {torch.equal(got, again)} replay {torch.equal(got, replayed)}")
            except Exception as exc:  # noqa: BLE001 - a configuration the compiler rejects
                emit(f"{label:9} {name:26} error {type(exc).__name__}: {str(exc)[:80]}")
            finally:
                (new._FUSED, new._FUSED_MAX_SPLITS, new._SPLIT_WAVES, new._MAX_SPLITS, new._decode_config) = defaults
        if label == "128K B4" and time.time() - t0 < args.budget_s:
            for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
                k8, v8 = step.cache.k.to(dt), step.cache.v.to(dt)
                call, sched, scales = runner(new, step, k8, v8)
                e = attention_error(call()[:rows], reference(step, rows, k8, v8, scales))
                us = cold(call)
                emit(f"{label:9} {'default ' + str(dt)[6:]:26} {sched.n_splits:>6} {us:8.1f} {'':>8}  ref {e:.1e}")
        del step
        torch.cuda.empty_cache()
    emit(f"done in {time.time() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
