"""Decode top-k routes on the GPU: the histogram-free `select_topk` against the radix / fused
route of `select_radix`, bit-exact, then select (score + top-k writing the packed rows) timed
(CUDA-graph replays, L2 flushed).

    python benchmarks/bench_topk.py                       # the five decode shapes, one table
    python benchmarks/bench_topk.py --warm KEY --variants A,B   # compile only (fills Triton's cache)

Per shape: "radix" = the select_radix route, "score" = the score launch alone (the top-k
left out: what a top-k costs is the difference), "plan" = what `plan_select` picks, then
each variant of `select_topk` tiles. Before timing, a variant's packed rows must equal the
radix route's bit for bit and the reference (`topk_groups` of the kernel's own score scratch,
expanded by `qsa_core.reference.expand`). "cand": the largest candidate count of a row,
"ovf": rows that took the whole-row resolve.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qsa import GraphTimer, Step  # noqa: E402
from bench_report import Case  # noqa: E402

import qsa_kernels.select as sel  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_core.reference.select import topk_groups  # noqa: E402
from qsa_kernels import select_topk as stk  # noqa: E402

SHAPES = {
    "8k-b1": Case("decode", 8192, 1, 1),
    "128k-b4": Case("decode", 131072, 4, 1),
    "128k-b64": Case("decode", 131072, 64, 1),
    "1m-b4": Case("decode", 1 << 20, 4, 1),
    "1m-b4x4": Case("decode", 1 << 20, 4, 4),
    "128k-b16x4": Case("decode", 131072, 16, 4),
}
# Overrides of `topk_tiles` (a "seg" override sizes samples and lists as for that many segments).
VARIANTS = {"br3": {}, "br2": dict(ssbits=2), "s16k": dict(seg=16384), "s8k": dict(seg=8192), "s4k": dict(seg=4096),
            "w8": dict(warps=8), "w4": dict(warps=4)}
SHORT_ONLY = {"w4"}  # variants timed only where rows take the short route
ROUTE, TILES, RADIX = sel._topk_route, stk.topk_tiles, sel.TopkLaunch


class NoTopk:
    """A top-k that launches nothing (the score launch alone)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args) -> None:
        pass


def configure(route: str, variant: dict | None = None) -> None:
    """route: "plan" (plan_select's choice), "radix", "score" (no top-k) or "topk" (variant tiles)."""
    sel._topk_route = {"plan": ROUTE, "topk": lambda *a: True}.get(route, lambda *a: False)
    sel.TopkLaunch = NoTopk if route == "score" else RADIX

    def tiles(num_cols: int, small: bool, rows: int = 1) -> dict:
        v = variant or {}
        t = TILES(num_cols * 32768 // v["seg"] if "seg" in v else num_cols, small, rows)
        return {**t, **v}

    stk.topk_tiles = tiles


def candidates(step: Step, tiles: dict) -> tuple[int, int]:
    """(largest candidate count of a row, rows over capacity) of the last select."""
    s = step.plan.schedule.select_decode
    if s.topk is None or stk.short_route(s.num_cols, tiles):
        return 0, 0
    segs = -(-s.num_cols // tiles["seg"])
    segp = triton.next_power_of_2(segs)
    tot = s.topk.counts[: s.chunk * segp].view(s.chunk, segp)[: s.num_rows, :segs].sum(1)
    return int(tot.max()), int((tot > tiles["cap"]).sum())


def run_shape(key: str, timer: GraphTimer | None, variants: list[str]) -> str:
    case = SHAPES[key]
    T = case.batch * case.rows
    times, notes = {}, []
    configure("radix")
    step = Step(case, torch.device("cuda"))
    want = step.select()[:T].clone()
    s = step.plan.schedule.select_decode
    Kb, meta = step.cfg.block_topk, step.meta
    blocks = topk_groups(s.scores[:T], meta.visible_blocks[:T], Kb)
    ref = qsa_expand(blocks, meta.positions[:T], meta.visible_blocks[:T], compress_ratio=step.cfg.compress_ratio,
                     out=torch.empty_like(want))
    ok = torch.equal(want, ref)
    times["radix"] = timer(step.select) if timer else 0.0
    del step
    short = stk.short_route(case.context // 4, TILES(case.context // 4, False))
    for route, name, variant in [("score", "score", None), ("plan", "plan", None)] + [
            ("topk", v, VARIANTS[v]) for v in variants if short or v not in SHORT_ONLY]:
        configure(route, variant)
        step = Step(case, torch.device("cuda"))
        got = step.select()[:T].clone()
        same = route == "score" or torch.equal(got, want)
        if route == "topk":
            cand, over = candidates(step, stk.topk_tiles(step.plan.schedule.select_decode.num_cols, False))
            again = torch.equal(step.select()[:T], want)
            notes.append(f"{name}:{'exact' if same and again else 'DIFFERS'} c{cand} o{over}")
        times[name] = (timer(step.select) if timer else 0.0) if same else float("nan")
        del step
    configure("plan")
    cols = " ".join(f"{k} {v:6.1f}" for k, v in times.items())
    return f"{key:8s} {cols} | radix==ref {ok}; " + " ".join(notes)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", help="compile only: one shape key")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if args.warm:
        print(run_shape(args.warm, None, variants), flush=True)
        return
    timer = GraphTimer(flush_l2=True)
    print("us per layer, select (score + top-k + packed rows; CUDA-graph median, L2 flushed)", flush=True)
    for key in args.shapes.split(","):
        print(run_shape(key, timer, variants), flush=True)


if __name__ == "__main__":
    main()
