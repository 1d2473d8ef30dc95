"""Prefill selection split by launch (issue 12): score launches alone, the candidate launches
alone, the deferred resolves alone, the top-k part, the whole select in one graph; main's
`select_prefill` route against this tree's variants, bit-exact first.

    python benchmarks/bench_psel.py [--contexts 128K,1M] [--rows 16384] [--variants plan] [--out F.json]
    python benchmarks/bench_psel.py --ncu [--variants plan,skip]  # selects of 128 rows at 1M (for ncu, eager)
    python benchmarks/bench_psel.py --sweep all [--sweep-rows 64,256,1024] [--warm-only]  # score launches alone
    python benchmarks/bench_psel.py --scratch-mib 256 ...   # chunks of more rows (a larger score scratch)
    TRITON_INTERPRET=1 python benchmarks/bench_psel.py --dry [--sweep ...]   # CPU: tiny shapes, checks only

Problem and variants as `bench_select_prefill` (one request of `rows` rows at the end of its
context, packed rows; "tp": two-pass scores, whose parts pass1 / bound / pass2 are also timed).
The sweep (`SWEEP`) times one chunk's score launch per variant (what the fp32 store, the samples,
the tiles and the chunk rows cost), its samples and scores checked bit for bit against main's. Before timing, a variant's packed rows must equal the radix route's
bit for bit and the last chunk's the reference. Times: median us of CUDA-graph replays, L2
flushed before each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_select_prefill as bsp  # noqa: E402
from qsa_kernels import select_prefill as sp  # noqa: E402


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
    base = bsp.Select(data, context)
    want, want_scores = base().clone(), bsp.last_scores(base)
    del base
    out = []
    for route in routes:
        bsp.configure(route)
        run = bsp.Select(data, context)
        same = bool(torch.equal(run().clone(), want)) and bool(torch.equal(run().clone(), want))
        cand = run.candidates()
        out.append(dict(ctx=ctx, rows=rows, route=route, data="ties",
                        exact=same and bsp.reference_rows(run, data, want_scores),
                        cand_max=cand[0], cand_mean=cand[1], overflow=cand[2]))
    return out


def parts(run: "bsp.Select") -> dict:
    """Callables of the candidate launches alone and the deferred resolves alone (two-pass:
    also its samples pass, bound launches and live-runs pass alone)."""
    chunks = run.launch._chunks
    passes = {}
    if isinstance(chunks[0][1], sp.TwoPassScores):
        passes = dict(pass1=lambda: [sc.first(run.q, run.table, r) for r, sc, _ in chunks],
                      bound=lambda: [sc.bound(r) for r, sc, _ in chunks],
                      pass2=lambda: [sc.second(run.q, run.table, r) for r, sc, _ in chunks])

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

    return dict(cand=cand, resolve=resolve, **passes)


# Score-launch sweep (issue 12's profile): name -> (ScoreTiles changes, store, split). store 1:
# the scores (main), 0: samples only (two-pass's first pass), 2: only runs reaching the bound;
# split: 0 no samples, 1 runs of the planned S columns, k runs of S / k (checked: k-run maxima).
SWEEP = {
    "main": ({}, 1, 1), "nosamp": ({}, 1, 0), "pass1": ({}, 0, 1), "pass2": ({}, 2, 1),
    "p1_w8": (dict(num_warps=8), 0, 1), "p1_g128": (dict(block_g=128), 0, 1),
    "p1_r64": (dict(block_r=64), 0, 1), "p1_st2": (dict(stages=2), 0, 1), "p1_st4": (dict(stages=4), 0, 1),
    "p1_sp2k": (dict(span=2048), 0, 1), "main_sp2k": (dict(span=2048), 1, 1),
    "main_w8": (dict(num_warps=8), 1, 1), "main_g128": (dict(block_g=128), 1, 1),
    "p1_s4": ({}, 0, 4), "main_s4": ({}, 1, 4),
}


def sweep_launch(name: str, ctx: str, rows: int, data, bufs: dict):
    """The score launch of sweep variant `name` for the last `rows` rows of `data` (a chunk);
    bufs: scores fp32 [rows, cols], samples int32, bounds int32 (reused)."""
    from types import SimpleNamespace

    from qsa_kernels import select as sel
    from qsa_kernels.select_score import ScoreLaunch, score_tiles

    changes, store, split = SWEEP[name]
    q, comp, table, to_req, vis, _ = data
    cols = bsp.CONTEXTS[ctx] // bsp.R
    base = score_tiles(False, sel._tiles(False), bsp.DRY)
    t = dataclasses.replace(base, **changes)
    S = sp.sample_cols(sp.prefill_tiles(cols, bsp.KB, base.block_g, small=bsp.DRY), base.block_g)
    row0 = q.shape[0] - rows
    launch = ScoreLaunch(q, comp, table, to_req, vis, bufs["scores"], row0=row0, rows=rows, num_cols=cols,
                         page_size=bsp.PAGE, compress_ratio=bsp.R, block_topk=bsp.KB, decode=False,
                         tiles=sel._tiles(False), interpret=bsp.DRY, score=t,
                         samples=bufs[f"samples{split}"] if split else None,
                         sample_sub=t.block_g * split // S if split else 0,
                         store=store, bounds=bufs["bounds"] if store == 2 else None)
    bound = sp.RowBoundLaunch(bufs["samples1"], vis, SimpleNamespace(bound=bufs["bounds"]), row0=row0, rows=rows,
                              num_cols=cols, block_topk=bsp.KB,
                              tiles=sp.prefill_tiles(cols, bsp.KB, base.block_g, small=bsp.DRY),
                              score_block_g=base.block_g)
    return (lambda: launch(q, table, row0)), (lambda: bound(row0)), launch


def kernel_info(launch, q: torch.Tensor, table: torch.Tensor, row0: int) -> dict:
    """Registers, spills, shared memory and wgmma count of a ScoreLaunch's compiled kernel
    (called with q, table, row0)."""
    bl = launch._launch
    values = list(bl.values)
    for i, x in zip(bl.free_index, (q, table, row0, *q.stride(), *table.stride())):
        values[i] = x
    try:
        k = bl.launcher.compiled(bl.grid, values, bl.options)
        k._init_handles()
        return dict(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                    wgmma=k.asm["ptx"].count("wgmma.mma_async"), grid=list(bl.grid))
    except Exception as exc:  # (informative only)
        return dict(info=f"{type(exc).__name__}: {str(exc)[:120]}", grid=list(bl.grid))


def sweep_bufs(ctx: str, rows: int) -> dict:
    """Buffers of the sweep's launches: scores, samples (runs of the planned S), bounds."""
    from qsa_kernels import select as sel

    cols = bsp.CONTEXTS[ctx] // bsp.R
    g = sel._score_block_g()
    n = -(-cols // sp.sample_cols(sp.prefill_tiles(cols, bsp.KB, g, small=bsp.DRY), g))
    return dict(scores=torch.empty(rows, cols, dtype=torch.float32, device=bsp.DEV),
                **{f"samples{k}": torch.full((rows, n * k), -1, dtype=torch.int32, device=bsp.DEV) for k in (1, 4)},
                bounds=torch.zeros(rows, dtype=torch.int32, device=bsp.DEV))


def _sweep_warm(args) -> str:
    """Compile sweep variants of a context (a worker process)."""
    ctx, names = args
    try:
        data = bsp.problem(bsp.CONTEXTS[ctx], 64)
        bufs = sweep_bufs(ctx, 64)
        for n in names:
            sweep_launch(n, ctx, 64, data, bufs)
        return ""
    except Exception as exc:
        return f"{ctx} {names}: {type(exc).__name__}: {str(exc)[:300]}"


def score_sweep(ctxs: list[str], names: list[str], rows_list: list[int], timer, stamp) -> list[dict]:
    """Per context and chunk rows: each variant's score launch alone (us per chunk and ms per
    16384 rows), its samples and stored scores bit-equal to main's (the live runs for pass2)."""
    out = []
    for ctx in ctxs:
        cols = bsp.CONTEXTS[ctx] // bsp.R
        data = bsp.problem(bsp.CONTEXTS[ctx], max(rows_list))
        for rows in rows_list:
            bufs = sweep_bufs(ctx, rows)
            fn, bound, _ = sweep_launch("main", ctx, rows, data, bufs)
            bufs["scores"].fill_(float("nan"))  # (cells no launch writes compare equal)
            fn()
            want_s, want_p = bufs["scores"].clone(), bufs["samples1"].clone()
            bound()
            for name in names:
                if SWEEP[name][1] == 1 and rows * cols * 4 > (4 << 30):
                    continue
                bufs["scores"].fill_(float("nan"))
                for k in (1, 4):
                    bufs[f"samples{k}"].fill_(-1)
                if SWEEP[name][1] == 2:
                    bufs["samples1"].copy_(want_p)
                try:
                    fn, _, launch = sweep_launch(name, ctx, rows, data, bufs)
                    fn()
                    store, split = SWEEP[name][1], SWEEP[name][2]
                    exact = not split or bool(torch.equal(
                        bufs[f"samples{split}"].view(rows, -1, split).amax(-1), want_p))
                    if store == 1:
                        same = bool(torch.equal(bufs["scores"].view(torch.int32), want_s.view(torch.int32)))
                        if not same:
                            print(f"{stamp()} sweep {ctx} {rows}r {name}: scores differ", flush=True)
                        exact &= same
                    if store == 2:
                        got = bufs["scores"]
                        written = ~torch.isnan(got)
                        exact &= bool(torch.equal(got[written].view(torch.int32), want_s[written].view(torch.int32)))
                        line_written = float(written.float().mean())
                    us = timer(fn)
                    line = dict(ctx=ctx, rows=rows, variant=name, exact=exact, us=us, ms_16k=us * 16384 / rows / 1e3,
                                **kernel_info(launch, data[0], data[2], data[0].shape[0] - rows))
                    if store == 2:
                        line["written"] = line_written
                    if name == "main":
                        line["bound_us"] = timer(bound)
                except Exception as exc:
                    print(f"{stamp()} sweep {ctx} {rows}r {name} failed: {type(exc).__name__}: {str(exc)[:300]}",
                          flush=True)
                    continue
                out.append(line)
                print(f"{stamp()} sweep {ctx:4s} {rows:5d}r {name:9s} {'exact' if exact else 'DIFFERS'} "
                      f"{us:9.1f} us/chunk {line['ms_16k']:7.2f} ms/16K rows "
                      + " ".join(f"{k} {line[k]}" for k in ("regs", "spills", "shared", "wgmma", "grid", "written",
                                                              "bound_us", "info") if k in line), flush=True)
            del bufs
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128K,1M")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--variants", default="plan")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--ties-rows", type=int, default=0, help="also check tied data with this many rows")
    ap.add_argument("--sweep", default="", help="score-launch variants (SWEEP names, 'all'): that sweep only")
    ap.add_argument("--sweep-rows", default="64,1024", help="chunk rows of the sweep")
    ap.add_argument("--warm-only", action="store_true", help="with --sweep: compile its variants in parallel")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--scratch-mib", type=int, default=0, help="score scratch cap (MiB; chunk rows), else the plan's")
    a = ap.parse_args(argv)
    if a.scratch_mib:
        from qsa_kernels import select as sel

        sel.SCORE_SCRATCH_BYTES = a.scratch_mib << 20
    t0 = time.time()
    stamp = lambda: f"[{time.time() - t0:6.1f}s]"  # noqa: E731
    if a.sweep:
        names = list(SWEEP) if a.sweep == "all" else a.sweep.split(",")
        if a.warm_only:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            work = [(c, [n]) for c in a.contexts.split(",") for n in names]
            with ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn")) as pool:
                errors = [e for e in pool.map(_sweep_warm, work) if e]
            print(f"{stamp()} sweep compiled {len(work)}; failed: {errors or 'none'}", flush=True)
            return
        if a.dry:
            timer = lambda fn: (fn(), float("nan"))[1]  # noqa: E731
        else:
            from bench_qsa import GraphTimer

            timer = GraphTimer(reps=10, budget_ms=200)
        res = score_sweep(a.contexts.split(","), names, [int(x) for x in a.sweep_rows.split(",")], timer, stamp)
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
        print(f"{stamp()} done", flush=True)
        return
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
        want, want_scores = base().clone(), bsp.last_scores(base)
        del base
        for route in a.variants.split(","):
            bsp.configure(route)
            try:
                run = bsp.Select(data, context)
                same = bool(torch.equal(run().clone(), want)) and bool(torch.equal(run().clone(), want))
                exact = same and bsp.reference_rows(run, data, want_scores)
                cand = run.candidates()
                line = dict(ctx=ctx, rows=a.rows, route=route, exact=exact, chunks=len(run.launch._chunks),
                            scratch_mib=a.scratch_mib or 64,
                            group=run.launch._chunks[0][2].group, cand_max=cand[0], cand_mean=cand[1],
                            overflow=cand[2], tiles=run.s.prefill_tiles)
                if exact:
                    p = parts(run)
                    line.update(select=timer(run), scores=timer(run.scores), topk=timer(run.topk),
                                **{k: timer(fn) for k, fn in p.items()})
            except Exception as exc:
                print(f"{stamp()} {ctx:4s} {route:10s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            results.append(line)
            print(f"{stamp()} {ctx:4s} {a.rows}r {route:8s} {'exact' if exact else 'DIFFERS'} "
                  + " ".join(f"{k} {line[k]:9.1f}" for k in ("select", "scores", "topk", "cand", "resolve", "pass1",
                                                              "bound", "pass2")
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
