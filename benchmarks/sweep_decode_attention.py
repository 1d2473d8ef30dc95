"""GPU sweep of the decode sparse attention: this tree's kernel against another tree's (main's),
both at several split counts, and the PyTorch reference, at the issue's five decode shapes.

Every variant is checked before it is timed: against the reference on the first rows and
against the other tree's kernel on all rows (bf16, 2e-2 of the largest output), two runs
bitwise equal, and the output after the CUDA-graph replays bitwise equal to the first run.
Timing: median of CUDA-graph replays, L2 flushed
before each replay (cold, twice: the run-to-run spread) and not (warm); a graph of one trivial
kernel gives the timer's own floor.

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
# name: (tree, programs per SM the split count aims at); each tree's default runs first.
VARIANTS = {
    "main x3": ("main", 3),
    "main x4": ("main", 4),
    "new x2": ("new", 2),
    "new x3": ("new", 3),
    "new x4": ("new", 4),
}


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"qsa_kernels.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def configure(old, variant) -> None:
    """Set a variant's split count: `new._PROGRAMS_PER_SM`, or main's through its `_num_splits`."""
    tree, waves = variant
    if tree == "new":
        new._PROGRAMS_PER_SM = waves
        return

    def splits(rows, kv_heads, width, block_n, device):
        if rows > old._SPLIT_MAX_ROWS:
            return 1
        want = -(-waves * old._num_sms(device) // (max(rows, 1) * kv_heads))
        blocks = -(-width // block_n)
        n = max(1, min(old._MAX_SPLITS, blocks, want))
        return -(-blocks // -(-blocks // n))
    old._num_splits = splits


def calibration(timer) -> float:
    """us of a graph of one trivial kernel (the timer's own floor)."""
    x = torch.zeros(1024, device="cuda")
    return timer(lambda: x.add_(1.0))


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
    defaults = {"_PROGRAMS_PER_SM": new._PROGRAMS_PER_SM}
    main_splits = old._num_splits
    lines = [f"{'shape':9} {'variant':22} {'splits':>6} {'cold us':>8} {'cold 2nd':>8} {'warm us':>8}  check"]

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    print(lines[0])
    emit(f"{'timer':9} {'one trivial kernel':22} {'':>6} {calibration(cold):8.1f} {calibration(cold):8.1f}"
         f" {calibration(warm):8.1f}")
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
        calls = {"main": (main_call, main_sched, f"ref {err:.1e}", base)}
        for name, variant in VARIANTS.items():
            if time.time() - t0 > args.budget_s:
                emit(f"{label:9} {name:22} skipped (budget)")
                continue
            configure(old, variant)
            try:
                call, sched, _ = runner(old if variant[0] == "main" else new, step)
                got = call().clone()
                again = call().clone()
                e_ref = attention_error(got[:rows], want)
                e_main = attention_error(got, base)
                ok = e_ref <= 2e-2 and e_main <= 2e-2 and torch.equal(got, again)
                calls[name] = (call, sched, f"{'ok' if ok else 'FAIL'} ref {e_ref:.1e} main {e_main:.1e}"
                                            f" det {torch.equal(got, again)}", got)
            except Exception as exc:  # noqa: BLE001 - a configuration the compiler rejects
                emit(f"{label:9} {name:22} error {type(exc).__name__}: {str(exc)[:80]}")
            finally:
                for k, v in defaults.items():
                    setattr(new, k, v)
                old._num_splits = main_splits
        firsts = {name: (cold(c), warm(c)) for name, (c, _, _, _) in calls.items()}
        for name, (call, sched, note, got) in calls.items():  # a second cold pass: the run-to-run spread
            replayed_same = torch.equal(call().clone(), got)  # after all the graph replays
            emit(f"{label:9} {name:22} {sched.n_splits:>6} {firsts[name][0]:8.1f} {cold(call):8.1f}"
                 f" {firsts[name][1]:8.1f}  {note} replay {replayed_same}")
        if label == "128K B4" and time.time() - t0 < args.budget_s:
            for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
                k8, v8 = step.cache.k.to(dt), step.cache.v.to(dt)
                call, sched, scales = runner(new, step, k8, v8)
                e = attention_error(call()[:rows], reference(step, rows, k8, v8, scales))
                emit(f"{label:9} {'default ' + str(dt)[6:]:22} {sched.n_splits:>6} {cold(call):8.1f}"
                     f" {'':>8} {'':>8}  ref {e:.1e}")
        del step, calls
        torch.cuda.empty_cache()
    emit(f"done in {time.time() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
