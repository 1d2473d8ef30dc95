"""Decode selection for few long rows on the GPU: where a select's time goes (per launch) and
main's route against the sampled route (`select_sampled`), bit-exact first.

Problem per shape: production geometry (indexer 4 x 128, r 4, page 64, Kb 512), shuffled
pages, random data (`problem`); "ties": the same with 1000 scattered groups of each request holding
one key (tripled), so exact ties straddle the boundary. Every figure is the median of
CUDA-graph replays with L2 flushed before each (bench_qsa.GraphTimer).

    python benchmarks/bench_dsel.py [--shapes 128k-b4,...] [--out FILE.json] [--no-breakdown]

Rows per shape: "all" = the whole select (score + top-k, packed rows) in one graph;
"score" = the score launch alone; "topk" = the top-k launches alone over the scores already
in the scratch; "+L<i>" = score and the top-k's first i launches (the increments show what
each launch costs); score tile variants ("score g64 ..."); the sampled route, if importable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import os

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # --dry: the interpreter on tiny shapes
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qsa_kernels import select as sel  # noqa: E402
from qsa_kernels import select_sampled as ssm  # noqa: E402
from qsa_kernels import select_score  # noqa: E402
from qsa_kernels.select_score import ScoreLaunch, ScoreTiles  # noqa: E402
from qsa_core.reference.expand import qsa_expand  # noqa: E402
from qsa_core.reference.select import topk_groups  # noqa: E402

R, PAGE, HI, DI, KB = 4, 64, 4, 128, 512
W = KB * R + R - 1
T0 = time.time()
SHAPES = {  # context, batch, rows per request, key dtype
    "8k-b1": (8192, 1, 1, "bf16"),
    "128k-b4": (131072, 4, 1, "bf16"),
    "128k-b4-fp8": (131072, 4, 1, "fp8"),
    "1m-b4": (1 << 20, 4, 1, "bf16"),
    "1m-b4-fp8": (1 << 20, 4, 1, "fp8"),
    "1m-b4x4": (1 << 20, 4, 4, "bf16"),
    "32k-b4": (32768, 4, 1, "bf16"),
    "128k-b16": (131072, 16, 1, "bf16"),
    "dry-b2": (1024, 2, 1, "bf16"),  # (CPU, Kb 16)
    "dry-b2x2": (1024, 2, 2, "bf16"),
    "dry-short": (128, 2, 1, "bf16"),
}
SCORE_VARIANTS = {  # decode score tiles (block_r, block_g, span, stages, warps)
    "g64 sp64 s1 w4": ScoreTiles(1, 64, 64, 1, 4),
    "g128 sp128 s1 w4": ScoreTiles(1, 128, 128, 1, 4),
    "g128 sp128 s3 w8": ScoreTiles(1, 128, 128, 3, 8),
}
# Overrides of `select_sampled.sampled_tiles` ("seg*2": twice its segment).
NEW_VARIANTS = {"base": {}, "bound8": dict(bound=8), "bound16": dict(bound=16), "bound8 w8": dict(bound=8, warps=8),
                "w8": dict(warps=8), "bits4": dict(bits=4), "seg*2": dict(seg=2), "base early": dict(early=True),
                "bound8 early": dict(bound=8, early=True)}
# Short rows (<= 4096 columns): `select_fused` (scores + top-k in one launch) by warps.
SHORT_VARIANTS = {"fused w4": dict(fused_warps=4), "fused w8": dict(fused_warps=8),
                  "fused w4 early": dict(fused_warps=4, early=True)}
TILES = ssm.sampled_tiles


def set_route(sampled: bool, variant: dict | None = None) -> None:
    """Route few long decode rows to `select_sampled` (variant: tile overrides) and few short
    ones to `select_fused` (variant fused_warps), or neither (main)."""
    v = dict(variant or {})
    select_score.EARLY_LOADS = v.pop("early", False)
    sel._SAMPLED_MAX_ROWS = 16 if sampled else 0
    sel._FUSED_SHORT_MAX_ROWS = 4 if sampled else 0
    sel._FUSED_SHORT_WARPS = v.pop("fused_warps", 4)

    def tiles(num_cols: int, block_topk: int, block_g: int, small: bool) -> dict:
        t = TILES(num_cols, block_topk, block_g, small)
        if "seg" in v:
            t["seg"] *= v["seg"]
            t["lcap"] = min(t["seg"], t["lcap"] * v["seg"])
            t["block"] = min(t["seg"], 4096)
        return {**t, **{k: x for k, x in v.items() if k != "seg"}}

    ssm.sampled_tiles = tiles


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def problem(ctx: int, batch: int, rows: int, dtype: str, ties: bool = False, seed: int = 0):
    """q [T, Hi, Di], compressed [pages, PAGE / R, Di], block_table, token_to_req, visible, positions."""
    dev = torch.device(DEV)
    dt = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    per_req = ctx // PAGE
    table = (torch.randperm(batch * per_req, generator=g, device=dev).view(batch, per_req) + 1).int()
    comp = torch.randn(batch * per_req + 1, PAGE // R, DI, generator=g, device=dev)
    if ties:  # 1000 scattered groups of each request hold one (tripled) key: ties at the boundary
        flat = comp.view(-1, DI)
        for b in range(batch):
            grp = torch.randperm(ctx // R, generator=g, device=dev)[:1000]
            flat[table[b, grp // (PAGE // R)].long() * (PAGE // R) + grp % (PAGE // R)] = 3 * flat[int(table[b, 0]) * (PAGE // R)]
    comp = comp.to(dt)
    pos = torch.arange(ctx - rows, ctx, device=dev).repeat(batch)
    to_req = torch.arange(batch, device=dev).repeat_interleave(rows).int()
    vis = torch.clamp(torch.minimum((pos + 1) // R, torch.tensor(ctx // R, device=dev)), min=0).int()
    q = torch.randn(batch * rows, HI, DI, generator=g, device=dev).to(dt)
    return q, comp, table, to_req, vis, pos


class Select:
    """One select call (plan_select's schedule from a persistent workspace, bound launches)."""

    def __init__(self, data, ctx: int, rows: int, sampled: bool = False, variant: dict | None = None) -> None:
        q, comp, table, to_req, vis, pos = data
        T = q.shape[0]
        self.q, self.table, self.vis, self.pos = q, table, vis, pos
        set_route(sampled, variant)
        ws = sel.select_workspace(T, ctx // R, KB, DEV)
        self.s = sel.plan_select(T, ctx // R, KB, decode=True, device=DEV, workspace=ws, rows_per_request=rows)
        self.out = torch.full((T, W + 1), -7, dtype=torch.int32, device=DEV)
        self.launch = sel.SelectLaunch(self.s, q, comp, table, to_req, vis, self.out, page_size=PAGE,
                                       compress_ratio=R, block_topk=KB, positions=pos)
        (_, self.score, self.topk), = self.launch._chunks  # (topk None: select_fused, one launch)
        self.comp, self.to_req = comp, to_req

    def __call__(self) -> None:
        self.launch(self.q, self.table, self.out)

    def score_only(self) -> None:
        self.score(self.q, self.table, 0)

    def prefix(self, k: int):
        """score + the top-k's first k launches (k None: the top-k launches alone)."""
        def run() -> None:
            if k is not None:
                self.score(self.q, self.table, 0)
            for launch, writes in self.topk._launches[: len(self.topk._launches) if k is None else k]:
                if writes:
                    launch(0, self.out, self.out.stride(0))
                else:
                    launch(0)
        return run

    def describe(self) -> str:
        s = self.s
        if s.fused_short:
            return "select_fused"
        if s.sampled is None:
            return "not the sampled route"
        segp = s.sampled.counts.numel() // max(1, s.chunk)
        cnt = s.sampled.counts[: s.chunk * segp].view(s.chunk, -1)[: self.q.shape[0]]
        tot = cnt.sum(1)
        return (f"tiles {s.sampled_tiles}; candidates per row max {int(tot.max())}, rows over cap "
                f"{int((tot > s.sampled_tiles['cap']).sum())}, lists over lcap {int((cnt > s.sampled_tiles['lcap']).sum())}")

    def reference(self) -> torch.Tensor:
        """The packed rows of the reference top-k over this call's own score scratch."""
        T = self.q.shape[0]
        blocks = topk_groups(self.s.scores[:T], self.vis, KB)
        return qsa_expand(blocks, self.pos, self.vis, compress_ratio=R, out=torch.empty_like(self.out))

    def score_variant(self, tiles: ScoreTiles) -> ScoreLaunch:
        return ScoreLaunch(self.q, self.comp, self.table, self.to_req, self.vis, self.s.scores, row0=0,
                           rows=self.q.shape[0], num_cols=self.s.num_cols, page_size=PAGE, compress_ratio=R,
                           block_topk=KB, decode=True, tiles=self.s.tiles, interpret=False, score=tiles)


def run_shape(key: str, timer, breakdown: bool, results: list, parts: set, variants: list[str],
              warm: bool = False) -> None:
    ctx, batch, rows, dtype = SHAPES[key]
    data = problem(ctx, batch, rows, dtype)
    main = Select(data, ctx, rows) if not warm or parts & {"main", "score"} else None  # (binding compiles)
    if not warm or parts & {"main"}:
        main()
        ok = torch.equal(main.out, main.reference())
        log(f"{key}: main route exact vs reference: {ok}; top-k launches {len(main.topk._launches)}")

    def rec(name: str, us: float) -> None:
        results.append(dict(shape=key, name=name, us=us))
        log(f"{key:12s} {name:28s} {us:8.1f} us")

    if parts & {"main"}:
        rec("main all", timer(main))
        early = Select(data, ctx, rows, variant=dict(early=True))  # main's route, the score's early loads
        early()
        if not warm:
            same = torch.equal(early.out, main.out)
            rec(f"main early all{'' if same else ' DIFFERS'}", timer(early))
            rec("main early score", timer(early.score_only))
        del early
    if breakdown and parts & {"main"}:
        rec("main score", timer(main.score_only))
        rec("main topk alone", timer(main.prefix(None)))
        for k in range(1, len(main.topk._launches)):
            rec(f"main score+L1..{k}", timer(main.prefix(k)))
    if breakdown and parts & {"score"} and rows == 1 and dtype == "bf16":
            for name, t in SCORE_VARIANTS.items():
                try:
                    v = main.score_variant(t)
                    main.s.scores.fill_(float("nan"))
                    v(main.q, main.table, 0)
                    got = main.s.scores.clone()
                    main.s.scores.fill_(float("nan"))
                    main.score_only()
                    same = torch.equal(got.view(torch.int32), main.s.scores.view(torch.int32))
                    rec(f"score {name}{'' if same else ' DIFFERS'}", timer(lambda: v(main.q, main.table, 0)))
                except Exception as exc:  # a variant that does not compile is reported
                    log(f"{key} score {name}: {type(exc).__name__}: {str(exc)[:120]}")
    short = ctx // R <= (32 if DEV == "cpu" else 4096)  # select_topk's short route (the interpreter's tiles)
    if parts & {"new"} and rows <= 4:
        for vname in (list(SHORT_VARIANTS) if short else variants):
            variant = {**NEW_VARIANTS, **SHORT_VARIANTS}[vname]
            try:
                if warm:  # compile only
                    Select(data, ctx, rows, sampled=True, variant=variant)()
                    torch.cuda.synchronize()
                    continue
                for ties in (False, True) if vname in ("base", "fused w4") else (False,):
                    d = data if not ties else problem(ctx, batch, rows, dtype, ties=True)
                    ref = main if not ties else Select(d, ctx, rows)
                    ref()
                    new = Select(d, ctx, rows, sampled=True, variant=variant)
                    new()
                    same = torch.equal(new.out, ref.out)
                    again = (new(), torch.equal(new.out, ref.out))[1]
                    log(f"{key}: sampled {vname} {'(ties) ' if ties else ''}bit-equal to main: {same} / again {again}; "
                        f"{new.describe()}")
                    if not (same and again):
                        break
                    if not ties:
                        rec(f"new {vname} all", timer(new))
                        if breakdown and vname == "base" and new.topk is not None:
                            rec("new score", timer(new.score_only))
                            rec("new topk alone", timer(new.prefix(None)))
                    else:
                        rec(f"new {vname} all (ties)", timer(new))
                        rec("main all (ties)", timer(ref))
            except Exception as exc:
                log(f"{key}: sampled {vname} failed: {type(exc).__name__}: {str(exc)[:300]}")
    del main
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128k-b4,1m-b4,1m-b4x4,8k-b1,128k-b4-fp8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--parts", default="main,score,new", help="main (route + breakdown), score (tile variants), new")
    ap.add_argument("--variants", default=",".join(NEW_VARIANTS), help="of the sampled route (NEW_VARIANTS)")
    ap.add_argument("--variants-at", default="", help="shapes that time every variant (others: --variants-rest)")
    ap.add_argument("--variants-rest", default="base")
    ap.add_argument("--warm", action="store_true", help="compile only (run each launch once, no timing)")
    ap.add_argument("--dry", action="store_true", help="CPU interpreter: tiny shapes, Kb 16, no timing")
    a = ap.parse_args()
    from bench_qsa import GraphTimer

    if a.dry:
        global KB, W
        KB, W = 16, 16 * R + R - 1
        sel._SAMPLED_MIN_COLS = 1
        a.shapes, a.warm = "dry-short,dry-b2,dry-b2x2", True
    if a.warm:
        timer = lambda fn: (fn(), DEV == "cuda" and torch.cuda.synchronize(), float("nan"))[2]  # noqa: E731
    else:
        timer = GraphTimer(flush_l2=True, reps=20, budget_ms=300)
    results: list = []
    for key in a.shapes.split(","):
        try:
            variants = a.variants.split(",")
            if a.variants_at and key not in a.variants_at.split(","):
                variants = a.variants_rest.split(",")
            run_shape(key, timer, not a.no_breakdown, results, set(a.parts.split(",")), variants,
                      warm=a.warm and not a.dry)
        except Exception as exc:
            log(f"{key}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
    log("done")


if __name__ == "__main__":
    main()
