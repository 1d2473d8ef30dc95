"""GPU sweep of the prefill sparse attention: the shared-tile kernels (`attention_prefill.py`) at
several launch configurations against the per-row kernel (`attention.py`), on 16K-row chunks
(the last 16K positions) at 16K and 128K context, bf16, Hq 24 / Hkv 2 / D 256, page 64, r 4, K 2048.

Selections (synthetic, seeded), packed as the top-k writes them (`qsa_expand`: the chosen groups
ascending, then the open tail); rows seeing <= 512 groups choose them all:
- random: the top 512 of iid uniform scores over the row's visible groups.
- indexer: the top 512 of the indexer's scores (sum over 4 heads of relu(q . k)) of iid N(0, 1)
  queries and pooled keys, as bench_qsa.py's table data (neighbour overlap 0.30 at 16K, 0.02 at 128K).
- overlap L: the top 512 of a Gaussian score field correlated along positions:
  s_t(g) = cos(th) U_a(g) + sin(th) U_{a+1}(g), a = t // L, th = pi/2 (t % L) / L, U_a iid N(0, 1).
Reported per data set: the measured neighbour overlap (`bench_qsa.neighbour_overlap` over every
pair of neighbouring rows, the table's definition since session 22: complete groups, rows that
choose fewer groups than they see) and, for blocks of 2, 5 and 10 rows, the union / sum of the
rows' groups (tails included).

Every variant is checked before it is timed: against the reference on sampled rows and against
the per-row kernel on all rows (2e-2 of the largest output). Timing: median of CUDA-graph replays,
L2 flushed before each (bench_qsa.GraphTimer). Kernels compile first in parallel processes.

    python benchmarks/sweep_prefill_attention.py [--out results.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qsa_core.reference.attention import qsa_sparse_attention as ref_attention  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402

HQ, HKV, D, PAGE, R, KB = 24, 2, 256, 64, 4, 512
IDX_H, IDX_D = 4, 128
W = KB * R + R - 1
ROWS = 16384
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# name: (block_rows, BLOCK_G, num_warps, num_stages, max_union_ratio[, per-row (BLOCK_N, warps, stages)]);
# None: attention.py per row. "rows": ratio 0, every block per row (this module's per-row kernel).
VARIANTS = {
    "per-row": None,
    "auto": (5, 8, 4, 3, 0.3),
    "auto r0.25": (5, 8, 4, 3, 0.25),
    "shared b5 g8 w4 s3": (5, 8, 4, 3, 1e9),
    "rows": (5, 8, 4, 3, 0.0),
}
# (context, data, L), most wanted first (a run cut by its time limit keeps the first ones).
CASES = [(16384, "indexer", 0), (16384, "overlap", 8), (16384, "overlap", 32), (131072, "indexer", 0),
         (131072, "overlap", 8), (131072, "overlap", 32)]


def selections(context: int, rows: int, data: str, L: int, seed: int) -> torch.Tensor:
    """Packed rows int32 [rows, W + 1] of the last `rows` positions of one request."""
    dev = torch.device(DEV)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pos = torch.arange(context - rows, context, device=dev)
    vis = (pos + 1) // R
    ng = context // R
    blocks = torch.empty(rows, KB, dtype=torch.int32, device=dev)
    U = torch.randn(rows // max(L, 1) + 2, ng, device=dev, generator=gen) if data == "overlap" else None
    keys = torch.randn(ng, IDX_D, device=dev, generator=gen) if data == "indexer" else None
    cols = torch.arange(ng, device=dev)[None, :]
    for c in range(0, rows, 1024):
        t = torch.arange(c, min(c + 1024, rows), device=dev)
        if keys is not None:
            qi = torch.randn(t.numel() * IDX_H, IDX_D, device=dev, generator=gen)
            s = (qi @ keys.T).relu_().view(t.numel(), IDX_H, ng).sum(1)
        elif U is None:
            s = torch.rand(t.numel(), ng, device=dev, generator=gen)
        else:
            th = (t % L).float()[:, None] * (math.pi / 2 / L)
            s = torch.cos(th) * U[t // L] + torch.sin(th) * U[t // L + 1]
        s = torch.where(cols < vis[t, None], s, float("-inf"))
        top = s.topk(KB, dim=1).indices
        top = torch.where(top < vis[t, None], top, ng).sort(dim=1).values
        blocks[t] = torch.where(top < ng, top, -1).int()
    out = torch.empty(rows, W + 1, dtype=torch.int32, device=dev)
    return qsa_expand(blocks, pos, vis.int(), compress_ratio=R, out=out)


def group_sets(sel: torch.Tensor, ng: int, rows: slice) -> torch.Tensor:
    """bool [n, ng]: the groups (tail included) each row of `rows` holds."""
    part = sel[rows]
    n = part.shape[0]
    toks = part[:, :W].long()
    valid = torch.arange(W, device=sel.device)[None, :] < part[:, W:].long()
    m = torch.zeros(n, ng + 1, dtype=torch.bool, device=sel.device)
    m.scatter_(1, torch.where(valid, toks // R, ng), True)
    return m[:, :ng]


def overlap_stats(sel: torch.Tensor, context: int) -> dict:
    """Neighbour overlap (`bench_qsa.neighbour_overlap`, every pair; the rows are the last
    sel.shape[0] positions of one request of `context` tokens) and, for blocks of 2, 5 and 10
    rows, union / sum of the rows' groups."""
    from bench_qsa import neighbour_overlap

    n = sel.shape[0]
    visible = (torch.arange(context - n, context, device=sel.device) + 1) // R
    return {"overlap": neighbour_overlap(sel, visible.int(), max_pairs=n - 1),
            "union_over_sum": union_over_sum(sel, context, 5), "union2_over_sum": union_over_sum(sel, context, 2),
            "union10_over_sum": union_over_sum(sel, context, 10)}


