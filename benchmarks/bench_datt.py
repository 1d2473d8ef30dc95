"""GPU check and timing of the decode attention's one-launch merge against another tree's (main's)
two-launch route (split programs, then a combine launch), at the issue's decode shapes.

Per shape: this tree's output is compared with main's bitwise (torch.equal, same split count),
and with itself after a second call and after the CUDA-graph replays (the arrival counters
are left zero). Timing: `bench_qsa.GraphTimer` (median of CUDA-graph replays, L2 flushed),
main and this tree alternately, twice. --whole also times prepare + select + attention of a
step, this tree's attention against main's (main's patched into the planner / layer).
--splits N,...: this tree with the split count capped at N; --unroll U,...: the merge loading U
splits at once; --warps W: its kernel with W warps
(time, and the error against main's output).

    python benchmarks/bench_datt.py --main-attention PATH/attention.py [--whole] [--splits 16,8] [--unroll 1,4] [--warps 4]
        [--budget-s 80] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qsa import Case, GraphTimer, Step, attention_error  # noqa: E402
from sweep_decode_attention import load_module, runner  # noqa: E402

from qsa_kernels import attention as new  # noqa: E402

M = 1 << 20
SHAPES = [("128K B4", Case("decode", 131072, 4, 1)), ("8K B1", Case("decode", 8192, 1, 1)),
          ("1M B4x4", Case("decode", M, 4, 4)), ("128K B64", Case("decode", 131072, 64, 1))]


class Log:
    def __init__(self, out: str | None) -> None:
        self.t0, self.out, self.lines = time.time(), out, []

    def __call__(self, line: str) -> None:
        line = f"[{time.time() - self.t0:5.1f}s] {line}"
        print(line, flush=True)
        self.lines.append(line)
        if self.out:
            Path(self.out).write_text("\n".join(self.lines) + "\n")


def attention_only(old, step: Step, timer, log, label: str) -> None:
    """This tree's attention against main's on one step: bits, then time (alternately, twice)."""
    main_call, main_sched, _ = runner(old, step)
    new_call, new_sched, _ = runner(new, step)
    want = main_call().clone()
    got = new_call().clone()
    again = new_call().clone()
    eq = torch.equal(got, want) and torch.equal(again, want)
    t = {"main": [], "new": []}
    for _ in range(2):
        t["main"].append(timer(main_call))
        t["new"].append(timer(new_call))
    replay = torch.equal(new_call().clone(), want)
    log(f"{label:9} attention splits {main_sched.n_splits:2}/{new_sched.n_splits:2}  main {t['main'][0]:6.1f} "
        f"{t['main'][1]:6.1f}  new {t['new'][0]:6.1f} {t['new'][1]:6.1f} us  equal {eq} after replays {replay} "
        f"(max |diff| {(got.float() - want.float()).abs().max().item():.1e})")


def variant(old, step: Step, timer, log, label: str, name: str, **knobs) -> None:
    """This tree with module knobs changed (_MAX_SPLITS, _launch_config): time, error vs main."""
    saved = {k: getattr(new, k) for k in knobs}
    for k, v in knobs.items():
        setattr(new, k, v)
    try:
        call, sched, _ = runner(new, step)
        o = call().clone()
        det = torch.equal(o, call())
        t = [timer(call), timer(call)]
    finally:
        for k, v in saved.items():
            setattr(new, k, v)
    main_call, _, _ = runner(old, step)
    err = attention_error(o, main_call())
    log(f"{label:9}   {name:12} {sched.n_splits:2} splits  {t[0]:6.1f} {t[1]:6.1f} us  err vs main {err:.1e} det {det}")


def whole_step(old, step: Step, timer, log, label: str) -> None:
    """prepare + select + attention of one step: this tree's (step), then main's attention
    patched into the planner and the layer (a second step on the same seeded data)."""
    saved = new.plan_attention, new.AttentionLaunch

    def main_plan(*args, partials=None, **kw):
        return old.plan_attention(*args, partials=None if partials is None else partials[:2], **kw)

    new.plan_attention, new.AttentionLaunch = main_plan, old.AttentionLaunch
    try:
        theirs = Step(step.case, torch.device("cuda"))
        theirs.select()
        theirs_out = theirs.full().clone()
    finally:
        new.plan_attention, new.AttentionLaunch = saved
    same = torch.equal(step.full(), theirs_out)  # the bound launches stay as bound
    t_main, t_new = [], []
    for _ in range(2):
        t_main.append(timer(theirs.full))
        t_new.append(timer(step.full))
    log(f"{label:9} whole step  main {t_main[0]:6.1f} {t_main[1]:6.1f}  new {t_new[0]:6.1f} {t_new[1]:6.1f} us  "
        f"equal {same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--main-attention", required=True)
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--splits", default="", help="split caps to try at <= 16 rows, e.g. 16,8")
    ap.add_argument("--unroll", default="", help="merge unrolls to try at <= 16 rows, e.g. 1,4")
    ap.add_argument("--warps", type=int, default=0, help="also try the split route with this many warps")
    ap.add_argument("--budget-s", type=float, default=80.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    log = Log(args.out)
    old = load_module(args.main_attention, "attention_main")
    timer = GraphTimer(flush_l2=True)
    steps = {}

    def stage(name, fn, shapes):
        for label, case in shapes:
            if time.time() - log.t0 > args.budget_s:
                log(f"{label:9} {name} skipped (budget)")
                continue
            if label not in steps:
                steps[label] = Step(case, torch.device("cuda"))
                steps[label].select()
            try:
                fn(steps[label], label)
            except Exception as e:  # noqa: BLE001 - one stage's failure is logged, the rest still run
                log(f"{label:9} {name} error {type(e).__name__}: {str(e)[:300]}")

    stage("attention", lambda st, lb: attention_only(old, st, timer, log, lb), SHAPES)
    if args.whole:
        stage("whole step", lambda st, lb: whole_step(old, st, timer, log, lb), SHAPES)
    small = [x for x in SHAPES if x[1].batch * x[1].rows <= 16]
    for cap in [int(x) for x in args.splits.split(",") if x]:
        stage(f"cap {cap}", lambda st, lb: variant(old, st, timer, log, lb, f"cap {cap}", _MAX_SPLITS=cap), small)
    for u in [int(x) for x in args.unroll.split(",") if x]:
        stage(f"unroll {u}", lambda st, lb: variant(old, st, timer, log, lb, f"unroll {u}", _MERGE_UNROLL=u), small)
    if args.warps:
        cfg = (64, args.warps, 1)
        stage(f"warps {args.warps}", lambda st, lb: variant(old, st, timer, log, lb, f"warps {args.warps}",
                                                            _launch_config=lambda dp: cfg), SHAPES)
    log("done")


if __name__ == "__main__":
    main()
