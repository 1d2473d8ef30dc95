"""Prefill selection on the GPU: the sampled-bound top-k (`select_prefill`, samples written by
the score launch) against today's radix route, bit-exact, then select timed (CUDA-graph
replays, L2 flushed), split into the score launches and the top-k launches.

    python benchmarks/bench_select_prefill.py [--contexts 16K,128K,1M] [--rows 16384] [--out F.json]
    TRITON_INTERPRET=1 python benchmarks/bench_select_prefill.py --dry   # CPU: tiny shapes, checks only

One request of `rows` query rows at the end of a `context`-token sequence (bf16 queries and
keys, random, shuffled pages; Hi 4, Di 128, r 4, page 64, Kb 512), the packed selection rows
as the layer writes them. Per context: "radix" (the select_radix route), then each variant of
`select_prefill` tiles (and, for comparison, `select_topk` routes where they apply). Before
timing, a variant's packed rows must equal the radix route's bit for bit, and the last
chunk's rows the reference (`topk_groups` of the kernel's own scores, expanded). Columns:
select / scores / top-k us (scores: the chunk's score launches alone; top-k: its top-k
launches alone, reading the last chunk's scratch), "cand": the largest and mean candidate
count of a row of the last chunk, "ovf": its rows that took the whole-row resolve.
Kernels compile first, in parallel processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dataclasses  # noqa: E402

import qsa_kernels.select as sel  # noqa: E402
import qsa_kernels.select_score as ss  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_core.reference.select import topk_groups  # noqa: E402
from qsa_kernels import select_prefill as sp  # noqa: E402
from qsa_kernels import select_topk as stk  # noqa: E402

import os  # noqa: E402

R, PAGE, HI, DI = 4, 64, 4, 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DRY = os.environ.get("TRITON_INTERPRET", "0") == "1"
KB = 8 if DRY else 512  # the interpreter's tiny shapes: Kb 8
W = KB * R + R - 1
CONTEXTS = {"16K": 16384, "128K": 131072, "1M": 1 << 20,
            "dry1": 256, "dry2": 1024}  # (the --dry contexts)
# select_prefill tile overrides of `prefill_tiles` (name -> changes); "topk": select_topk's route.
VARIANTS = {
    "plan": {},  # as planned (2026-12-01 W2: defer, 8 warps at 64 registers, 1024 candidates)
    "w1": dict(defer=0, warps=16, regs=0, cap=2048, block=4096),  # W1's: rows resolved by their last program
    "nodefer": dict(defer=0), "c2k": dict(cap=2048, block=4096, rregs=64), "w16": dict(warps=16, block=4096),
    "noregs": dict(regs=0), "s16k": dict(seg=16384), "l12": dict(lbits=12), "rw8": dict(rwarps=8),
    "skip": dict(skip=1), "noskip": dict(skip=0),  # the candidate launch reads only runs reaching the bound
    "sub2": dict(sub=2), "sub4": dict(sub=4), "sub8": dict(sub=8), "sub16": dict(sub=16), "topk": None,
    # the row's bound (tile bound): b0 each segment program's _kth_key, b1 once per row in a bound
    # launch, b2 each program's bracket search, b3 the bound launch's bracket search (plan: b1 for
    # rows of several segments, else b2)
    "b0": dict(bound=0), "b1": dict(bound=1), "b2": dict(bound=2), "b3": dict(bound=3),
}
# Prefill score-tile overrides (name -> `ScoreTiles` changes), with the planned top-k tiles:
# session 8 timed the samples-only pass faster with 128-column tiles or 64-row tiles; at 128-column
# tiles the planned kernel spills 488 B (sm_90, triton 3.6), 16-row tiles or 8 warps do not.
# Session 11: "masked" is the kernel before whole tiles (every tile masked); r168 / r128:
# registers per thread (3 programs an SM at 64-column tiles; r0: the compiler's choice).
SCORE_VARIANTS = {"g128": dict(block_g=128), "g64": dict(block_g=64), "r64": dict(block_r=64), "r16": dict(block_r=16),
                  "w8": dict(num_warps=8), "masked": dict(whole=False),
                  "s2": dict(stages=2), "s4": dict(stages=4),
                  "r168": dict(max_regs=168), "r128": dict(max_regs=128), "r0": dict(max_regs=0)}
# A route name may join variants with "+" ("g64+sub4"): their score and tile changes together.
PREFILL_ROUTE, TOPK_ROUTE, SCORE_TILES = sel._prefill_route, sel._topk_route, ss.score_tiles


def _score_tiles(changes: dict):
    """`score_tiles` with prefill's tiles changed."""
    def tiles(decode: bool, t: dict, interpret: bool, key_bytes: int = 2, num_cols: int = 0):
        base = SCORE_TILES(decode, t, interpret, key_bytes, num_cols)
        return base if decode or interpret else dataclasses.replace(base, **changes)
    return tiles


