"""vLLM on a GPU: `--attention-backend QSA_CORE` against vLLM's own QSA, eager and with CUDA graphs.

    python3 scripts/gpu_vllm.py OUT_DIR [--models full,hybrid,vl] [--modes eager,graphs]
                                [--backends QSA_CORE,upstream] [--server]
                                [--kv-cache-dtype auto|fp8|fp8_e5m2] [--lengths 40,700,...] [--mtp N]

Run where vLLM's GPU build and this repo's plugin are installed (the plugin registers QSA_CORE;
`../shared/gpu-stage` stages vLLM 0.33 on the GPU host). For each model it writes a bf16
checkpoint with the production attention geometry (24 query / 2 KV heads of 256, indexer
4 x 128, budget 2048 tokens in groups of 4, partial rotary 0.25; a few layers, random weights):
`full` is every decoder layer QSA, `hybrid` GDN, QSA, GDN, QSA with prefix caching on (both
`Qwen4ExpForCausalLM`), `vl` the released architecture `Qwen4ExpForConditionalGeneration`
(vision tower, interleaved MRoPE) with the hybrid layers, served text-only
(`language_model_only`; prompts avoid its vision token ids). Each
(model, backend, mode) runs in its own process (`tests/vllm_adapter/vllm_generate.py`): six
prompts of 40 to 8000 tokens at once (`--lengths` picks others), greedy, chunked prefill of
2048 tokens, run twice (the second round is timed warm). `--server` also serves `full` with
QSA_CORE and CUDA graphs through the OpenAI server and asks for the same completions concurrently.
A rerun with the same OUT_DIR reuses each run whose result is there for the same request (so the
runs can be spread over several calls of a time-limited host).
`--kv-cache-dtype fp8` runs every engine with vLLM's fp8 (e4m3) main KV cache: QSA_CORE stores
and reads the core's fp8 K/V in vLLM's uint8 pages, upstream its own; the checkpoint has no
k_scale / v_scale, so both use 1.0 (upstream's layer never reads a checkpoint's scales into the
floats its kernels take). Upstream serves fp8 only as e4m3: with `fp8_e5m2` run
`--backends QSA_CORE` (eager against graphs). Run names and the summary carry the dtype.
`--mtp N` also runs every (model, backend, mode) with MTP speculative decoding of N drafts
(`{"method": "mtp", "num_speculative_tokens": N}`, the released recipe's 3) on the same
checkpoint plus one MTP layer (`add_mtp_layer`: a drafter that is right some of the time), and
reports each run's acceptance.

Checks (exit 1 on any failure): no run's log holds a guard report (requests whose rows the
device guards made inert: `qsa_core.guard`), QSA_CORE's tokens equal upstream's in each mode, eager equals
CUDA graphs, the server equals `LLM.generate`, a run with MTP equals the one without; token for
token, except where both runs stand at a bf16 tie of their two likeliest tokens, or where every
QSA_CORE token there is within two bf16 steps of the likeliest by transformers' fp32 model, the
oracle (random weights make near ties common; the summary gives each run's margin and each
token's distance below HF's best). Comparisons of upstream runs alone are reported, not judged. OUT_DIR gets every run's JSON and log and
`summary.md` (`summary-fp8.md` with `--kv-cache-dtype fp8`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from qsa_core.guard import guard_reports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "vllm_adapter")
sys.path[:0] = [TESTS, os.path.join(ROOT, "tests")]
DRIVER = os.path.join(TESTS, "vllm_generate.py")

LENGTHS = [40, 700, 2100, 3000, 5000, 8000]
MAX_TOKENS = 16
VOCAB = 4096
ENGINE = dict(max_model_len=8192 + 64, max_num_seqs=4, max_num_batched_tokens=2048, enable_chunked_prefill=True,
              gpu_memory_utilization=0.5, dtype="bfloat16")
TIE = 2**-6  # two bf16 steps of a logit in [1, 2)
HF_TIE = 2**-5  # a bf16 run against HF's fp32 log-probs: two bf16 steps of a logit in [2, 4)
GRAPHS = dict(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})


def production_config(model: str):
    """A few layers at the production attention geometry (tests' tiny config otherwise):
    `Qwen4ExpForCausalLM` for full / hybrid, `Qwen4ExpForConditionalGeneration` (vision tower,
    interleaved MRoPE (11, 11, 10) over the 32 rotary frequencies) with GDN, QSA, GDN, QSA for vl."""
    from qwen4_checkpoint import tiny_config, tiny_vl_config

    fields = dict(
        vocab_size=VOCAB, hidden_size=1024, num_attention_heads=24, num_key_value_heads=2,
        head_dim=256, indexer_n_heads=4, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        max_position_embeddings=32768, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    if model == "vl":
        return tiny_vl_config(hybrid=True, **fields)
    return tiny_config(hybrid=model == "hybrid", **fields)


def write(folder: str, model: str, mtp: bool) -> None:
    """The model's checkpoint (the same target weights with or without the MTP layer)."""
    from qwen4_checkpoint import add_mtp_layer, write_checkpoint

    if not os.path.exists(os.path.join(folder, "config.json")):
        hf = write_checkpoint(folder, production_config(model), seed=7)
        if mtp:
            add_mtp_layer(folder, hf, seed=3)


def prompts(lengths: list[int]) -> list[list[int]]:
    """Random prompts of these lengths: one of LENGTHS gets the same tokens as in the default run,
    other lengths are drawn after those. No vision token ids (vl's top 4): those ids move down by 4."""
    g = torch.Generator().manual_seed(5)
    drawn = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    chosen = [drawn[LENGTHS.index(n)] if n in LENGTHS else torch.randint(0, VOCAB, (n,), generator=g).tolist()
              for n in lengths]
    return [[t - 4 if t >= VOCAB - 4 else t for t in p] for p in chosen]


def run(out: str, name: str, llm: dict, env: dict, lengths: list[int]) -> dict:
    """One vllm_generate.py process; its JSON result (or {"error": ...})."""
    request = {"llm": llm, "prompts": prompts(lengths), "max_tokens": [MAX_TOKENS] * len(lengths), "repeat": 2,
               "logprobs": 2, "spec_metrics": "speculative_config" in llm}
    req, res, log = (os.path.join(out, f"{name}{ext}") for ext in (".json", ".out.json", ".log"))
    if os.path.exists(res) and os.path.exists(req):  # an earlier call's result for the same request
        with open(req) as f:
            if json.load(f) == request:
                return finished(res, log, wall=float("nan"))
    with open(req, "w") as f:
        json.dump(request, f)
    start = time.monotonic()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, DRIVER, req, res], stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **env}, timeout=540)
    wall = time.monotonic() - start
    if done.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        return {"error": f"exit {done.returncode}", "tail": tail, "wall": wall}
    return finished(res, log, wall)


