"""GPU check and timing of the decode attention's one-launch merge (QSA_ONE_LAUNCH_MERGE=1: the
last split program of each (row, KV head) to arrive merges the partials) against the default
two-launch route (split programs, then `_combine_kernel`), at the issue's decode shapes.

Per shape, before any timing: the one-launch output is compared with the two-launch output
bitwise (torch.equal, same split count), again after a second call and after the CUDA-graph
replays (the arrival counters must be left zero, or a replay merges nothing). Timing:
`bench_qsa.GraphTimer` (median of CUDA-graph replays, L2 flushed before each), the two routes
alternately, twice (the run-to-run spread). --whole: prepare + select + attention of a step,
a planner made with QSA_ONE_LAUNCH_MERGE=0 against one made with =1 (outputs bitwise equal).
Variants of the one-launch route (time, and the error against the default output):
--splits N,...: the split count capped at N (rows <= 16); --waves P,...: _PROGRAMS_PER_SM = P;
--unroll U,...: the merge loading U splits at once (rows <= 16); --warps W: W warps.

    python benchmarks/bench_datt.py [--whole] [--splits 16,8] [--waves 4] [--unroll 1,4] [--warps 4]
        [--budget-s 80] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qsa import Case, GraphTimer, Step, attention_error  # noqa: E402

from qsa_kernels import attention as ker  # noqa: E402

M = 1 << 20
SHAPES = [("128K B4", Case("decode", 131072, 4, 1)), ("8K B1", Case("decode", 8192, 1, 1)),
          ("1M B4x4", Case("decode", M, 4, 4)), ("128K B64", Case("decode", 131072, 64, 1))]


class Log:
    """Timestamped lines, printed and rewritten to `out` after each one."""

    def __init__(self, out: str | None) -> None:
        self.t0, self.out, self.lines = time.time(), out, []

    def __call__(self, line: str) -> None:
        line = f"[{time.time() - self.t0:5.1f}s] {line}"
        print(line, flush=True)
        self.lines.append(line)
        if self.out:
            Path(self.out).write_text("\n".join(self.lines) + "\n")


def runner(step: Step, one_launch: bool):
    """A call of the attention on the step's tensors (planned once, out buffer fixed)."""
    cfg, meta = step.cfg, step.meta
    T = step.q.shape[0]
    sched = ker.plan_attention(T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.selection_width,
                               device=step.q.device, one_launch_merge=one_launch)
    out = torch.empty(T, cfg.num_heads * cfg.head_dim, dtype=step.q.dtype, device=step.q.device)
    args = (step.q, step.gate, step.cache.k, step.cache.v, meta.block_table, meta.token_to_req, meta.seq_lens,
            step.selection)
    launch = ker.AttentionLaunch(*args, softmax_scale=cfg.softmax_scale, out=out, schedule=sched)
    call = lambda: launch(step.q, step.gate, meta.block_table, meta.token_to_req, meta.seq_lens,  # noqa: E731
                          step.selection, out)
    return call, sched


def attention_only(step: Step, timer, log, label: str) -> None:
    """The one-launch route against the two-launch one on one step: bits, then time."""
    two_call, two_sched = runner(step, False)
    one_call, one_sched = runner(step, True)
    want = two_call().clone()
    got = one_call().clone()
    again = one_call().clone()
    eq = torch.equal(got, want) and torch.equal(again, want)
    zero = torch.equal(one_sched.arrive, torch.zeros_like(one_sched.arrive))
    t = {"two": [], "one": []}
    for _ in range(2):
        t["two"].append(timer(two_call))
        t["one"].append(timer(one_call))
    replay = torch.equal(one_call().clone(), want)
    log(f"{label:9} attention {two_sched.n_splits:2} splits  two-launch {t['two'][0]:6.1f} {t['two'][1]:6.1f}  "
        f"one-launch {t['one'][0]:6.1f} {t['one'][1]:6.1f} us  equal {eq} counters zero {zero} after replays "
        f"{replay} (max |diff| {(got.float() - want.float()).abs().max().item():.1e})")


