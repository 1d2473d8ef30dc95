"""End-to-end serving: `qsa_core` against the engine's own QSA, through vLLM's or SGLang's server.

    python benchmarks/bench_qsa.py serving --out DIR [--engine vllm|sglang] [--backends B1,B2]
        [--prompt-lens 8192,32768,131072] [--concurrency 1,8,32] [--output-tokens 128] [--quick]
        [--hybrid] [--layer-pairs 2] [--dry-run]

Run on a GPU host where the engine's GPU build and this repo (its plugins) are installed. One
server per backend, CUDA graphs on (each engine's default; decode capture up to the largest
concurrency), on a checkpoint of the production attention geometry with random weights:
- vLLM (backends QSA_CORE, upstream = vLLM's own QSA): `scripts/gpu_vllm.py`'s model, 2 QSA
  layers, or GDN + QSA with --hybrid; its OpenAI server (`/v1/completions`, streamed);
- SGLang (backends qsa_core, qsa = SGLang's own QSA): `scripts/gpu_sglang.py`'s model,
  --layer-pairs x (GDN, QSA) (SGLang serves Qwen4-Exp as its ConditionalGeneration class),
  `python3 -m sglang.launch_server` (`/generate` with `input_ids`, streamed), radix cache off,
  chunked prefill 8192, `--mem-fraction-static 0.7`. KV per QSA layer and token: K and V of
  2 heads x 256 in bf16 (2 KiB) + a compressed key of 128 bf16 per 4 tokens (64 B): 128K x 32
  requests (4.2M tokens) take 8.8 GB a QSA layer, so the default 2 pairs (17.6 GB) fit an H100.
For each prompt length and concurrency it sends that many streaming requests at once (random
token prompts, greedy, ignore_eos, --output-tokens each; no prefix is shared) and records per
request the time to the first token (TTFT) and the mean time per output token after it (TPOT),
and the output tokens per second of the whole wave, and the longest gap between two tokens of one
request (a stall: a compile, a capture). One request of the shortest length warms each server
first, and before each timed wave an untimed wave of the same prompt length, concurrency and
output tokens (other prompts) meets that shape's first-time costs; its wall time is recorded
(`warm_wall_s`). The engine's own kernels may still compile in the timed wave, for a batch the
untimed one did not form (vLLM 0.33's fused MoE did, for 920 ms, at 32K x 8 when the untimed
wave ran 4 tokens a request): with vLLM, the kernels its JIT monitor saw compile during the timed
wave are recorded (`engine_jit`) and counted in the table. Every wait is bounded; each server is
stopped by its pid.

DIR/serving.json holds every figure and is written after each wave; a rerun with the same DIR
skips the waves already there (so one call per backend fills one table). DIR/serving.md has the
table (medians over each wave's requests) and, where both backends ran a wave, qsa_core's
figures against the engine's own QSA. --quick: prompts of 8K and 32K at concurrency 1 and 8, 64
tokens each. --dry-run (SGLang only): the CPU build on a tiny model (every layer QSA, budget 2048),
prompts of 300 and 2200 tokens at concurrency 1 and 2, 4 tokens: the benchmark's own logic, times
that mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests"), str(ROOT / "tests" / "vllm_adapter")]

from qsa_core.guard import guard_reports  # noqa: E402  (a run with any fails)

BACKENDS = {"vllm": ("QSA_CORE", "upstream"), "sglang": ("qsa_core", "qsa")}  # (ours, the engine's own)
CHUNK = 8192  # SGLang's --chunked-prefill-size, the same for both backends
QUICK = dict(prompt_lens="8192,32768", concurrency="1,8", output_tokens=64)
DRY = dict(prompt_lens="300,2200", concurrency="1,2", output_tokens=4)


def post_stream(url: str, path: str, body: dict, timeout: float, tokens_of: Callable[[dict, int], int]) -> dict:
    """POST a streaming request; {"ttft": s, "tpot": s, "tokens": n, "max_gap": s} from the arrival
    times of its server-sent events (`tokens_of(event, tokens so far)`: the tokens generated once it
    arrived; max_gap: the longest wait between two events that brought tokens)."""
    conn = http.client.HTTPConnection(url.split("//", 1)[1], timeout=timeout)
    start = time.monotonic()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    first = last = None
    count = first_count = 0
    gap = 0.0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        now, new = time.monotonic() - start, tokens_of(json.loads(line[5:]), count)
        if new > count:
            if first is None:
                first, first_count = now, new
            else:
                gap = max(gap, now - last)
            last, count = now, new
    conn.close()
    if first is None:
        raise RuntimeError("the stream carried no token")
    tpot = (last - first) / (count - first_count) if count > first_count else 0.0
    return {"ttft": first, "tpot": tpot, "tokens": count, "max_gap": gap}


def vllm_stream(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    return post_stream(url, "/v1/completions", body, timeout,
                       lambda event, n: n + (event["choices"][0].get("text") is not None))


def sglang_stream(url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    return post_stream(url, "/generate", body, timeout,
                       lambda event, n: int(event.get("meta_info", {}).get("completion_tokens", n)))


def wave(stream: Callable, url: str, model: str, vocab: int, prompt_len: int, concurrency: int, output_tokens: int,
         seed: int) -> dict:
    """`concurrency` requests at once; the medians, the wave's output tokens per second and its
    longest inter-token gap (max_gap_ms)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(concurrency)]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(lambda p: stream(url, model, p, output_tokens, timeout=900), prompts))
    wall = time.monotonic() - start
    return {"prompt_len": prompt_len, "concurrency": concurrency, "wall_s": wall,
            "output_tok_s": sum(d["tokens"] for d in done) / wall,
            "ttft_ms": 1e3 * statistics.median(d["ttft"] for d in done),
            "tpot_ms": 1e3 * statistics.median(d["tpot"] for d in done),
            "max_gap_ms": 1e3 * max(d["max_gap"] for d in done), "requests": done}


