"""Decode top-k routes on the GPU: the histogram-free `select_topk` against the current radix /
fused route, bit-exact, then select + expand timed (CUDA-graph replays, L2 flushed).

    python benchmarks/bench_topk.py                 # the five decode shapes, one table
    python benchmarks/bench_topk.py --warm KEY      # compile only (fills Triton's cache)

Per shape: "cur" = score + current top-k + expand (`qsa_select`), "score" = score + expand
with the top-k left out (what the top-k costs is the difference), then each variant of
`select_topk` tiles. Before timing, a variant's selection rows must equal the current
route's bit for bit, and its top-k must equal the reference top-k of the kernel's own score
scratch (`topk_groups`, indices exact). "cand" is the largest candidate count of a row
(over the row's segments) and "ovf" the rows that took the whole-row resolve.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qsa import GraphTimer, Step  # noqa: E402
from bench_report import Case  # noqa: E402

import qsa_kernels.select as sel  # noqa: E402
from qsa_core.reference.select import topk_groups  # noqa: E402
from qsa_kernels import select_topk as stk  # noqa: E402

SHAPES = {
    "8k-b1": Case("decode", 8192, 1, 1),
    "128k-b4": Case("decode", 131072, 4, 1),
    "128k-b64": Case("decode", 131072, 64, 1),
    "1m-b4": Case("decode", 1 << 20, 4, 1),
    "1m-b4x4": Case("decode", 1 << 20, 4, 4),
}
VARIANTS = {"b4w16": {}, "b2w16": dict(bits=2), "b4w8": dict(warps=8),
            "s8k": dict(seg=8192)}  # overrides of `topk_tiles` (seg 8192: samp / lcap as for 4x the segments)
CURRENT = sel.TopkLaunch


def topk_factory(variant: dict | None, made: list):
    """A stand-in for `select.TopkLaunch` (same constructor): the new route with `variant`
    tiles, or None: no top-k at all (score + expand only)."""

    class Route:
        def __init__(self, scores, visible_blocks, out, state, hist, counts, *, row0, rows, num_cols, n_tiles,
                     block_topk, scored, fused, tiles):
            self.inner = None
            if variant is not None:
                t = {**stk.topk_tiles(num_cols, small=False), **variant}
                if "seg" in variant:  # samples and list widths as topk_tiles sizes them for that many segments
                    t = {**stk.topk_tiles(num_cols * 32768 // variant["seg"], small=False), **variant}
                self.scratch = stk.topk_scratch(rows, num_cols, t, scores.device)
                self.tiles, self.num_cols = t, num_cols
                self.inner = stk.TopkLaunch(scores, visible_blocks, out, self.scratch, row0=row0, rows=rows,
                                            num_cols=num_cols, block_topk=block_topk, tiles=t)
                made.append(self)

        def __call__(self, row0: int) -> None:
            if self.inner is not None:
                self.inner(row0)

    return Route


def use(step: Step, route) -> None:
    """Bind the step's select launches anew with `route` as the top-k."""
    sel.TopkLaunch = route
    step.plan.schedule.layer_launches(step.cache).pop("select", None)


def candidates(made: list) -> tuple[int, int]:
    """(largest candidate count of a row, rows over capacity) of the last call."""
    worst, over = 0, 0
    for r in made:
        if stk.short_route(r.num_cols, r.tiles):
            continue
        tot = r.scratch.counts.view(r.scratch.arrive.numel(), -1).sum(1)
        worst = max(worst, int(tot.max()))
        over += int((tot > r.tiles["cap"]).sum())
    return worst, over


def run_shape(key: str, timer: GraphTimer | None) -> list[str]:
    case = SHAPES[key]
    step = Step(case, torch.device("cuda"))
    s = step.plan.schedule
    Kb = step.cfg.block_topk
    T = case.batch * case.rows
    use(step, CURRENT)
    want_sel = step.select().clone()
    want_blocks = s.blocks.clone()
    scores = s.select_decode.scores
    assert s.select_decode.chunk >= T, "the check reads one chunk's score scratch"
    ref = topk_groups(scores[:T], step.meta.visible_blocks[:T], Kb)
    ok_cur = torch.equal(want_blocks[:T], ref)
    times = {"cur": timer(step.select) if timer else 0.0}
    use(step, topk_factory(None, []))
    times["score"] = timer(step.select) if timer else 0.0
    notes = []
    for name, variant in VARIANTS.items():
        made: list = []
        use(step, topk_factory(variant, made))
        got_sel = step.select().clone()
        same = torch.equal(got_sel, want_sel) and torch.equal(s.blocks[:T], ref)
        cand, over = candidates(made)
        times[name] = (timer(step.select) if timer else 0.0) if same else float("nan")
        again = torch.equal(step.select(), want_sel)  # after graph replays: counters were reset
        notes.append(f"{name}:{'exact' if same and again else 'DIFFERS'} cand {cand} ovf {over}")
    use(step, CURRENT)
    cols = "  ".join(f"{k} {v:7.1f}" for k, v in times.items())
    return [f"{key:9s} {cols}  | cur==ref {ok_cur}; " + "; ".join(notes)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", help="compile only: one shape key")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    if args.warm:
        run_shape(args.warm, None)
        return
    timer = GraphTimer(flush_l2=True)
    print("us per layer, select + expand (CUDA-graph median, L2 flushed)", flush=True)
    for key in args.shapes.split(","):
        for line in run_shape(key, timer):
            print(line, flush=True)


if __name__ == "__main__":
    main()
