"""Decode score launch alone under tile variants (issue 12): where its time goes at long context.

    python benchmarks/sweep_decode_scores.py [--shapes 1m-b4,1m-b4-fp8,128k-b4,128k-b64] [--variants ...]
    TRITON_INTERPRET=1 python benchmarks/sweep_decode_scores.py --dry     # CPU: checks only

bench_qsa's geometry (indexer 4 x 128, r 4, page 64; random keys in pages of one shuffled pool);
one row per request, or 4 (an MTP shape, "x4": a request's rows see cols - 3 .. cols groups).
Each variant is a `select_score.ScoreTiles` (one-row shapes: block_g, span in tiles, stages,
warps, max registers; MTP shapes: the packed kernel's tiles, `PACKED`) and, one row per
request, optionally the per-row samples of the decode route (`row_samples`); its scores are
compared with the default tiles' bit for bit (and its samples with the default samples
launch's; "exact" column, a different body such as session 15's keys-on-M try may differ in the
last bit) and it is timed: CUDA-graph replay median, L2 flushed before each replay. Bytes: the compressed keys
each request reads once, so GB/s is the launch's share of the HBM bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qsa_kernels import select_score as ss  # noqa: E402

K, M = 1 << 10, 1 << 20
PAGE, R, DI, HI, KB = 64, 4, 128, 4, 512
# name: (requests, context tokens, index dtype[, rows per request])
SHAPES = {
    "1m-b4": (4, M, torch.bfloat16), "1m-b4-fp8": (4, M, torch.float8_e4m3fn),
    "128k-b4": (4, 128 * K, torch.bfloat16), "128k-b64": (64, 128 * K, torch.bfloat16),
    "1m-b4x4": (4, M, torch.bfloat16, 4), "128k-b16x4": (16, 128 * K, torch.bfloat16, 4),
    "128k-b4-fp8": (4, 128 * K, torch.float8_e4m3fn), "128k-b64-fp8": (64, 128 * K, torch.float8_e4m3fn),
    "tiny": (3, 4096, torch.bfloat16), "tinyx4": (3, 4096, torch.bfloat16, 4),
}
# name: (block_g, span tiles, stages, warps, max regs, row samples[, fast division])
VARIANTS = {
    "g128s1": (128, 1, 3, 4, 0, 0), "g128s2": (128, 2, 3, 4, 0, 0), "g128s4": (128, 4, 3, 4, 0, 0),
    "g128s8": (128, 8, 3, 4, 0, 0), "g128s2st2": (128, 2, 2, 4, 0, 0), "g128s4st4": (128, 4, 4, 4, 0, 0),
    "g64s1": (64, 1, 3, 4, 0, 0), "g64s2": (64, 2, 3, 4, 0, 0), "g64s4": (64, 4, 3, 4, 0, 0),
    "g64s8": (64, 8, 3, 4, 0, 0), "g64s2w2": (64, 2, 3, 2, 0, 0), "g128s1w8": (128, 1, 3, 8, 0, 0),
    "g128s2w8": (128, 2, 3, 8, 0, 0), "g256s1w8": (256, 1, 3, 8, 0, 0), "g128s1r64": (128, 1, 3, 4, 64, 0),
    "samp": (128, 1, 3, 4, 0, 1), "samp-r64": (128, 1, 3, 4, 64, 1), "samp-g64s2": (64, 2, 3, 4, 0, 1),
    # (..., the Markstein division)
    "g128s1fd": (128, 1, 3, 4, 0, 0, True), "g128s2fd": (128, 2, 3, 4, 0, 0, True),
    "samp-r64-fd": (128, 1, 3, 4, 64, 1, True), "g128s2st2fd": (128, 2, 2, 4, 0, 0, True),
    "samp-s2-r64-fd": (128, 2, 3, 4, 64, 1, True), "samp-s4-r64-fd": (128, 4, 3, 4, 64, 1, True),
    "samp-s2st2-r64-fd": (128, 2, 2, 4, 64, 1, True), "samp-s4st2-r64-fd": (128, 4, 2, 4, 64, 1, True),
    "samp-s2st4-r64-fd": (128, 2, 4, 4, 64, 1, True), "samp-s4st4-r64-fd": (128, 4, 4, 4, 64, 1, True),
    "samp-s4st2-r80-fd": (128, 4, 2, 4, 80, 1, True), "samp-s4st2-r96-fd": (128, 4, 2, 4, 96, 1, True),
    "samp-s2st2-r80-fd": (128, 2, 2, 4, 80, 1, True), "samp-s2st2-r96-fd": (128, 2, 2, 4, 96, 1, True),
    "samp-s8st2-r64-fd": (128, 8, 2, 4, 64, 1, True), "samp-s4st3-r64-fd": (128, 4, 3, 4, 64, 1, True),
    "samp-s2st3-r64-fd": (128, 2, 3, 4, 64, 1, True),
    # session 19: 256-column tiles (fp8 keys: a tile's 32 KB in flight, as bf16's 128 columns)
    "s4st2fd": (128, 4, 2, 4, 0, 0, True), "s2st2fd": (128, 2, 2, 4, 0, 0, True),
    "g256s1st2fd": (256, 1, 2, 4, 0, 0, True), "g256s2st2fd": (256, 2, 2, 4, 0, 0, True),
    "g256s1st3fd": (256, 1, 3, 4, 0, 0, True), "g256s2st2w8fd": (256, 2, 2, 8, 0, 0, True),
    "g256s1st2r96fd": (256, 1, 2, 4, 96, 0, True), "samp-g256s2st2-r64-fd": (256, 2, 2, 4, 64, 1, True),
    "samp-g256s1st2-r96-fd": (256, 1, 2, 4, 96, 1, True),
}
# MTP shapes: name: ScoreTiles fields (their samples come from select_prefill's sample launch).
# "km": the packed kernel, 4 rows x 4 heads on the wgmma's N, the keys on its M (prefill's body; the
# route of mixed steps); "rq": the request-rows kernel (decode-only steps, `select_score.MTP_TILES`);
# "row1": the one-row kernel per row (a bitwise cross-check).
_KM = dict(block_r=4, block_g=128, span=0, stages=3, num_warps=4, pack=True, whole=True, fast_div=True)
_RQ = dict(block_r=1, block_g=128, span=128, stages=3, num_warps=4, request_rows=True)
PACKED = {
    "km": _KM, "km-s1": dict(_KM, span=128),
    "rq": _RQ, "rq-s2": dict(_RQ, span=256), "rq-s4": dict(_RQ, span=512),
    "rq-st2": dict(_RQ, stages=2), "rq-s2st2": dict(_RQ, span=256, stages=2),
    "rq-w8": dict(_RQ, num_warps=8), "rq-g64s2": dict(_RQ, block_g=64, span=128),
    "row1": dict(block_r=1, block_g=128, span=128, stages=3, num_warps=4),
    "rq-fd": dict(_RQ, fast_div=True), "rq-fd-s2st2": dict(_RQ, fast_div=True, span=256, stages=2),
    "rq-fd-s2": dict(_RQ, fast_div=True, span=256),
    "km-st2": dict(_KM, stages=2), "km-st4": dict(_KM, stages=4), "km-g64": dict(_KM, block_g=64),
    "km-r128": dict(_KM, max_regs=128), "km-s2": dict(_KM, span=256), "km-s4": dict(_KM, span=512),
}


class Problem:
    """Caches and queries of `requests` decode rows at `context` tokens."""

    def __init__(self, requests: int, context: int, dtype: torch.dtype, dev: torch.device, rpr: int = 1) -> None:
        torch.manual_seed(0)
        per_req = triton.cdiv(context, PAGE)
        pages = per_req * requests + 1
        self.cols = context // R
        # (the CPU's fp32 dots sum in an order of their shape's: integers there, exact in any order)
        draw = (lambda *shape: torch.randint(-2, 3, shape, device=dev).float()) if dev.type == "cpu" else (
            lambda *shape: torch.randn(*shape, device=dev))
        self.compressed = draw(pages, PAGE // R, DI).to(torch.bfloat16).to(dtype)
        self.rows, self.rpr = requests * rpr, rpr
        self.q = draw(self.rows, HI, DI).to(torch.bfloat16).to(dtype)
        perm = torch.randperm(pages - 1, device=dev).to(torch.int32) + 1
        self.table = perm[: per_req * requests].view(requests, per_req).contiguous()
        self.to_req = torch.arange(requests, device=dev, dtype=torch.int32).repeat_interleave(rpr)
        self.vis = (self.cols - rpr + 1 + torch.arange(rpr, device=dev, dtype=torch.int32)).repeat(requests)
        self.bytes = requests * self.cols * DI * self.compressed.element_size()

    def launch(self, tiles: ss.ScoreTiles | None, row_samples: int, interpret: bool):
        """(launch fn, scores, samples) of one bound score launch."""
        scores = torch.full((self.rows, self.cols), float("nan"), device=self.q.device)
        log_g = (tiles.block_g if tiles else 128).bit_length() - 1
        wbits = max((4 * KB - 1).bit_length(), (self.cols - 1).bit_length() - log_g) if row_samples else 0
        samples = torch.full((self.rows, 1 << wbits), -7, device=self.q.device, dtype=torch.int32) if wbits else None
        sl = ss.ScoreLaunch(self.q, self.compressed, self.table, self.to_req, self.vis, scores, row0=0, rows=self.rows,
                            num_cols=self.cols, page_size=PAGE, compress_ratio=R, block_topk=KB, decode=True,
                            tiles=dict(block_g=16, rows_per_request=self.rpr), interpret=interpret, score=tiles,
                            samples=samples,
                            row_samples=wbits)
        return (lambda: sl(self.q, self.table, 0)), scores, samples


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1m-b4,1m-b4-fp8,128k-b4,128k-b64")
    ap.add_argument("--variants", default="", help="default: every variant of the shape's kind")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.dry else "cuda")
    shapes = "tiny,tinyx4" if args.dry else args.shapes
    if not args.dry:
        from bench_qsa import GraphTimer
        timer = GraphTimer(flush_l2=True, reps=25, budget_ms=300)
    t0 = time.time()
    table = []
    for key in shapes.split(","):
        p = Problem(*SHAPES[key][:3], dev, *SHAPES[key][3:])
        fn, want, _ = p.launch(None, 0, args.dry)
        fn()
        base = None if args.dry else timer(fn)
        print(f"[{time.time() - t0:6.1f}s] {key}: default {base} us", flush=True)
        samp_want = None
        variants = args.variants or ",".join(PACKED if p.rpr > 1 else VARIANTS)
        for v in variants.split(","):
            if (v in PACKED) != (p.rpr > 1):
                continue  # a one-row variant of an MTP shape or the reverse
            if p.rpr > 1:
                fields, rs = PACKED[v], 0
                t = ss.ScoreTiles(**(dict(fields, block_g=16, span=32, stages=1) if args.dry else fields))
                g = t.block_g
            else:
                g, span, stages, warps, regs, rs, *fd = VARIANTS[v]
                if args.dry:
                    g, span = 16, 2
                t = ss.ScoreTiles(block_r=1, block_g=g, span=g * span, stages=stages, num_warps=warps, max_regs=regs,
                                  fast_div=bool(fd and fd[0]))
            try:
                fn, got, samp = p.launch(t, rs, args.dry)
                fn()
                ok = torch.equal(got.view(torch.int32), want.view(torch.int32))
                if samp is not None and g == (16 if args.dry else 128):
                    samp_want = samp.clone() if samp_want is None else samp_want
                    ok = ok and torch.equal(samp, samp_want)
                us = float("nan") if args.dry else timer(fn)
                gbs = p.bytes / us / 1e3 if us == us else float("nan")
                table.append((key, v, us, gbs, ok))
                print(f"[{time.time() - t0:6.1f}s] {key:10s} {v:12s} {us:8.1f} us {gbs:7.0f} GB/s"
                      + ("" if ok else "  DIFFERS"), flush=True)
            except Exception as exc:  # one variant's compile failure must not end the sweep
                print(f"[{time.time() - t0:6.1f}s] {key} {v} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del p
    print("\nshape      variant          us    GB/s  exact")
    for key, v, us, gbs, ok in table:
        print(f"{key:10s} {v:12s} {us:8.1f} {gbs:7.0f}  {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