def variant(step: Step, timer, log, label: str, name: str, **knobs) -> None:
    """The one-launch route with module knobs changed: time, error against the default output."""
    want = runner(step, False)[0]().clone()
    saved = {k: getattr(ker, k) for k in knobs}
    for k, v in knobs.items():
        setattr(ker, k, v)
    try:
        call, sched = runner(step, True)
        o = call().clone()
        det = torch.equal(o, call())
        t = [timer(call), timer(call)]
    finally:
        for k, v in saved.items():
            setattr(ker, k, v)
    log(f"{label:9}   {name:12} {sched.n_splits:2} splits  {t[0]:6.1f} {t[1]:6.1f} us  "
        f"err vs default {attention_error(o, want):.1e} det {det}")


def planned_step(case: Case, one_launch: bool) -> Step:
    """A step whose planner was made with QSA_ONE_LAUNCH_MERGE set to one_launch."""
    saved = os.environ.get("QSA_ONE_LAUNCH_MERGE")
    os.environ["QSA_ONE_LAUNCH_MERGE"] = "1" if one_launch else "0"
    try:
        step = Step(case, torch.device("cuda"))
    finally:
        if saved is None:
            del os.environ["QSA_ONE_LAUNCH_MERGE"]
        else:
            os.environ["QSA_ONE_LAUNCH_MERGE"] = saved
    sched = step.plan.schedule.attention
    assert sched.one_launch == (one_launch and sched.n_splits > 1), "the planner did not read the switch"
    step.select()
    return step


def whole_step(step: Step, timer, log, label: str) -> None:
    """prepare + select + attention: a default planner's step against a one-launch one's (same
    seeded data)."""
    one = planned_step(step.case, True)
    two = planned_step(step.case, False)
    same = torch.equal(one.full(), two.full())
    t_two, t_one = [], []
    for _ in range(2):
        t_two.append(timer(two.full))
        t_one.append(timer(one.full))
    log(f"{label:9} whole step  two-launch {t_two[0]:6.1f} {t_two[1]:6.1f}  one-launch {t_one[0]:6.1f} "
        f"{t_one[1]:6.1f} us  equal {same}")
    del one, two


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--splits", default="", help="split caps to try at <= 16 rows, e.g. 16,8")
    ap.add_argument("--waves", default="", help="_PROGRAMS_PER_SM values to try, e.g. 4")
    ap.add_argument("--unroll", default="", help="merge unrolls to try at <= 16 rows, e.g. 1,4")
    ap.add_argument("--warps", type=int, default=0, help="also try the one-launch route with this many warps")
    ap.add_argument("--budget-s", type=float, default=80.0, help="no stage starts after this many seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    log = Log(args.out)
    timer = GraphTimer(flush_l2=True)
    steps = {}

    def stage(name, fn, shapes):
        for label, case in shapes:
            if time.time() - log.t0 > args.budget_s:
                log(f"{label:9} {name} skipped (budget)")
                continue
            try:
                if label not in steps:
                    steps[label] = Step(case, torch.device("cuda"))
                    steps[label].select()
                fn(steps[label], label)
            except Exception as e:  # noqa: BLE001 - one stage's failure is logged, the rest still run
                log(f"{label:9} {name} error {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.empty_cache()

    stage("attention", lambda st, lb: attention_only(st, timer, log, lb), SHAPES)
    if args.whole:
        stage("whole step", lambda st, lb: whole_step(st, timer, log, lb), SHAPES)
    small = [x for x in SHAPES if x[1].batch * x[1].rows <= 16]
    for cap in ints(args.splits):
        stage(f"cap {cap}", lambda st, lb: variant(st, timer, log, lb, f"cap {cap}", _MAX_SPLITS=cap), small)
    for p in ints(args.waves):
        stage(f"waves {p}", lambda st, lb: variant(st, timer, log, lb, f"waves {p}", _PROGRAMS_PER_SM=p), SHAPES)
    for u in ints(args.unroll):
        stage(f"unroll {u}", lambda st, lb: variant(st, timer, log, lb, f"unroll {u}", _MERGE_UNROLL=u), small)
    if args.warps:
        cfg = (64, args.warps, 1)
        stage(f"warps {args.warps}", lambda st, lb: variant(st, timer, log, lb, f"warps {args.warps}",
                                                            _launch_config=lambda dp: cfg), SHAPES)
    log("done")


if __name__ == "__main__":
    main()
