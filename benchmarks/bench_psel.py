"""Prefill selection split by launch (issue 12): score launches alone, the candidate launches
alone, the deferred resolves alone, the top-k part, the whole select in one graph; main's
`select_prefill` route against this tree's variants, bit-exact first.

    python benchmarks/bench_psel.py [--contexts 128K,1M] [--rows 16384] [--variants plan] [--out F.json]
    python benchmarks/bench_psel.py --ncu [--variants plan,skip]  # selects of 128 rows at 1M (for ncu, eager)
    TRITON_INTERPRET=1 python benchmarks/bench_psel.py --dry   # CPU: tiny shapes, checks only

Problem and variants as `bench_select_prefill` (one request of `rows` rows at the end of its
context, packed rows). Before timing, a variant's packed rows must equal the radix route's
bit for bit and the last chunk's the reference. Times: median us of CUDA-graph replays, L2
flushed before each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_select_prefill as bsp  # noqa: E402


def tied_problem(context: int, rows: int, seed: int = 1):
    """As `bench_select_prefill.problem` with integer queries and keys in [-2, 2]: exact integer
    dot products, so scores tie in crowds (at the threshold too)."""
    q, comp, table, to_req, vis, pos = bsp.problem(context, rows, seed)
    g = torch.Generator(device=q.device).manual_seed(seed)
    q = torch.randint(-2, 3, q.shape, generator=g, device=q.device).to(q.dtype)
    comp = torch.randint(-2, 3, comp.shape, generator=g, device=q.device).to(comp.dtype)
    return q, comp, table, to_req, vis, pos


def check_ties(ctx: str, rows: int, routes: list[str]) -> list[dict]:
    """Bitwise equality with the radix route and the reference on tied data (no timing)."""
    context = bsp.CONTEXTS[ctx]
    data = tied_problem(context, rows)
    bsp.configure("radix")
    want = bsp.Select(data, context)().clone()
    out = []
    for route in routes:
        bsp.configure(route)
        run = bsp.Select(data, context)
        same = bool(torch.equal(run().clone(), want)) and bool(torch.equal(run().clone(), want))
        cand = run.candidates()
        out.append(dict(ctx=ctx, rows=rows, route=route, data="ties", exact=same and bsp.reference_rows(run, data),
                        cand_max=cand[0], cand_mean=cand[1], overflow=cand[2]))
    return out


def parts(run: "bsp.Select") -> dict:
    """Callables of the candidate launches alone and the deferred resolves alone."""
    chunks = run.launch._chunks

    def cand() -> None:
        for row0, _, topk in chunks:
            crow0 = (row0 - topk.first) % topk.group
            topk._topk(row0, crow0, run.out, run.out.stride(0))

    def resolve() -> None:
        for row0, _, topk in chunks:
            crow0 = (row0 - topk.first) % topk.group
            done = crow0 + topk.rows
            if topk._resolve is not None and (done >= topk.group or row0 + topk.rows >= topk.end):
                topk._resolve(row0 - crow0, done, run.out, run.out.stride(0))

    return dict(cand=cand, resolve=resolve)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128K,1M")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--variants", default="plan")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--ties-rows", type=int, default=0, help="also check tied data with this many rows")
    a = ap.parse_args(argv)
    t0 = time.time()
    stamp = lambda: f"[{time.time() - t0:6.1f}s]"  # noqa: E731
    if a.ncu:
        data = bsp.problem(1 << 20, 128)
        for i, route in enumerate(a.variants.split(",")):
            bsp.configure(route)
            run = bsp.Select(data, 1 << 20)
            for _ in range(1 if i else 2):  # (the first route twice: ncu skips its first call's launches)
                run()
                torch.cuda.synchronize()
        return
    if a.dry:
        a.contexts, a.rows = "dry1,dry2", 24
        timer = lambda fn: (fn(), float("nan"))[1]  # noqa: E731
    else:
        from bench_qsa import GraphTimer

        timer = GraphTimer(reps=10, budget_ms=300)
    results = []
    for ctx in a.contexts.split(",") if a.ties_rows else []:
        for line in check_ties(ctx, a.ties_rows, a.variants.split(",")):
            results.append(line)
            print(f"{stamp()} {ctx:4s} ties {line['rows']}r {line['route']:8s} "
                  f"{'exact' if line['exact'] else 'DIFFERS'} cand {line['cand_max']}/{line['cand_mean']:.0f} "
                  f"ovf {line['overflow']}", flush=True)
    for ctx in a.contexts.split(","):
        context = bsp.CONTEXTS[ctx]
        data = bsp.problem(context, a.rows)
        bsp.configure("radix")
        base = bsp.Select(data, context)
        want = base().clone()
        del base
        for route in a.variants.split(","):
            bsp.configure(route)
            try:
                run = bsp.Select(data, context)
                same = bool(torch.equal(run().clone(), want)) and bool(torch.equal(run().clone(), want))
                exact = same and bsp.reference_rows(run, data)
                cand = run.candidates()
                line = dict(ctx=ctx, rows=a.rows, route=route, exact=exact, chunks=len(run.launch._chunks),
                            group=run.launch._chunks[0][2].group, cand_max=cand[0], cand_mean=cand[1],
                            overflow=cand[2], tiles=run.s.prefill_tiles)
                if exact:
                    p = parts(run)
                    line.update(select=timer(run), scores=timer(run.scores), topk=timer(run.topk),
                                cand=timer(p["cand"]), resolve=timer(p["resolve"]))
            except Exception as exc:
                print(f"{stamp()} {ctx:4s} {route:10s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            results.append(line)
            print(f"{stamp()} {ctx:4s} {a.rows}r {route:8s} {'exact' if exact else 'DIFFERS'} "
                  + " ".join(f"{k} {line[k]:9.1f}" for k in ("select", "scores", "topk", "cand", "resolve")
                             if k in line)
                  + f" us; chunks {line['chunks']} group {line['group']} cand {cand[0]}/{cand[1]:.0f} ovf {cand[2]}",
                  flush=True)
            del run
        del data
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"{stamp()} done", flush=True)


if __name__ == "__main__":
    main()
