"""Decode selection of short rows (issue 12): the short top-k (`select_topk._topk_short_kernel`,
rows of <= `short` columns, whole row in registers) against main's, bit-exact first, then
timed (CUDA-graph replays, L2 flushed before each).

    python benchmarks/bench_fsel.py [--shapes 8k-b1,...] [--variants b4,...]
    TRITON_INTERPRET=1 python benchmarks/bench_fsel.py --dry --shapes 8k-b1   # CPU: checks only

Per shape: "main" = main's short route (bracket=0: the fixed 2-bit radix search of `_kth_key`,
16 block reductions; its compiled code is main's), then bracket=1 (`_kth_bound`,
`QSA_SHORT_BRACKET=1`) with each variant's tile overrides.
Columns: "select" = score + top-k writing the packed rows (as the plan launches them), "topk"
= the top-k launch alone over the same score scratch. Before timing, each variant's packed
rows must equal main's bit for bit on the Step's scores, twice, and on two tied scratches
(scores rounded to crowds; 80 % zeros, so the threshold is a ReLU zero); "mixed" rows: one
row at the plan's column bound and three shorter (top-k alone). Variants with "short" force
the short route on every chunk up to that many columns (main takes the radix passes or the
fused radix row kernel there, timed as "radix", checked against the reference top-k).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qsa import GraphTimer, Step  # noqa: E402
from bench_report import Case  # noqa: E402

import qsa_kernels.select as sel  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_core.reference.select import topk_groups  # noqa: E402
from qsa_kernels import select_topk as stk  # noqa: E402


SHAPES = {
    "8k-b1": Case("decode", 8192, 1, 1),
    "8k-b4": Case("decode", 8192, 4, 1),
    "16k-b4": Case("decode", 16384, 4, 1),
    "8k-b64": Case("decode", 8192, 64, 1),
    "8k-b128": Case("decode", 8192, 128, 1),
    "8k-b256": Case("decode", 8192, 256, 1),
    "16k-b256": Case("decode", 16384, 256, 1),
    "32k-b4": Case("decode", 32768, 4, 1),
    "128k-b4": Case("decode", 131072, 4, 1),
}
# Overrides of `topk_tiles` for this tree's short kernel ("short": force the route up to it).
VARIANTS = {  # (every one with bracket=1: `_kth_bound`; "tiles": topk_tiles' own sbits)
    "tiles": {}, "b2": dict(sbits=2), "b3": dict(sbits=3), "b4": dict(sbits=4), "early": dict(early=1),
    "b3e": dict(sbits=3, early=1), "w8": dict(warps=8),
    "f4k": dict(short=4096), "f4ke": dict(short=4096, early=1), "s8k": dict(short=8192),
}
DRY = False  # --dry: the H200's tiles under the interpreter too
ROUTE, TILES = sel._topk_route, stk.topk_tiles


def configure(kernel: str, variant: dict | None = None) -> None:
    """kernel: "main" (main's search `_kth_key`, main's tiles and routes) or "new" (`_kth_bound`,
    with the variant's tile overrides; a larger "short" forces the short route up to it)."""
    v = dict(bracket=1, **(variant or {})) if kernel == "new" else dict(bracket=0)
    stk.topk_tiles = lambda n, small: {**TILES(n, small and not DRY), **v}
    forced = kernel == "new" and "short" in v
    sel._topk_route = (lambda n, chunk, decode, fused: decode and n <= v["short"]) if forced else ROUTE


def bind_topk(step: Step, scores: torch.Tensor, vis: torch.Tensor, pos: torch.Tensor, out: torch.Tensor):
    """The short top-k launch alone over a scratch fp32 [rows, num_cols] (current configuration)."""
    s = step.plan.schedule.select_decode
    tiles = stk.topk_tiles(s.num_cols, False)
    rows = scores.shape[0]
    launch = stk.TopkLaunch(scores, vis, out, stk.topk_scratch(rows, s.num_cols, tiles, scores.device), row0=0,
                            rows=rows, num_cols=s.num_cols, block_topk=step.cfg.block_topk, tiles=tiles,
                            positions=pos, compress_ratio=step.cfg.compress_ratio)
    return lambda: launch(0, out, out.stride(0))


def scratches(step: Step, T: int) -> dict[str, tuple]:
    """Named (scores, visible, positions) of the checks: the step's own scores, two tied
    versions, and mixed rows (one at the column bound, three shorter)."""
    s, meta = step.plan.schedule.select_decode, step.meta
    base = s.scores[:T].clone()
    vis, pos = meta.visible_blocks[:T].clone(), meta.positions[:T].clone()
    crowd = (base * 2).round() / 2
    zeros = torch.where(base < base.quantile(0.8, dim=1, keepdim=True), 0.0, base)
    n = s.num_cols
    mvis = torch.tensor([n, max(n // 4, 513), n // 2 + 3, 3 * n // 4 + 1], dtype=torch.int32, device=base.device)
    mixed = base[:1].expand(4, -1).contiguous()
    return dict(scores=(base, vis, pos), crowd=(crowd, vis, pos), zeros=(zeros, vis, pos),
                mixed=(mixed, mvis, mvis.long() * 4 + 2))


def run_shape(key: str, variants: list[str], timer, stamp, dev: torch.device) -> None:
    case = SHAPES[key]
    T = case.batch * case.rows
    configure("main")
    step = Step(case, dev)
    s = step.plan.schedule.select_decode
    main_short = s.topk is not None and stk.short_route(s.num_cols, stk.topk_tiles(s.num_cols, False))
    want = step.select()[:T].clone()
    data = scratches(step, T)
    main_out = {}
    line = {"select": timer(step.select)}
    for name, (sc, vis, pos) in data.items():
        out = torch.empty(sc.shape[0], step.selection.shape[1], dtype=torch.int32, device=sc.device)
        if main_short:
            fn = bind_topk(step, sc, vis, pos, out)
            fn()
            main_out[name] = out.clone()
            if name in ("scores", "mixed"):
                line[f"topk {name}"] = timer(fn)
        else:  # main's radix route: the reference top-k of the same scratch
            main_out[name] = qsa_expand(topk_groups(sc, vis, step.cfg.block_topk), pos, vis,
                                        compress_ratio=step.cfg.compress_ratio, out=out)
    label = "main" if main_short else "radix"
    print(f"{stamp()} {key:8s} {label:6s} " + " ".join(f"{k} {v:6.1f}" for k, v in line.items()), flush=True)
    del step
    for vname in variants:
        v = VARIANTS[vname]
        if not main_short and "short" not in v or "short" in v and s.num_cols > v["short"]:
            continue
        if main_short and "short" in v:
            continue
        configure("new", v)
        try:
            step = Step(case, dev)
            got = step.select()[:T].clone()
            again = step.select()[:T].clone()
            same = {"select": torch.equal(got, want) and torch.equal(again, want)}
            line, fns = {}, {}
            for name, (sc, vis, pos) in data.items():
                out = torch.empty(sc.shape[0], step.selection.shape[1], dtype=torch.int32, device=sc.device)
                fn = bind_topk(step, sc, vis, pos, out)
                fn()
                if name in main_out:
                    same[name] = torch.equal(out, main_out[name])
                fns[name] = fn
            exact = all(same.values())
            if exact:
                line["select"] = timer(step.select)
                for name in ("scores", "mixed"):
                    line[f"topk {name}"] = timer(fns[name])
            bad = [k for k, ok in same.items() if not ok]
            print(f"{stamp()} {key:8s} {vname:6s} " + " ".join(f"{k} {x:6.1f}" for k, x in line.items())
                  + (" exact" if exact else f" DIFFERS {bad}"), flush=True)
            del step
        except Exception as exc:  # keep the other variants' figures
            print(f"{stamp()} {key:8s} {vname:6s} failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    configure("main")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="tiles,b2,b3,early,w8,f4k,s8k")
    ap.add_argument("--dry", action="store_true", help="CPU, TRITON_INTERPRET=1: checks only, no timing")
    args = ap.parse_args(argv)
    t0 = time.time()
    stamp = lambda: f"[{time.time() - t0:6.1f}s]"  # noqa: E731
    dev = torch.device("cpu" if args.dry else "cuda")
    if args.dry:  # the planner's Triton backend on the CPU (the interpreter)
        import bench_qsa

        global DRY
        DRY = True
        planner = bench_qsa.QSAPlanner
        bench_qsa.QSAPlanner = lambda *a, **kw: planner(*a, **{**kw, "backend": "triton"})
        timer = lambda fn: (fn(), float("nan"))[1]  # noqa: E731
    else:
        timer = GraphTimer(flush_l2=True, reps=15, budget_ms=200)
    print("us, CUDA-graph median, L2 flushed: select = score + top-k (packed rows), topk = the top-k alone",
          flush=True)
    for key in args.shapes.split(","):
        run_shape(key, args.variants.split(","), timer, stamp, dev)
    print(f"{stamp()} done", flush=True)


if __name__ == "__main__":
    main()
