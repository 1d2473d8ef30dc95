"""Start-up warm-up on the GPU: `QSAPlanner.warm` cold, from Triton's disk cache and hot, then
random steps that must compile nothing.

For each case (production geometry, bf16, page 64, 256 requests; `8k`: 8K context and 2048 rows
per step, `128k`: 128K and 8192 rows) a fresh process with an empty TRITON_CACHE_DIR builds a
planner and two layers' caches and times:

- `cold`: `planner.warm(caches, static=True)` (the engines' CUDA-graph planning), compiling
  everything (`--workers` compiles at a time; default `warmup.compile_workers()`);
- `hot`: the same call again (Triton's in-memory cache hot: the planning and binding alone);
- `eager`: `warm(static=False, block_table_strides=(P + 3,))`, the eager planning on an engine
  block table of row stride P + 3 (P = pages of max_model_len): the variants of that stride;

then plans `--steps` random valid steps (half static, half eager on such a table; several
requests of random lengths, MTP-free decodes, padding rows) and runs each through both layers
(`qsa_indexer`, `qsa_attention`, zero data), counting the kernels Triton compiles meanwhile
(`warmup._compiled_kernels`): any is a failure. A second process on the same cache directory
times `disk`: the first warm of a restarted engine (Triton's disk cache hot, its memory cold).

    python benchmarks/bench_warmup.py [--cases 8k,128k] [--steps 40] [--workers N] [--out DIR]

Prints one line per case and measurement, writes DIR/warmup.json with --out, and exits 1 on any
compile after warm-up or any failure. `--workers 1` compiles one at a time: run it beside the
default to see what the parallel compile gains on this host.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name: (max_model_len, max_num_tokens, max_num_reqs)
CASES = {"8k": (8192, 2048, 256), "128k": (131072, 8192, 256)}
PAGE = 64


def _config():
    from qsa_core import QSAConfig

    return QSAConfig(hidden_size=2048, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4,
                     index_head_dim=128, token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7)


def _timed_warm(planner, caches, workers: int | None, **kw) -> dict:
    """One `planner.warm`: seconds, step shapes, kernels compiled."""
    import torch

    from qsa_core.warmup import _compiled_kernels

    if workers is not None and "workers" in inspect.signature(planner.warm).parameters:
        kw["workers"] = workers
    before = _compiled_kernels()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = planner.warm(caches, decode_query_lens=(1,), **kw)
    torch.cuda.synchronize()
    return dict(seconds=round(time.perf_counter() - t0, 2), shapes=len(steps), compiled=_compiled_kernels() - before)


def _random_step(rng: random.Random, planner, table):
    """A valid random step: decode requests of one row, then prefills, then padding rows."""
    import torch

    from qsa_core.inputs import QSAStepInputs

    N, L, reqs, dev = planner.max_num_tokens, planner.max_model_len, table.shape[0], table.device
    nd = min(rng.choice([0, rng.randint(1, 8), rng.randint(1, reqs)]), N - 1, reqs - 1)
    lens = [1] * nd
    while rng.random() < 0.6 and sum(lens) < N and len(lens) < reqs:
        lens.append(rng.randint(1, min(N - sum(lens), rng.choice([8, 512, N]))))
    if not lens:
        lens = [rng.randint(1, N)]
    pad = rng.choice([0, 0, rng.randint(0, N - sum(lens))])
    seq = [rng.randint(q, max(q, min(L, rng.choice([64, 4096, L])))) for q in lens]
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return QSAStepInputs(
        query_start_loc=qsl.to(dev), seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
        block_table=table[: len(lens)], slot_mapping=torch.full((sum(lens) + pad,), -1, dtype=torch.int64, device=dev),
        ring_index=torch.arange(len(lens), dtype=torch.int32, device=dev), num_decodes=nd, max_query_len=max(lens),
        max_seq_len=max(seq), num_padding_rows=pad)


def child(name: str, steps: int, workers: int | None, disk_only: bool) -> dict:
    """The measurements of one case in this (fresh) process."""
    import torch

    from qsa_core.cache import QSACacheLayout
    from qsa_core.layer import QSANormWeights, qsa_attention, qsa_indexer
    from qsa_core.planner import QSAPlanner
    from qsa_core.warmup import _compiled_kernels

    L, N, R = CASES[name]
    dev, cfg, dt = torch.device("cuda"), _config(), torch.bfloat16
    layout = QSACacheLayout(num_layers=2, page_size=PAGE, num_pages=64, ring_rows=R, num_speculative_tokens=3)
    planner = QSAPlanner(cfg, dtype=dt, page_size=PAGE, ring_capacity=layout.ring_capacity(cfg), max_num_tokens=N,
                         max_model_len=L, max_num_reqs=R, device=dev, num_slots=layout.num_slots, num_ring_rows=R)
    caches = layout.allocate(cfg, dt, device=dev)
    out: dict = {"case": name, "device": torch.cuda.get_device_name(0)}
    if disk_only:
        out["disk"] = _timed_warm(planner, caches, workers, static=True)
        return out
    out["cold"] = _timed_warm(planner, caches, workers, static=True)
    out["hot"] = _timed_warm(planner, caches, workers, static=True)
    P = -(-L // PAGE)
    params = inspect.signature(planner.warm).parameters
    stride_kw = {"block_table_strides": (P + 3,)} if "block_table_strides" in params else {}
    out["eager"] = _timed_warm(planner, caches, workers, static=False, **stride_kw)
    rng = random.Random(0)
    table = torch.zeros(R, P + 3, dtype=torch.int32, device=dev)[:, :P]  # an engine's table: row stride P + 3
    Hi, Di, Hq, Hkv, D = cfg.index_n_heads, cfg.index_head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norms = QSANormWeights(*(torch.ones(d, dtype=dt, device=dev) for d in (Di, Di, D, D)))
    before, t0, new = _compiled_kernels(), time.perf_counter(), []
    for i in range(steps):
        static = i % 2 == 0
        plan = planner.plan(_random_step(rng, planner, table), static=static)
        T = plan.num_tokens
        proj = [torch.zeros(T, w, dtype=dt, device=dev) for w in ((Hi + 1) * Di, 2 * Hq * D, Hkv * D, Hkv * D)]
        for cache in caches:
            qsa_attention(plan, qsa_indexer(plan, norms, *proj, cache), cache)
        after = _compiled_kernels()
        if after != before:
            new.append(dict(step=i, static=static, rows=T, compiled=after - before))
            before = after
    torch.cuda.synchronize()
    planner.check_guard()
    out["steps"] = dict(count=steps, seconds=round(time.perf_counter() - t0, 2),
                        compiled=sum(n["compiled"] for n in new), which=new)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="8k,128k", help=f"comma-separated of {sorted(CASES)}")
    ap.add_argument("--steps", type=int, default=40, help="random steps after warm-up (half static, half eager)")
    ap.add_argument("--workers", type=int, default=None, help="compiles at a time (default: warmup.compile_workers())")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], args.steps, args.workers, args.child[1] == "disk")))
        return
    names = args.cases.split(",")
    unknown = set(names) - set(CASES)
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)}; expected some of {sorted(CASES)}")
    results, failed = [], []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="qsa-warm-triton-") as cache_dir:
            env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
            env.pop("TRITON_INTERPRET", None)
            found: dict = {}
            for mode in ("full", "disk"):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", name, mode, "--steps", str(args.steps)]
                if args.workers is not None:
                    cmd += ["--workers", str(args.workers)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
                lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    failed.append(f"{name} {mode}: exit {done.returncode}: {done.stderr[-3000:]}")
                    break
                found.update(json.loads(lines[-1][len("RESULT "):]))
        if found:
            results.append(found)
            for key in ("cold", "hot", "eager", "disk"):
                if key in found:
                    r = found[key]
                    print(f"{name} {key:5s}: {r['seconds']:6.2f} s, {r['shapes']} step shapes, "
                          f"{r['compiled']} compiled")
            if "steps" in found:
                s = found["steps"]
                print(f"{name} steps: {s['count']} random steps in {s['seconds']:.2f} s, {s['compiled']} compiled "
                      f"after warm-up {s['which'] if s['which'] else ''}")
                if s["compiled"]:
                    failed.append(f"{name}: {s['compiled']} kernels compiled after warm-up: {s['which']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "warmup.json").write_text(json.dumps(dict(results=results, failed=failed), indent=1) + "\n")
    for f in failed:
        print("FAIL " + f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
