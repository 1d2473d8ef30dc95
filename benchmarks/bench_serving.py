"""End-to-end serving through vLLM's OpenAI server: `--attention-backend QSA_CORE` against vLLM's own QSA.

    python benchmarks/bench_qsa.py serving --out DIR [--backends QSA_CORE,upstream]
        [--prompt-lens 8192,32768,131072] [--concurrency 1,8,32] [--output-tokens 128] [--hybrid]

Run on a GPU host where vLLM's GPU build and this repo's plugin are installed. One server per
backend (CUDA graphs on, as vLLM's default; capture sizes up to the largest concurrency) on a
checkpoint of the production attention geometry (`scripts/gpu_vllm.py`: 2 QSA layers, or GDN +
QSA with --hybrid; random weights). For each prompt length and concurrency it sends that many
streaming requests at once (random token prompts, greedy, `ignore_eos`, --output-tokens each;
prefix caching off, so no request reuses another's pages) and records per request the time to
the first token (TTFT) and the mean time per output token after it (TPOT), and the output
tokens per second of the whole wave. One short request warms each server first. Every wait is
bounded; each server is stopped by its pid. DIR/serving.json holds every figure, and
DIR/serving.md the table (medians over the wave's requests).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests"), str(ROOT / "tests" / "vllm_adapter")]


def stream(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    """One streaming completion: {"ttft": s, "tpot": s, "tokens": n} (times from the request)."""
    host = url.split("//", 1)[1]
    conn = http.client.HTTPConnection(host, timeout=timeout)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    start = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    stamps: list[float] = []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        if json.loads(line[5:])["choices"][0].get("text") is not None:
            stamps.append(time.monotonic() - start)
    conn.close()
    if not stamps:
        raise RuntimeError("the stream carried no token")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"ttft": stamps[0], "tpot": tpot, "tokens": len(stamps)}


def wave(url: str, model: str, prompt_len: int, concurrency: int, output_tokens: int, seed: int) -> dict:
    """`concurrency` requests at once; the medians and the wave's output tokens per second."""
    import torch

    from gpu_vllm import VOCAB

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist() for _ in range(concurrency)]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(lambda p: stream(url, model, p, output_tokens, timeout=900), prompts))
    wall = time.monotonic() - start
    return {"prompt_len": prompt_len, "concurrency": concurrency, "wall_s": wall,
            "output_tok_s": sum(d["tokens"] for d in done) / wall,
            "ttft_ms": 1e3 * statistics.median(d["ttft"] for d in done),
            "tpot_ms": 1e3 * statistics.median(d["tpot"] for d in done), "requests": done}


def main(argv: list[str] | None = None) -> int:
    import torch

    from gpu_vllm import production_config, vllm_server
    from qwen4_checkpoint import write_checkpoint

    ap = argparse.ArgumentParser(prog="python benchmarks/bench_qsa.py serving", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for serving.json, serving.md and the server logs")
    ap.add_argument("--backends", default="QSA_CORE,upstream", help="attention backends; upstream: vLLM's own QSA")
    ap.add_argument("--prompt-lens", default="8192,32768,131072", help="prompt tokens of each wave, comma separated")
    ap.add_argument("--concurrency", default="1,8,32", help="requests at once, comma separated")
    ap.add_argument("--output-tokens", type=int, default=128, help="greedy tokens per request")
    ap.add_argument("--hybrid", action="store_true", help="GDN, QSA, GDN, QSA instead of 2 QSA layers")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False) and vLLM's GPU build: it serves the model")
    lens = [int(x) for x in args.prompt_lens.split(",")]
    conc = [int(x) for x in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = out / ("ckpt-hybrid" if args.hybrid else "ckpt-full")
    if not (folder / "config.json").exists():
        config = production_config(args.hybrid)
        config.max_position_embeddings = max(lens) + args.output_tokens + 64
        write_checkpoint(folder, config, seed=7)
    flags = ["--dtype", "bfloat16", "--no-enable-prefix-caching", "--max-model-len",
             str(max(lens) + args.output_tokens + 64), "--max-num-seqs", str(max(conc)),
             "--gpu-memory-utilization", "0.85", f"-cc.cudagraph_capture_sizes={sorted({1, 2, 4, 8, *conc})}"]
    if args.hybrid:
        flags += ["--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    results = []
    for backend in args.backends.split(","):
        mine = flags + (["--attention-backend", backend] if backend != "upstream" else [])
        with vllm_server(str(folder), mine, env, str(out / f"server-{backend}.log"), timeout_s=900) as url:
            stream(url, str(folder), [1, 2, 3, 4] * 16, 4, timeout=300)
            for n in lens:
                for c in conc:
                    r = dict(wave(url, str(folder), n, c, args.output_tokens, seed=n + c), backend=backend)
                    results.append(r)
                    print(f"{backend} {n} x {c}: TTFT {r['ttft_ms']:.0f} ms, TPOT {r['tpot_ms']:.2f} ms, "
                          f"{r['output_tok_s']:.0f} tok/s", flush=True)
                    (out / "serving.json").write_text(json.dumps(results, indent=1))
    rows = ["| prompt | concurrency | backend | TTFT ms | TPOT ms | output tok/s |", "|---|---|---|---|---|---|"]
    rows += [f"| {r['prompt_len']} | {r['concurrency']} | {r['backend']} | {r['ttft_ms']:.0f} | {r['tpot_ms']:.2f} "
             f"| {r['output_tok_s']:.0f} |" for r in sorted(results, key=lambda r: (r["prompt_len"], r["concurrency"]))]
    (out / "serving.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
