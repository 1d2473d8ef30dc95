"""Short decode selection in one launch (issue 12: `select_short`, QSA_SHORT_FUSED) against
main's two launches (the decode score kernel, then `select_topk`'s short top-k): bit-exact
first, then timed (CUDA-graph replays, L2 flushed before each: `bench_qsa.GraphTimer`).

    python benchmarks/bench_dshort.py [--shapes 8k-b1,...]
    TRITON_INTERPRET=1 python benchmarks/bench_dshort.py --dry --shapes 8k-b1   # CPU: checks only

The problems are the benchmark geometry's (Hi 4, Di 128, r 4, Kb 512, pages of 64, bf16 keys
unless fp8), with random or tie-heavy data. Per shape both routes run through `plan_select` /
`SelectLaunch` into the packed rows (as a step; "mixed" and "ties" also into groups); "fused"
must equal "main" bit for bit in both, twice (the arrival counters left at zero), its score
scratch main's bit for bit (every scored cell), and the reference where the scores are exact
("ties": integer-valued q and keys). Then each exact shape is timed: main,
fused (its tiles: the span doubled while the grid exceeds one wave) and fused-span (main's
score span at any batch, `WAVE_PROGRAMS` lifted).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import Geometry  # noqa: E402

import qsa_kernels.select as sel  # noqa: E402
from qsa_core.reference import select as ref  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_kernels import select_short as ss  # noqa: E402
from qsa_kernels import select_topk as stk  # noqa: E402

G = Geometry()
R, PAGE, KB, HI, DI = G.compress_ratio, G.page_size, G.token_topk // G.compress_ratio, G.index_n_heads, G.index_head_dim
W = G.selection_width  # packed rows [T, W + 1]
# name: (seq_lens, rows per request, data kind, padding rows, timed)
SHAPES = {
    "8k-b1": ([8192], 1, "randn", 0, True),
    "8k-b4": ([8192] * 4, 1, "randn", 0, True),
    "8k-b64": ([8192] * 64, 1, "randn", 0, True),
    "16k-b4": ([16384] * 4, 1, "randn", 0, True),
    # visible 2048 (bound), 512 (== Kb: unscored), 513, 1250, 25, 2047, padding
    "mixed": ([8192, 2048, 2052, 5000, 100, 8190], 1, "randn", 2, True),
    "ties-8k-b4": ([8192, 8000, 6000, 2100], 1, "ties", 1, False),
    "fp8-8k-b4": ([8192] * 4, 1, "fp8", 0, False),
    "16k-b64": ([16384] * 64, 1, "randn", 0, False),
}
TILES = stk.topk_tiles


def dry_tiles() -> None:
    """The H200's top-k tiles under the interpreter too (--dry: its short route takes 2048 columns)."""
    stk.topk_tiles = lambda n, small, rows=1: TILES(n, False, rows)