def _parts(route: str) -> tuple[dict, dict]:
    """(score-tile changes, select_prefill tile changes) of a route name (parts joined by "+")."""
    score, tiles = {}, {}
    for part in route.split("+"):
        score.update(SCORE_VARIANTS.get(part, {}))
        tiles.update(VARIANTS.get(part) or {})
    return score, tiles


def configure(route: str) -> None:
    """route: "radix", "topk" (select_topk for prefill chunks), a VARIANTS name of
    select_prefill or a SCORE_VARIANTS name (the score kernel's tiles)."""
    score, changes = _parts(route)
    ss.score_tiles = sel.score_tiles = _score_tiles(score) if score else SCORE_TILES
    sel._topk_route = (lambda *a: True) if route == "topk" else TOPK_ROUTE
    if route in ("radix", "topk"):
        sel._prefill_route = lambda *a: None
        return

    def tiles(n_cols: int, block_topk: int, decode: bool, chunk: int):
        if decode:
            return None
        t = sp.prefill_tiles(n_cols, block_topk, sel._score_block_g(n_cols), small=DRY)
        t = {**t, **changes}
        return t if n_cols > block_topk and n_cols * t["sub"] >= 2 * block_topk * sel._score_block_g(n_cols) else None

    sel._prefill_route = tiles


def problem(context: int, rows: int, seed: int = 0):
    """q [T, Hi, Di], compressed [pages, PAGE / R, Di], block_table, token_to_req, visible, positions."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    per_req = context // PAGE
    table = torch.randperm(per_req, generator=g, device=DEV).view(1, per_req).int()
    comp = torch.randn(per_req, PAGE // R, DI, generator=g, device=DEV).to(torch.bfloat16)
    pos = torch.arange(context - rows, context, device=DEV)
    to_req = torch.zeros(rows, dtype=torch.int32, device=DEV)
    vis = ((pos + 1) // R).clamp(max=context // R).int()
    q = torch.randn(rows, HI, DI, generator=g, device=DEV).to(torch.bfloat16)
    return q, comp, table, to_req, vis, pos


class Select:
    """One select call (all chunks) of the configured route, writing packed rows."""

    def __init__(self, data, context: int) -> None:
        q, comp, table, to_req, vis, pos = data
        self.q, self.table, self.vis = q, table, vis
        self.s = sel.plan_select(q.shape[0], context // R, KB, decode=False, device=DEV)
        self.out = torch.full((q.shape[0], W + 1), -7, dtype=torch.int32, device=DEV)
        self.launch = sel.SelectLaunch(self.s, q, comp, table, to_req, vis, self.out, page_size=PAGE,
                                       compress_ratio=R, block_topk=KB, positions=pos)

    def __call__(self) -> torch.Tensor:
        return self.launch(self.q, self.table, self.out)

    def scores(self) -> None:
        for row0, score, _ in self.launch._chunks:
            score(self.q, self.table, row0)

    def topk(self) -> None:
        for row0, _, topk in self.launch._chunks:
            topk(row0, self.out, self.out.stride(0))

    def candidates(self) -> tuple[int, float, int]:
        """(largest, mean candidate count, rows over capacity) of the last chunk's long rows."""
        s, t = self.s, self.s.prefill_tiles
        if s.prefill is None:
            return 0, 0.0, 0
        row0, _, _ = self.launch._chunks[-1]
        n = min(s.chunk, s.num_rows - row0)
        segp = triton.next_power_of_2(triton.cdiv(s.num_cols, t["seg"]))
        vis = self.vis[row0:row0 + n]
        crow0 = row0 % sp.defer_rows(s.chunk, s.num_rows, s.num_cols, t)
        cnt = s.prefill.counts.view(-1, segp)[crow0:crow0 + n]
        nseg = (vis + t["seg"] - 1) // t["seg"]
        tot = torch.where(torch.arange(segp, device=DEV)[None, :] < nseg[:, None], cnt, 0).sum(1)[vis > KB]
        return int(tot.max()), float(tot.float().mean()), int((tot > t["cap"]).sum())


def reference_rows(run: Select, data) -> bool:
    """The last chunk's packed rows equal the reference top-k of the kernel's own scores."""
    q, comp, table, to_req, vis, pos = data
    row0, _, _ = run.launch._chunks[-1]
    n = min(run.s.chunk, run.s.num_rows - row0)
    blocks = topk_groups(run.s.scores[:n], vis[row0:row0 + n], KB)
    want = qsa_expand(blocks, pos[row0:row0 + n], vis[row0:row0 + n], compress_ratio=R,
                      out=torch.empty(n, W + 1, dtype=torch.int32, device=DEV))
    return bool(torch.equal(run.out[row0:row0 + n], want))