JIT_LINE = re.compile(r"JIT compilation during inference: (\S+?)\.")


def engine_jit(log: str) -> list[str]:
    """The kernels vLLM's JIT monitor reports compiling while serving, in a piece of its log
    ("... JIT compilation during inference: NAME. This causes a latency spike ...")."""
    return JIT_LINE.findall(log)


# -- the engines ---------------------------------------------------------------------------------

class Engine:
    """Writes its checkpoint, starts a server per backend, streams requests."""

    def __init__(self, name: str, args: argparse.Namespace, out: Path, lens: list[int], conc: list[int]):
        self.name, self.args, self.out, self.lens, self.conc = name, args, out, lens, conc
        self.context = max(lens) + args.output_tokens + 64

    def log_path(self, backend: str) -> Path:
        """The server log of `backend`."""
        return self.out / (f"server-{backend}.log" if self.name == "vllm" else f"server-sglang-{backend}.log")

    def log_size(self, backend: str) -> int:
        """Bytes in `backend`'s server log so far."""
        return self.log_path(backend).stat().st_size

    def log_text(self, backend: str, offset: int) -> str:
        """`backend`'s server log from byte `offset` on."""
        with open(self.log_path(backend), "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def server(self, backend: str):
        """A context manager yielding the server's base URL."""
        import contextlib

        from server_process import ServerProcess

        if self.name == "vllm":
            from gpu_vllm import vllm_server

            flags = ["--dtype", "bfloat16", "--no-enable-prefix-caching", "--max-model-len", str(self.context),
                     "--max-num-seqs", str(max(self.conc)), "--gpu-memory-utilization", "0.85",
                     f"-cc.cudagraph_capture_sizes={sorted({1, 2, 4, 8, *self.conc})}"]
            if self.args.hybrid:
                flags += ["--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]
            flags += ["--attention-backend", backend] if backend != "upstream" else []
            return vllm_server(self.folder, flags, {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
                               str(self.log_path(backend)), timeout_s=900)
        from gpu_sglang import GPU_FLAGS, Run, server_env

        def command(port: int) -> list[str]:
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.folder, "--attention-backend",
                   backend, "--skip-tokenizer-init", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
                   "--disable-radix-cache", "--skip-server-warmup", "--max-running-requests", str(max(self.conc)),
                   "--log-level", "info"]
            if self.args.dry_run:
                return cmd + ["--device", "cpu", "--chunked-prefill-size", "1024", "--max-total-tokens",
                              str(max(self.conc) * self.context + 4096), "--cuda-graph-backend-decode=disabled",
                              "--cuda-graph-backend-prefill=disabled"]
            return cmd + ["--chunked-prefill-size", str(CHUNK), "--cuda-graph-max-bs-decode", str(max(self.conc)),
                          *GPU_FLAGS]

        @contextlib.contextmanager
        def served():
            env = server_env(Run(backend, "eager"), smoke=self.args.dry_run)
            s = ServerProcess.launch(command, str(self.log_path(backend)), env, timeout_s=900)
            try:
                yield s.url
            finally:
                s.stop()

        return served()

    def prepare(self) -> tuple[Callable, int]:
        """Write the checkpoint (kept if there); the stream function and the prompts' vocabulary."""
        if self.name == "vllm":
            from gpu_vllm import VOCAB, production_config
            from qwen4_checkpoint import write_checkpoint

            folder = self.out / ("ckpt-hybrid" if self.args.hybrid else "ckpt-full")
            if not (folder / "config.json").exists():
                config = production_config(self.args.hybrid)
                config.max_position_embeddings = self.context
                write_checkpoint(folder, config, seed=7)
            self.folder = str(folder)
            return vllm_stream, VOCAB
        import gpu_sglang
        from tiny_checkpoint import VOCAB_WORDS

        base = gpu_sglang.SMOKE if self.args.dry_run else gpu_sglang.GPU
        profile = dataclasses.replace(base, context=self.context, layer_pairs=self.args.layer_pairs)
        self.folder = gpu_sglang.write_checkpoint(
            str(self.out / f"ckpt-sglang-{profile.layer_pairs}x{'gdn-qsa' if profile.hybrid else 'qsa-qsa'}"
                f"-{self.context}"), profile)
        return sglang_stream, VOCAB_WORDS


# -- tables --------------------------------------------------------------------------------------

def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def tables(results: list[dict], engine: str) -> str:
    ours, theirs = BACKENDS[engine]
    key = lambda r: (r["prompt_len"], r["concurrency"], r.get("output_tokens") or 0)  # noqa: E731
    rows = [f"{engine}: medians over each wave's requests", "",
            "| prompt | concurrency | output tokens | backend | TTFT ms | TPOT ms | output tok/s | longest gap ms "
            "| engine JIT in wave |",
            "|---|---|---|---|---|---|---|---|---|"]
    gap = lambda r: f"{r['max_gap_ms']:.0f}" if "max_gap_ms" in r else "-"  # noqa: E731
    jit = lambda r: ", ".join(r["engine_jit"]) or "none" if "engine_jit" in r else "-"  # noqa: E731
    rows += [f"| {' | '.join(map(str, key(r)))} | {r['backend']} | {r['ttft_ms']:.0f} | {r['tpot_ms']:.2f} "
             f"| {r['output_tok_s']:.1f} | {gap(r)} | {jit(r)} |"
             for r in sorted(results, key=lambda r: (*key(r), r["backend"]))]
    by = {(r["backend"], *key(r)): r for r in results}
    pairs = [(by[(ours, *k)], by[(theirs, *k)]) for k in sorted({key(r) for r in results})
             if (ours, *k) in by and (theirs, *k) in by]
    if pairs:
        rows += ["", f"{ours} against {theirs} (ratios; TTFT and TPOT below 1 and tok/s above 1: {ours} faster)", "",
                 "| prompt | concurrency | output tokens | TTFT | TPOT | output tok/s |", "|---|---|---|---|---|---|"]
        fields = ("ttft_ms", "tpot_ms", "output_tok_s")
        rows += [f"| {' | '.join(map(str, key(a)))} | " + " | ".join(ratio(a[f], b[f]) for f in fields) + " |"
                 for a, b in pairs]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(prog="python benchmarks/bench_qsa.py serving", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for serving.json, serving.md and the server logs")
    ap.add_argument("--engine", choices=sorted(BACKENDS), default="vllm", help="the server (default: %(default)s)")
    ap.add_argument("--backends", help="attention backends (vllm: QSA_CORE,upstream = vLLM's own QSA; sglang: "
                    "qsa_core,qsa = SGLang's own QSA; default: both)")
    ap.add_argument("--prompt-lens", default="8192,32768,131072", help="prompt tokens of each wave, comma separated")
    ap.add_argument("--concurrency", default="1,8,32", help="requests at once, comma separated")
    ap.add_argument("--output-tokens", type=int, default=128, help="greedy tokens per request")
    ap.add_argument("--quick", action="store_true", help="prompts of 8K and 32K at concurrency 1 and 8, 64 tokens")
    ap.add_argument("--hybrid", action="store_true", help="vLLM: GDN, QSA, GDN, QSA instead of 2 QSA layers")
    ap.add_argument("--layer-pairs", type=int, default=2, help="SGLang: (GDN, QSA) layer pairs (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="SGLang's CPU build, tiny model and sizes (no GPU)")
    args = ap.parse_args(argv)
    for preset, flag in ((QUICK, args.quick), (DRY, args.dry_run)):
        if flag:
            for name, value in preset.items():
                setattr(args, name, value)
    if args.dry_run and args.engine != "sglang":
        ap.error("--dry-run runs SGLang's CPU build: give --engine sglang")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False) and the engine's GPU build: "
                 "it serves the model")
    lens = [int(x) for x in args.prompt_lens.split(",")]
    conc = [int(x) for x in args.concurrency.split(",")]
    backends = (args.backends or ",".join(BACKENDS[args.engine])).split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit's SIGTERM stops the server by its pid
    engine = Engine(args.engine, args, out, lens, conc)
    stream, vocab = engine.prepare()
    path = out / "serving.json"
    earlier = json.loads(path.read_text()) if path.exists() else []
    results = [r for r in earlier if r.get("engine", "vllm") == args.engine]
    others = [r for r in earlier if r.get("engine", "vllm") != args.engine]
    done = {(r["backend"], r["prompt_len"], r["concurrency"], r.get("output_tokens")) for r in results}
    failed: list[str] = []
    for backend in backends:
        todo = [(n, c) for n in lens for c in conc if (backend, n, c, args.output_tokens) not in done]
        if not todo:
            print(f"{backend}: every wave is in {path} already", flush=True)
            continue
        try:
            with engine.server(backend) as url:
                stream(url, engine.folder, [1, 2, 3, 4] * (min(lens) // 4), 4, timeout=600)
                for n, c in todo:
                    warm = wave(stream, url, engine.folder, vocab, n, c, args.output_tokens, seed=(1 << 20) + n + c)
                    seen = engine.log_size(backend)
                    r = dict(wave(stream, url, engine.folder, vocab, n, c, args.output_tokens, seed=n + c),
                             backend=backend, engine=args.engine, output_tokens=args.output_tokens,
                             warm_wall_s=warm["wall_s"])
                    if args.engine == "vllm":
                        r["engine_jit"] = engine_jit(engine.log_text(backend, seen))
                    results.append(r)
                    print(f"{backend} {n} x {c}: TTFT {r['ttft_ms']:.0f} ms, TPOT {r['tpot_ms']:.2f} ms, "
                          f"{r['output_tok_s']:.1f} tok/s, longest gap {r['max_gap_ms']:.0f} ms "
                          f"(untimed wave {r['warm_wall_s']:.2f} s)", flush=True)
                    path.write_text(json.dumps(others + results, indent=1))
                    (out / "serving.md").write_text(tables(results, args.engine))
        except (RuntimeError, TimeoutError, OSError) as e:  # this backend's server or a request failed: go on
            failed.append(f"{backend}: {type(e).__name__}: {str(e)[:2000]}")
            print(failed[-1], flush=True)
        if engine.log_path(backend).exists() and (reports := guard_reports(engine.log_text(backend, 0))):
            failed.append(f"{backend}: {len(reports)} guard report(s) in its server log (requests made inert): "
                          f"{reports[0][-300:]}")
            print(failed[-1], flush=True)
    text = tables(results, args.engine)
    (out / "serving.md").write_text(text)
    print(text + "".join(f"\nFAILED {f.splitlines()[0]}" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