def union_over_sum(sel: torch.Tensor, context: int, block_rows: int) -> float:
    """Over blocks of block_rows neighbouring rows: |union of their groups| / sum of |groups|."""
    ng = context // R + 1
    union, total = 0, 0
    for c in range(0, sel.shape[0], 1000):
        m = group_sets(sel, ng, slice(c, c + 1000))
        for b in range(0, m.shape[0] - block_rows + 1, block_rows):
            union += int(m[b:b + block_rows].any(0).sum())
            total += int(m[b:b + block_rows].sum())
    return union / max(total, 1)


def problem(context: int, data: str, L: int, seed: int = 0, rows: int | None = None):
    """(q, gate, k, v, block_table, token_to_req, seq_lens, selection) of one request's last rows."""
    rows = rows or ROWS
    dev = torch.device(DEV)
    torch.manual_seed(seed)
    pages = context // PAGE
    k = torch.randn(pages + 1, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(pages + 1, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    table = (torch.randperm(pages, device=dev) + 1).int()[None, :]
    q = torch.randn(rows, HQ, D, device=dev, dtype=torch.bfloat16)
    gate = torch.randn(rows, HQ, D, device=dev, dtype=torch.bfloat16)
    to_req = torch.zeros(rows, dtype=torch.int32, device=dev)
    seq = torch.tensor([context], dtype=torch.int32, device=dev)
    return q, gate, k, v, table, to_req, seq, selections(context, rows, data, L, seed)


def runner(name: str, prob, out: torch.Tensor):
    """A no-argument callable running variant `name` on prob into out, and its prefill schedule."""
    from qsa_kernels import attention as per_row
    from qsa_kernels import attention_prefill as pre

    cfg = VARIANTS[name]
    T = prob[0].shape[0]
    if cfg is None:
        sched = per_row.plan_attention(T, HQ, HKV, D, W, device=DEV, context=int(prob[6].max()))  # the planner's shape
        bound = per_row.AttentionLaunch(*prob, softmax_scale=D**-0.5, out=out, schedule=sched)
        return (lambda: bound(prob[0], prob[1], prob[4], prob[5], prob[6], prob[7], out)), None
    br, bg, warps, stages, ratio = cfg[:5]
    sched = pre.plan_prefill_attention(T, HQ, HKV, D, W, R, device=DEV, block_rows=br, max_union_ratio=ratio,
                                       launch=(bg, warps, stages), row_launch=cfg[5] if len(cfg) > 5 else None,
                                       context=int(prob[6].max()))
    bound = pre.PrefillAttentionLaunch(*prob, softmax_scale=D**-0.5, out=out, schedule=sched)
    return (lambda: bound(prob[0], prob[1], prob[4], prob[5], prob[6], prob[7], out)), sched


def _compile_one(name: str) -> str:
    t0 = time.time()
    prob = problem(4096, "overlap", 8, rows=512)
    out = torch.empty(512, HQ * D, device=DEV, dtype=torch.bfloat16)
    fn, _ = runner(name, prob, out)
    fn()
    torch.cuda.synchronize()
    return f"{name}: compiled in {time.time() - t0:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="16K context, 2 variants (a smoke run)")
    args = ap.parse_args()
    from bench_qsa import GraphTimer

    t_start = time.time()
    names = list(VARIANTS) if not args.quick else ["per-row", "auto"]
    with mp.get_context("spawn").Pool(min(len(names), 8)) as pool:
        for line in pool.map(_compile_one, names):
            print(line, flush=True)
    print(f"compiles done at {time.time() - t_start:.0f} s", flush=True)
    timer = GraphTimer(flush_l2=True, reps=15)
    results, summary = [], []
    for context, data, L in CASES if not args.quick else CASES[:1]:
        prob = problem(context, data, L)
        stats = overlap_stats(prob[7], context)
        label = f"{context // 1024}K {data}" + (f" L{L}" if L else "")
        ref_rows = torch.cat([torch.arange(0, 40), torch.arange(ROWS // 2, ROWS // 2 + 40),
                              torch.arange(ROWS - 40, ROWS)]).to(DEV)
        sub = tuple(x[ref_rows] if i in (0, 1, 5, 7) else x for i, x in enumerate(prob))
        want = ref_attention(*sub, softmax_scale=D**-0.5).float()
        base = None
        row = {"case": label, **stats}
        for name in names:
            out = torch.full((ROWS, HQ * D), float("nan"), device=DEV, dtype=torch.bfloat16)
            fn, sched = runner(name, prob, out)
            fn()
            torch.cuda.synchronize()
            got = out.float()
            err_ref = ((got[ref_rows] - want).abs().max() / want.abs().max()).item()
            if base is None:
                base = got
            err_row = ((got - base).abs().max() / base.abs().max()).item()
            ok = err_ref <= 2e-2 and err_row <= 2e-2 and bool(torch.isfinite(got).all())
            shared = float((sched.info[:, 0] >= 0).float().mean()) if sched is not None else 0.0
            us = timer(fn) if ok else float("nan")
            row[name] = {"us": us, "err_ref": err_ref, "err_per_row": err_row, "shared_blocks": shared}
            if name == "shared b5 g8 w4 s3":  # every block shared: the run counts
                row["union_groups"] = int(sched.info[:, 0].clamp(min=0).sum())
                row["row_groups"] = int(((prob[7][:, W].long() + R - 1) // R).sum())
            print(f"{label:22s} {name:20s} {us / 1e3:7.3f} ms  err {err_ref:.1e}/{err_row:.1e} "
                  f"shared {shared:.2f}", flush=True)
            del out, got
        # the union pass alone (one variant's first launch)
        fn, sched = runner("auto", prob, torch.empty(ROWS, HQ * D, device=DEV, dtype=torch.bfloat16))
        import qsa_kernels.attention_prefill as pre
        bound = pre.PrefillAttentionLaunch(*prob, softmax_scale=D**-0.5, out=torch.empty(
            ROWS, HQ * D, device=DEV, dtype=torch.bfloat16), schedule=sched)
        union_launch = bound._launches[0][0]
        row["union_pass_us"] = timer(lambda p=prob: union_launch(p[5], p[6], p[7], p[4], p[7].stride(0),
                                                                 p[4].stride(0), p[4].stride(1)))
        results.append(row)
        best = min((n for n in names if n != "per-row"), key=lambda n: row[n]["us"])
        summary.append(f"{label:20s} ov {stats['overlap']:.2f} u2 {stats['union2_over_sum']:.2f} "
                       f"u5 {stats['union_over_sum']:.2f} u10 {stats['union10_over_sum']:.2f} | "
                       f"per-row {row['per-row']['us'] / 1e3:.2f} auto {row['auto']['us'] / 1e3:.2f} "
                       f"best {best} {row[best]['us'] / 1e3:.2f} ms | union {row['union_pass_us']:.0f} us")
        print(summary[-1], flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        del prob
        torch.cuda.empty_cache()
    print(f"total {time.time() - t_start:.0f} s")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