def routes(ctx: str, names: list[str]) -> list[str]:
    cols = CONTEXTS[ctx] // R
    out, seen = [], []
    for n in names:
        if n == "topk":
            if cols <= stk.topk_tiles(cols, DRY)["seg"]:  # select_topk: the short route, or one segment
                out.append(n)
            continue
        g = sel._score_block_g(cols)
        score, changes = _parts(n)
        t = {**sp.prefill_tiles(cols, KB, g, small=DRY), **changes}
        base = sp.prefill_tiles(cols, KB, g, small=DRY)
        if t["seg"] >= cols and base["seg"] >= cols:  # one segment either way
            t["seg"] = base["seg"]
        if cols * t["sub"] >= 2 * KB * g and (n == "plan" or score or t != base) and (t not in seen or score):
            out.append(n)
            seen.append(t)
    return out


def _warm(args) -> str:
    """Compile one route of one context (a worker process) on a few rows of the same shapes."""
    ctx, route = args
    try:
        configure(route)
        data = problem(CONTEXTS[ctx], 256)
        Select(data, CONTEXTS[ctx])()
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # reported, not fatal
        return f"{ctx} {route}: {type(exc).__name__}: {str(exc)[:300]}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16K,128K,1M")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--rows-1m", type=int, default=None, help="rows at 1M (default --rows)")
    ap.add_argument("--variants", default="plan,w1,nodefer,c2k,l12,topk")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true", help="CPU interpreter: tiny shapes, checks only")
    ap.add_argument("--warm-only", action="store_true", help="compile (fill Triton's cache), no timing")
    ap.add_argument("--no-warm", action="store_true", help="time without the parallel compile first")
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.dry:
        a.contexts, a.rows = "dry1,dry2", 24
        timer = lambda fn: (fn(), float("nan"))[1]  # noqa: E731
    else:
        from bench_qsa import GraphTimer

        ctxs = a.contexts.split(",")
        work = [(c, r) for c in ctxs for r in ["radix"] + routes(c, a.variants.split(","))]
        if not a.no_warm:
            with ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn")) as pool:
                errors = [e for e in pool.map(_warm, work) if e]
            print(f"compiled {len(work)} in {time.time() - t0:.0f} s; failed: {errors or 'none'}", flush=True)
        if a.warm_only:
            return
        timer = GraphTimer(reps=15, budget_ms=400)
    ctxs = a.contexts.split(",")
    results = []
    for ctx in ctxs:
        context = CONTEXTS[ctx]
        rows = a.rows_1m if ctx == "1M" and a.rows_1m else a.rows
        data = problem(context, rows)
        configure("radix")
        base = Select(data, context)
        want = base().clone()
        ok = reference_rows(base, data)
        line = dict(ctx=ctx, rows=rows, route="radix", exact=ok, select=timer(base), scores=timer(base.scores),
                    topk=timer(base.topk), chunks=len(base.launch._chunks))
        results.append(line)
        print(f"{ctx:4s} {rows}r radix      select {line['select']:9.1f} scores {line['scores']:9.1f} "
              f"topk {line['topk']:9.1f} us ref {ok} chunks {line['chunks']}", flush=True)
        del base
        for route in routes(ctx, a.variants.split(",")):
            configure(route)
            try:
                run = Select(data, context)
                got = run().clone()
                same = bool(torch.equal(got, want)) and bool(torch.equal(run().clone(), want))
                exact = same and reference_rows(run, data)
                cand = run.candidates() if route != "topk" else (0, 0.0, 0)
                line = dict(ctx=ctx, rows=rows, route=route, exact=exact, cand_max=cand[0], cand_mean=cand[1],
                            overflow=cand[2], tiles=run.s.prefill_tiles,
                            select=timer(run) if exact else float("nan"),
                            scores=timer(run.scores) if exact else float("nan"),
                            topk=timer(run.topk) if exact else float("nan"))
            except Exception as exc:
                print(f"{ctx:4s} {route:10s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            results.append(line)
            print(f"{ctx:4s} {rows}r {route:10s} select {line['select']:9.1f} scores {line['scores']:9.1f} "
                  f"topk {line['topk']:9.1f} us {'exact' if exact else 'DIFFERS'} "
                  f"cand {cand[0]}/{cand[1]:.0f} ovf {cand[2]}", flush=True)
            del run
        del data
        torch.cuda.empty_cache()
    configure("radix")
    sel._prefill_route, sel._topk_route = PREFILL_ROUTE, TOPK_ROUTE
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    for ctx in ctxs:  # a summary: the radix route and the fastest exact variants
        rows = sorted((r for r in results if r["ctx"] == ctx and r["route"] != "radix" and r["exact"]),
                      key=lambda r: r["select"])[:3]
        radix = [r for r in results if r["ctx"] == ctx and r["route"] == "radix"]
        print(f"best {ctx}: radix {radix[0]['select']:.0f} | " if radix else f"best {ctx}: ",
              " | ".join(f"{r['route']} {r['select']:.0f} ({r['scores']:.0f}+{r['topk']:.0f})" for r in rows), flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
