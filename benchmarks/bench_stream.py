"""The HBM read rate a score launch can reach: a plain Triton kernel that reads random (or
consecutive) chunks of a pool and sums them, timed as bench_qsa times (CUDA-graph replay median,
L2 flushed before each replay). Session 19: compares the decode score launches (which read each
request's compressed keys in 2 KB (fp8) or 4 KB (bf16) pages) with a read of the same bytes.
Session 23: each read after both of bench_qsa's flushes; a write flush leaves L2's lines dirty,
and the fixed ~11 us that session 19 found in every read here may be their write-back.

    python benchmarks/bench_stream.py [--mb 128,256,512] [--chunks 2048,4096] [--flush write,read]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))


@triton.jit
def _read_chunks(src, idx, dst, CHUNK: tl.constexpr, PER: tl.constexpr):
    """Program p sums chunks idx[p*PER : p*PER + PER] of src (int32, CHUNK bytes each) into dst[p]."""
    pid = tl.program_id(0)
    o = tl.arange(0, CHUNK // 4)
    acc = tl.zeros((CHUNK // 4,), tl.int32)
    for i in tl.static_range(PER):
        c = tl.load(idx + pid * PER + i).to(tl.int64)
        acc += tl.load(src + c * (CHUNK // 4) + o)
    tl.store(dst + pid * (CHUNK // 4) + o, acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="128,256,512", help="MiB read per launch")
    ap.add_argument("--chunks", default="2048,4096", help="chunk sizes in bytes (a power of two >= 64)")
    ap.add_argument("--per", type=int, default=16, help="chunks per program")
    ap.add_argument("--flush", default="write,read",
                    help="comma list of bench_qsa.FLUSHES: each read is timed after each (a write leaves L2 dirty)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_stream.py measures a GPU: no CUDA device here")
    from bench_qsa import GraphTimer

    timers = {f: GraphTimer(flush_l2=True, reps=20, flush=f) for f in args.flush.split(",")}
    for mb in map(int, args.mb.split(",")):
        total = mb << 20
        for chunk in map(int, args.chunks.split(",")):
            n = total // chunk
            pool = torch.randint(0, 100, (n * chunk,), dtype=torch.int32, device="cuda")  # 4x the bytes read
            for order in ("random", "consecutive"):
                perm = torch.randperm(4 * n, device="cuda")[:n] if order == "random" else torch.arange(n, device="cuda")
                idx = perm.to(torch.int32)
                dst = torch.empty(n // args.per * chunk // 4, dtype=torch.int32, device="cuda")
                for flush, timer in timers.items():
                    us = timer(lambda: _read_chunks[(n // args.per,)](pool, idx, dst, CHUNK=chunk, PER=args.per,
                                                                      num_warps=4))
                    print(f"{mb:5d} MiB in {chunk:5d} B chunks, {order:11s}, {flush:5s} flush: {us:8.1f} us "
                          f"{total / us / 1e3:7.0f} GB/s", flush=True)
            del pool


if __name__ == "__main__":
    main()