_HF: dict[str, torch.nn.Module] = {}


def hf_logprobs(folder: str, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax fp32 [vocab] of the token after ids, by the checkpoint in
    folder (its target model; on the GPU when there is one): the oracle where two runs part."""
    import transformers

    if folder not in _HF:
        _HF.clear()
        arch = transformers.AutoConfig.from_pretrained(folder).architectures[0]
        model = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32)
        _HF[folder] = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    model = _HF[folder]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1]
    return torch.log_softmax(logits.float(), -1).cpu()


WARMED = re.compile(r"QSA: warmed (\d+) kernel variants over \d+ step shapes in ([\d.]+) s")


def finished(res: str, log: str, wall: float) -> dict:
    """A finished run's JSON result, its wall seconds, its count of vLLM's JIT warnings and
    QSA_CORE's start-up warm-up (the "QSA: warmed" lines of its log: variants, seconds; part of
    vLLM's init; the first run on a machine also compiles the model's other Triton kernels cold).
    A log with a guard report (requests the device guards made inert) makes the run an error."""
    with open(log) as f:
        text = f.read()
    jit = text.count("JIT compilation during inference")
    warmed = [(int(n), float(sec)) for n, sec in WARMED.findall(text)]
    with open(res) as f:
        result = {**json.load(f), "wall": wall, "jit": jit,
                  "warmup": [sum(n for n, _ in warmed), sum(sec for _, sec in warmed)] if warmed else None}
    reports = guard_reports(text)
    if reports:
        result.update(error=f"{len(reports)} guard report(s) in the log", tail=reports[0][-3000:])
    return result


@contextlib.contextmanager
def vllm_server(folder: str, args: list[str], env: dict, log_path: str, timeout_s: float = 400) -> Iterator[str]:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with `args` (tests'
    `ServerProcess`); yields its base URL once /health answers, and stops it by its pid."""
    from server_process import ServerProcess

    command = lambda port: [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,  # noqa: E731
                            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", *args]
    served = ServerProcess.launch(command, log_path, env, timeout_s)
    try:
        yield served.url
    finally:
        served.stop()


def serve_and_ask(out: str, folder: str, env: dict, lengths: list[int], kv_cache_dtype: str) -> dict:
    """The OpenAI server with QSA_CORE and CUDA graphs: the prompts' completions, concurrently."""
    args = ["--attention-backend", "QSA_CORE", "--no-enable-prefix-caching", "--dtype", "bfloat16",
            "--kv-cache-dtype", kv_cache_dtype,
            "--max-model-len", str(ENGINE["max_model_len"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
            "--gpu-memory-utilization", str(ENGINE["gpu_memory_utilization"]), "-cc.cudagraph_capture_sizes=[1,2,4]"]
    try:
        with vllm_server(folder, args, env, os.path.join(out, "server.log")) as url:

            def complete(prompt: list[int]) -> list[int]:
                body = json.dumps({"model": folder, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                   "ignore_eos": True, "return_token_ids": True}).encode()
                request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as r:
                    return json.load(r)["choices"][0]["token_ids"]

            with ThreadPoolExecutor(max_workers=len(lengths)) as pool:
                return {"tokens": list(pool.map(complete, prompts(lengths)))}
    except (RuntimeError, TimeoutError) as e:
        return {"error": str(e)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--models", default="full,hybrid,vl", help="full, hybrid (Qwen4ExpForCausalLM), vl "
                    "(Qwen4ExpForConditionalGeneration, text-only)")
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--backends", default="QSA_CORE,upstream")
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths (tokens), comma-separated")
    ap.add_argument("--mtp", type=int, default=0, help="also run with MTP speculative decoding of this many drafts")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) + MAX_TOKENS > ENGINE["max_model_len"]:
        ap.error(f"--lengths: a prompt of {max(lengths)} tokens and {MAX_TOKENS} new ones pass max_model_len "
                 f"{ENGINE['max_model_len']}")
    kv = args.kv_cache_dtype
    suffix = "" if kv == "auto" else f"-{kv}"  # the runs of each dtype keep their own files
    os.makedirs(args.out, exist_ok=True)
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}  # flashinfer is not a dependency
    results: dict[tuple[str, str, str, int], dict] = {}
    lines = [f"KV cache dtype: {kv}; prompt lengths {lengths}", "",
             "| model | backend | mode | MTP drafts | init s | QSA warm-up s (variants) | generate s (cold, warm) | "
             "Triton JIT warnings while serving | draft acceptance | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        hybrid = model != "full"  # hybrid and vl: GDN, QSA, GDN, QSA
        for spec in sorted({0, args.mtp}):
            folder = os.path.join(args.out, f"ckpt-{model}" + ("-mtp" if spec else ""))
            write(folder, model, bool(spec))
            for backend in args.backends.split(","):
                for mode in args.modes.split(","):
                    llm = dict(ENGINE, model=folder, enable_prefix_caching=hybrid, kv_cache_dtype=kv,
                               **(GRAPHS if mode == "graphs" else {}))
                    if backend != "upstream":
                        llm["attention_backend"] = backend
                    if hybrid:
                        llm["additional_config"] = {"gdn_prefill_backend": "triton"}
                    if model == "vl":
                        llm["language_model_only"] = True  # text prompts (images: the CPU suite's test_vllm_multimodal)
                    if spec:
                        llm["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec}
                    name = f"{model}-{backend}-{mode}{suffix}" + (f"-mtp{spec}" if spec else "")
                    r = results[(model, backend, mode, spec)] = run(args.out, name, llm, env, lengths)
                    if "error" in r:
                        lines.append(f"| {model} | {backend} | {mode} | {spec} | | | | | | {r['error']} |")
                        print(f"{name}: {r['error']}\n{r['tail']}", flush=True)
                        continue
                    cold, warm = r["generate_seconds"]
                    d = r.get("spec_decode")
                    accepted = f"{d['num_accepted_tokens']:.0f} of {d['num_draft_tokens']:.0f}" if d else "-"
                    w = r.get("warmup")
                    warmup = f"{w[1]:.1f} ({w[0]})" if w else "-"
                    lines.append(f"| {model} | {backend} | {mode} | {spec} | {r['init_seconds']:.1f} | {warmup} | "
                                 f"{cold:.2f}, {warm:.2f} | {r['jit']} | {accepted} | ok |")
                    print(f"{name}: init {r['init_seconds']:.1f} s (QSA warm-up {warmup}), generate {cold:.2f} / "
                          f"{warm:.2f} s, accepted {accepted}", flush=True)
    failures = []
    lines += ["", "| comparison | equal prompts | where they part: top-2 log-prob margin in each run; each token's "
              "distance below HF fp32's likeliest |", "|---|---|---|"]
    asked = prompts(lengths)

    def compare(label: str, folder: str, a: dict | None, b: dict | None, ours: tuple[bool, bool]) -> None:
        """Token for token; where two runs part, either both stand at a bf16 tie of their two
        likeliest tokens (log-prob margin <= TIE in each run: the logits are one or two bf16 steps
        apart, so any change of summation order flips greedy), or each token of a QSA_CORE run
        (ours: which of a, b are) is within HF_TIE of the likeliest by transformers' fp32 model on
        the checkpoint in folder (the oracle); else the comparison fails."""
        if not a or not b or "error" in a or "error" in b:
            return
        same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
        first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
                 for x, y in zip(a["tokens"], b["tokens"])]
        notes, failed = [], False
        for i, j in enumerate(first):
            if j is None:
                continue
            ma, mb = margin(a, i, j), margin(b, i, j)
            lp = hf_logprobs(folder, asked[i] + a["tokens"][i][:j])
            gaps = [round(float(lp.max() - lp[r["tokens"][i][j]]), 4) for r in (a, b)]
            notes.append(f"prompt {i} at token {j}: {ma}, {mb}; HF {gaps[0]}, {gaps[1]}")
            tie = ma is not None and mb is not None and max(ma, mb) <= TIE
            failed |= any(ours) and not tie and any(g > HF_TIE for g, mine in zip(gaps, ours) if mine)
        lines.append(f"| {label} | {same}/{len(lengths)} | " + ("; ".join(notes) or "-") + " |")
        if failed:
            failures.append(label)

    def margin(r: dict, prompt: int, position: int) -> float | None:
        """The log-prob gap between the two likeliest tokens at a generated position (None without
        log-probs)."""
        if not r.get("logprobs"):
            return None
        top = sorted(r["logprobs"][prompt][position].values(), reverse=True)
        return round(top[0] - top[1], 4) if len(top) > 1 else None

    for (model, backend, mode, spec), r in results.items():
        tag = f" MTP {spec}" if spec else ""
        folder = os.path.join(args.out, f"ckpt-{model}" + ("-mtp" if spec else ""))
        mine = backend != "upstream"
        if mine:
            compare(f"{model}{tag} {mode}: {backend} vs upstream", folder, r,
                    results.get((model, "upstream", mode, spec)), (True, False))
        if mode == "graphs":
            compare(f"{model}{tag} {backend}: graphs vs eager", folder, r, results.get((model, backend, "eager", spec)),
                    (mine, mine))
        if spec:
            compare(f"{model} {backend} {mode}: MTP {spec} vs none", folder, r,
                    results.get((model, backend, mode, 0)), (mine, mine))
    failures += [f"{m} {b} {mode} MTP {spec}: {r['error']}"
                 for (m, b, mode, spec), r in results.items() if "error" in r]
    if args.server:
        served = serve_and_ask(args.out, os.path.join(args.out, "ckpt-full"), env, lengths, kv)
        if "error" in served:
            failures.append(f"server: {served['error']}")
        compare("full QSA_CORE: OpenAI server (graphs) vs LLM.generate (graphs)", os.path.join(args.out, "ckpt-full"),
                served, results.get(("full", "QSA_CORE", "graphs", 0)), (True, True))
    lines += ["", f"failures: {failures or 'none'}"]
    with open(os.path.join(args.out, f"summary{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