def make(seq_lens: list[int], rpr: int, kind: str, pad: int, dev: torch.device, seed: int = 0):
    """(q_idx [T, Hi, Di], compressed [pages, PAGE / r, Di], block_table, token_to_req,
    visible, positions int64, num_cols): each request's last rpr positions, pad padding rows."""
    g = torch.Generator().manual_seed(seed)
    B, ppr = len(seq_lens), triton.cdiv(max(seq_lens), PAGE)
    pages = B * ppr + 1
    table = (torch.randperm(pages - 1, generator=g) + 1).to(torch.int32).view(B, ppr)
    shape_k, T = (pages, PAGE // R, DI), B * rpr + pad
    if kind == "ties":
        comp, q = torch.randint(-2, 3, shape_k, generator=g).float(), torch.randint(-2, 3, (T, HI, DI), generator=g).float()
    else:
        comp, q = torch.randn(shape_k, generator=g), torch.randn(T, HI, DI, generator=g)
    dt = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    req, vis, pos = [], [], []
    for i, s in enumerate(seq_lens):
        for j in range(rpr):
            p = s - rpr + j
            req.append(i)
            vis.append(min((p + 1) // R, s // R))
            pos.append(p)
    req, vis, pos = req + [0] * pad, vis + [0] * pad, pos + [-1] * pad
    i32 = dict(dtype=torch.int32, device=dev)
    return (q.to(dt).to(dev), comp.to(dt).to(dev), table.to(dev), torch.tensor(req, **i32),
            torch.tensor(vis, **i32), torch.tensor(pos, dtype=torch.int64, device=dev),
            triton.next_power_of_2(max(seq_lens) // R))


def bind(prob, fused: bool, packed: bool, rpr: int):
    """(launch(), out, schedule) of one route over the problem (its own workspace)."""
    q, comp, table, to_req, vis, pos, cols = prob
    T = q.shape[0]
    ws = sel.select_workspace(T, cols, KB, q.device)
    s = sel.plan_select(T, cols, KB, decode=True, device=q.device, workspace=ws, rows_per_request=rpr,
                        short_fused=fused)
    if fused and s.short is None:
        raise RuntimeError("the plan did not take the fused route")
    out = torch.full((T, W + 1 if packed else KB), -7, dtype=torch.int32, device=q.device)
    launch = sel.SelectLaunch(s, q, comp, table, to_req, vis, out, page_size=PAGE, compress_ratio=R, block_topk=KB,
                              positions=pos if packed else None)
    return (lambda: launch(q, table, out)), out, s


def same_scores(prob, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two score scratches [chunk, num_cols] hold the same bits where scored (rows with
    visible > Kb, columns below it)."""
    vis = prob[4]
    cols = torch.arange(a.shape[1], device=a.device)
    m = (vis[:, None] > KB) & (cols[None, :] < vis[:, None])
    T = vis.shape[0]
    return torch.equal(a[:T].view(torch.int32)[m], b[:T].view(torch.int32)[m])


def check(prob, kind: str, rpr: int, groups: bool) -> list[str]:
    """Names of the failed checks (fused vs main: the packed rows and, groups, the groups;
    twice; the score scratch's bits; the reference on ties)."""
    bad = []
    for packed in (True, False) if groups else (True,):
        fn_m, out_m, sm = bind(prob, False, packed, rpr)
        fn_f, out_f, s = bind(prob, True, packed, rpr)
        fn_m()
        want = out_m.clone()
        for call in range(2):
            out_f.fill_(-7)
            fn_f()
            if not torch.equal(out_f, want):
                bad.append(f"{'packed' if packed else 'groups'} call {call}")
        if packed and not same_scores(prob, sm.scores, s.scores):
            bad.append("scores")
        if not bool((s.short == 0).all()):
            bad.append("counters")
        if kind == "ties":
            q, comp, table, to_req, vis, pos, _ = prob
            blocks = ref.qsa_select_prefill(q.float(), comp.float(), table, to_req, vis, page_size=PAGE,
                                            compress_ratio=R, block_topk=KB,
                                            out=torch.empty(q.shape[0], KB, dtype=torch.int32, device=q.device))
            expect = blocks if not packed else qsa_expand(blocks, pos, vis, compress_ratio=R,
                                                          out=torch.empty_like(out_m))
            if not torch.equal(want, expect):
                bad.append(f"reference {'packed' if packed else 'groups'}")
    return bad


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dry", action="store_true", help="CPU, TRITON_INTERPRET=1: checks only, no timing")
    args = ap.parse_args(argv)
    t0 = time.time()
    stamp = lambda: f"[{time.time() - t0:6.1f}s]"  # noqa: E731
    dev = torch.device("cpu" if args.dry else "cuda")
    timer = None
    if args.dry:
        dry_tiles()
    else:
        from bench_qsa import GraphTimer

        timer = GraphTimer(flush_l2=True, reps=15, budget_ms=200)
    rows = []
    for key in args.shapes.split(","):
        seqs, rpr, kind, pad, timed = SHAPES[key]
        prob = make(seqs, rpr, kind, pad, dev)
        try:
            bad = check(prob, kind, rpr, groups=kind == "ties" or key == "mixed")
        except Exception as exc:  # keep the other shapes' figures
            bad = [f"failed: {type(exc).__name__}: {str(exc)[:300]}"]
        line = dict(shape=key, bits="exact" if not bad else "DIFFERS " + ",".join(bad))
        if not bad and timed and timer is not None:
            line["main"] = timer(bind(prob, False, True, rpr)[0])
            line["fused"] = timer(bind(prob, True, True, rpr)[0])
            wave, ss.WAVE_PROGRAMS = ss.WAVE_PROGRAMS, 1 << 30
            try:
                line["fused-span"] = timer(bind(prob, True, True, rpr)[0])
            finally:
                ss.WAVE_PROGRAMS = wave
        rows.append(line)
        print(f"{stamp()} " + " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in line.items()), flush=True)
        del prob
    print("\nselect (score + top-k, packed rows), us, CUDA-graph median, L2 flushed")
    print(f"{'shape':14s} {'main':>8s} {'fused':>8s} {'f-span':>8s} {'gain':>7s}  bits")
    for r in rows:
        f = lambda k: f"{r[k]:8.1f}" if k in r else f"{'-':>8s}"  # noqa: E731
        gain = f"{r['main'] - min(r['fused'], r['fused-span']):7.1f}" if "main" in r else f"{'-':>7s}"
        print(f"{r['shape']:14s} {f('main')} {f('fused')} {f('fused-span')} {gain}  {r['bits']}")
    print(f"{stamp()} done", flush=True)


if __name__ == "__main__":
    main()
