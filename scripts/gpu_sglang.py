"""SGLang on a GPU: `--attention-backend qsa_core` against SGLang's own `qsa`, eager and with CUDA
graphs, and NEXTN speculative decoding (the MTP layer, 3 draft tokens) on qsa_core.

    python3 scripts/gpu_sglang.py OUT_DIR [--modes eager,graphs] [--backends qsa_core,qsa]
                                  [--no-spec] [--redo] [--smoke]

Run where SGLang 0.5.23's GPU build and this repo are installed (`pip install --no-deps .`
registers the `sglang.srt.plugins` entry point behind `qsa_core`; `../shared/gpu-stage` stages
SGLang on the GPU host). It writes OUT_DIR/ckpt: a bf16 `Qwen4ExpForConditionalGeneration`
(SGLang's only Qwen4-Exp entry class) with GDN, QSA, GDN, QSA decoder layers at the production
attention geometry (24 query / 2 KV heads of 256, indexer 4 x 128, budget 2048 tokens in groups
of 4, partial rotary 0.25, interleaved MRoPE (11, 11, 10)), one MTP layer, random weights
(`tests/sglang_adapter/tiny_checkpoint.py`'s config and processor, `tests/vllm_adapter/
qwen4_checkpoint.py`'s weights and MTP layer). Then one `python3 -m sglang.launch_server` at a
time (tests/server_process.py: a free port on 127.0.0.1, a bounded start, stopped by its pid),
in this order:

| run | backend | CUDA graphs | speculation |
|---|---|---|---|
| qsa_core-eager | qsa_core | off | - |
| qsa_core-graphs | qsa_core | SGLang's default: decode (batch <= 8), breakable prefill | - |
| qsa_core-graphs-nextn3 | qsa_core | as qsa_core-graphs, and draft graphs | NEXTN, 3 drafts (C = 8 raw-key ring rows) |
| qsa-eager, qsa-graphs | SGLang's qsa | off / default | - |
| qsa-graphs-nextn3 | SGLang's qsa | as qsa-graphs, and draft graphs | NEXTN, 3 drafts (SGLang's ring of r = 4 rows) |

NEXTN runs as the released model is served, with CUDA graphs, where the call runs graphs (else in
its first mode). SGLang 0.5.23's EAGLE draft worker imports `flash_mla` (the `sgl-flash-mla`
wheel) when it captures draft graphs on CUDA, for any attention backend: the host needs it
(`--modes eager` runs NEXTN eagerly without it). `--modes decodegraphs` adds decode graphs with
prefill eager (a fallback should the breakable prefill graphs fail). A graphs run must log a
captured decode graph, an eager run none.

Each server gets two waves of six prompts of 40 to 8000 tokens, each wave at once (`input_ids` on
/generate, chunked prefill of 2048 tokens, so long prompts prefill beside decodes), greedy, 16
tokens, ignore_eos, with the top-2 log-probs of every token (not for the NEXTN run). The second
wave's prompts have the first's lengths and other tokens (another seed, no first token in common, so
nothing of the first wave is reused): the first wave's time (`generate_s`) includes the kernel
compiles left after start-up, the second's (`warm_s`) is the same work served warm. Checks (exit 1
on a failure), on every prompt of both waves: qsa_core equals qsa in each mode, qsa_core's graphs
equal its eager run, and NEXTN equals qsa_core without speculation; token for token, except where
the runs part at a bf16 tie of the two likeliest tokens (log-prob margin <= 2^-6 in each run that
has log-probs: random weights make such ties common). Reported, not checked: qsa's graphs against
its eager run, and qsa's NEXTN run against qsa without it (with 3 drafts SGLang's ring of r rows can
lose a committed raw key after a rejected window, design.md §6.7; it shows in the tokens only where
the wrong group key moves a group across a later row's top-k boundary). The random MTP layer drafts
right some of the time (`qwen4_checkpoint.add_mtp_layer`), so windows are both accepted and
rejected; the summary gives SGLang's verify steps and accepted drafts. Each server's log must name
the backend that served it (qsa_core's plugin line and its 8-row ring with NEXTN; SGLang's QSA line)
and hold no guard report (requests whose rows the device guards made inert: `qsa_core.guard`).

Every run's JSON (`<run>.json`) and log (`<run>.log`) land in OUT_DIR as soon as it ends, and
OUT_DIR/summary.md is rewritten after each run. A run whose JSON is already there with both waves'
times and no error is kept (give --redo to run it again), so a call cut by a time limit, or calls
split by --backends / --modes, continue in the same OUT_DIR and the summary compares everything
there; a JSON with neither `warm_s` nor an error counts as not run.

A server starts in about 1-2.5 minutes on the GPU host (start-up kernel warm-up, Triton and JIT
compiles, graph capture; estimated, not measured), so the default set (6 runs) takes about 10-12
minutes: split it in calls of at most 9 minutes, `--backends qsa_core` then `--backends qsa`, each
under `timeout -s TERM` (the script then stops its server by pid and exits).

--smoke: the same script on the CPU through SGLang's CPU build (device cpu, eager only, the
tests' tiny geometry: hidden 256, 4 / 2 heads of 64, budget 2048, every layer QSA; two waves of
prompts of 40, 300 and 2200 tokens, 6 tokens each) to prove it end to end; SGLang's own qsa runs
there with the server tests' CPU patch (tests/sglang_adapter/server_site).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [os.path.join(TESTS, "sglang_adapter"), os.path.join(TESTS, "vllm_adapter"), TESTS]
from qsa_core.guard import guard_reports  # noqa: E402
from server_process import ServerProcess  # noqa: E402

TIE = 2**-6  # two bf16 steps of a logit in [1, 2)
SEED = 7
WAVE_SEEDS = (5, 6)  # the prompts of each wave: the same lengths, no first token in common
DRAFTS = 3  # NEXTN as the released model runs: 3 draft steps, chain drafts
NEXTN = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(DRAFTS), "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", str(DRAFTS + 1)]
MODES = {  # mode -> server flags
    "eager": ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"],
    "graphs": [],  # SGLang's default on CUDA: full decode graphs, breakable prefill graphs
    "decodegraphs": ["--cuda-graph-backend-prefill=disabled"],  # decode graphs, prefill eager
}
CAPTURED = re.compile(r"Capture ([\w ]+?) CUDA graph end")  # SGLang's line after each graph capture
SITE = os.path.join(TESTS, "sglang_adapter", "server_site")  # the server tests' CPU patch for SGLang's own qsa
CORE_LINE = "QSA layers run on qsa_core"  # the plugin's line when qsa_core builds its backend
QSA_LINE = "Using QSA for sparse full-attention layers"  # SGLang's line for its own QSA backend
RING_LINE = f"raw-key ring {4 * -(-(4 + DRAFTS) // 4)} rows per request"  # C = r * ceil((r + drafts) / r)

# The production attention geometry (design.md §1) on a few layers; the rest as the tests' model.
PRODUCTION = dict(
    hidden_size=1024, num_attention_heads=24, num_key_value_heads=2, head_dim=256, indexer_n_heads=4,
    indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
GDN = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128)


# SGLang on the GPU host without flashinfer: GDN on Triton; the vision tower (unused by token-id
# requests) on Triton too, which needs nothing from the trimmed sglang-kernel (its default on
# Hopper is FA3). 70 % of the GPU for weights and caches leaves room for the graphs and
# qsa_core's step workspace (128K x 32 requests of KV take 18 GB at 2 QSA layers).
GPU_FLAGS = ("--linear-attn-backend", "triton", "--mm-attention-backend", "triton_attn", "--mem-fraction-static", "0.7")


@dataclass(frozen=True)
class Profile:
    """What one invocation serves: the GPU set or the CPU smoke."""

    lengths: tuple[int, ...]
    new_tokens: int
    context: int  # max_position_embeddings (SGLang's context length)
    chunk: int  # --chunked-prefill-size
    hybrid: bool  # (GDN, QSA) x layer_pairs, else QSA x 2 layer_pairs
    start_timeout_s: float
    request_timeout_s: float
    flags: tuple[str, ...]  # server flags of the device
    text: dict = field(default_factory=dict)  # text-config overrides of the tests' tiny config
    layer_pairs: int = 2


GPU = Profile(
    lengths=(40, 700, 2100, 3000, 5000, 8000), new_tokens=16, context=8320, chunk=2048, hybrid=True,
    start_timeout_s=420, request_timeout_s=420, text=PRODUCTION,
    flags=("--cuda-graph-max-bs-decode", "8", *GPU_FLAGS),
)
SMOKE = Profile(
    lengths=(40, 300, 2200), new_tokens=6, context=4096, chunk=1024, hybrid=False,
    start_timeout_s=400, request_timeout_s=900,
    flags=("--device", "cpu", "--max-total-tokens", "16384"),
)


@dataclass(frozen=True)
class Run:
    backend: str
    mode: str  # a key of MODES
    drafts: int = 0

    @property
    def name(self) -> str:
        return f"{self.backend}-{self.mode}" + (f"-nextn{self.drafts}" if self.drafts else "")


def plan(backends: list[str], modes: list[str], spec: bool,
         spec_backends: tuple[str, ...] = ("qsa_core", "qsa")) -> list[Run]:
    """The runs in order: qsa_core's first; each backend's NEXTN run right after its plain run of that mode."""
    runs = []
    for backend in sorted(backends, key=lambda b: b != "qsa_core"):
        for mode in modes:
            runs.append(Run(backend, mode))
            if spec and backend in spec_backends and mode == spec_mode(modes):
                runs.append(Run(backend, mode, DRAFTS))
    return runs


def spec_mode(modes: list[str]) -> str:
    """NEXTN runs with CUDA graphs where the call runs them (the released model's serving), else
    in the call's first mode."""
    return "graphs" if "graphs" in modes else modes[0]


# -- the checkpoint --------------------------------------------------------------------------

def write_checkpoint(folder: str, profile: Profile) -> str:
    """A bf16 Qwen4ExpForConditionalGeneration with one MTP layer in `folder` (kept if there)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    import torch
    from qwen4_checkpoint import add_mtp_layer, randomize
    from tiny_checkpoint import hf_config, save_processor
    from transformers import Qwen4ExpForConditionalGeneration

    pair = ["linear_attention", "full_attention"] if profile.hybrid else ["full_attention"] * 2
    layers = pair * profile.layer_pairs
    config = hf_config(**profile.text, **GDN, layer_types=layers, num_hidden_layers=len(layers),
                       max_position_embeddings=profile.context)
    torch.manual_seed(SEED)
    model = Qwen4ExpForConditionalGeneration(config).eval()
    randomize(model, SEED)
    model.to(torch.bfloat16).save_pretrained(folder)
    save_processor(folder)  # SGLang loads a processor even with --skip-tokenizer-init
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        saved = json.load(f)
    # SGLang reads full_attention_interval; transformers does not write it
    saved["text_config"]["full_attention_interval"] = 2 if profile.hybrid else 1
    with open(path, "w") as f:
        json.dump(saved, f, indent=2)
    add_mtp_layer(folder, model, SEED)
    return folder


def prompts(profile: Profile, seed: int) -> list[list[int]]:
    """One wave: a random prompt of each of the profile's lengths."""
    import torch
    from tiny_checkpoint import VOCAB_WORDS

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_WORDS, (n,), generator=g).tolist() for n in profile.lengths]


def prompt_count(profile: Profile) -> int:
    """The prompts a run serves: every wave's."""
    return len(WAVE_SEEDS) * len(profile.lengths)


# -- one server -----------------------------------------------------------------------------

def command(folder: str, run: Run, profile: Profile, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", folder, "--attention-backend", run.backend,
           "--skip-tokenizer-init", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
           "--disable-radix-cache", "--skip-server-warmup", "--max-running-requests", "8",
           "--chunked-prefill-size", str(profile.chunk), "--log-level", "info", *profile.flags]
    return cmd + MODES[run.mode] + (NEXTN if run.drafts else [])


def server_env(run: Run, smoke: bool) -> dict[str, str]:
    if not smoke:
        return {}
    env = {"TORCHDYNAMO_DISABLE": "1"}  # SGLang's torch.compile of its MoE top-k: minutes of C++ builds on a CPU
    if run.backend == "qsa":
        env.update(QSA_TEST_BASELINE="1", TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH", "")) if p))
    return env


def generate(url: str, ids: list[int], profile: Profile, logprobs: bool) -> dict:
    import requests

    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": profile.new_tokens, "temperature": 0.0,
                                                  "ignore_eos": True}}
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=2)
    r = requests.post(url + "/generate", json=body, timeout=profile.request_timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code} for a {len(ids)}-token prompt: {r.text[:500]}")
    out = r.json()
    meta = out["meta_info"]
    top = meta.get("output_top_logprobs") or []
    return {"ids": out["output_ids"],
            "margins": [round(t[0][0] - t[1][0], 4) if t and len(t) > 1 else None for t in top],
            "spec": {k: v for k, v in meta.items() if k.startswith("spec_")}}


def wave(pool: ThreadPoolExecutor, url: str, batch: list[list[int]], profile: Profile,
         logprobs: bool) -> tuple[list[dict], float]:
    """Send every prompt of `batch` at once; their outputs and the wave's seconds."""
    t0 = time.monotonic()
    done = list(pool.map(lambda ids: generate(url, ids, profile, logprobs), batch))
    return done, round(time.monotonic() - t0, 2)


def serve(out: str, folder: str, run: Run, profile: Profile, smoke: bool) -> dict:
    """Start the server of `run`, send each wave's prompts at once, one wave after the other, stop
    it; the result (or its error)."""
    log = os.path.join(out, f"{run.name}.log")
    t0 = time.monotonic()
    result: dict = {"backend": run.backend, "mode": run.mode, "drafts": run.drafts}
    try:
        server = ServerProcess.launch(lambda port: command(folder, run, profile, port), log,
                                      server_env(run, smoke), profile.start_timeout_s)
    except (RuntimeError, TimeoutError) as e:
        lines = str(e).splitlines()
        return {**result, "error": f"start: {lines[0]}", "tail": lines[1:], "wall_s": round(time.monotonic() - t0, 1)}
    pool = ThreadPoolExecutor(len(profile.lengths))
    try:
        first, cold_s = wave(pool, server.url, prompts(profile, WAVE_SEEDS[0]), profile, not run.drafts)
        second, warm_s = wave(pool, server.url, prompts(profile, WAVE_SEEDS[1]), profile, not run.drafts)
        done = first + second
        result.update(start_s=round(server.start_s, 1), generate_s=cold_s, warm_s=warm_s,
                      tokens=[d["ids"] for d in done], margins=[d["margins"] for d in done],
                      spec=[d["spec"] for d in done])
    except Exception as e:  # noqa: BLE001  (any failure of a request is this run's result)
        result["error"] = f"requests: {type(e).__name__}: {str(e)[:500]}"
    finally:
        server.stop()  # first: requests still in flight then fail at once
        pool.shutdown(wait=False, cancel_futures=True)
    text = server.log_text()
    result["captured"] = sorted(set(CAPTURED.findall(text)))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    error = log_error(run, text)
    if error and "error" not in result:
        result["error"] = error
    decode_graphs = any("decode" in c or "verify" in c for c in result["captured"])
    if "error" not in result and decode_graphs != (run.mode != "eager"):
        result["error"] = f"{run.mode} run, but the graphs SGLang captured are {result['captured']}"
    if "error" in result:
        result["tail"] = server.log_tail(40).splitlines()
    return result


def log_error(run: Run, text: str) -> str | None:
    """What a run's server log shows went wrong: a line naming the backend it must show is
    missing, or a guard report (requests whose rows the device guards made inert); else None."""
    missing = [line for line in expected_lines(run) if line not in text]
    if missing:
        return f"the log lacks {missing}: the server did not run what this run names"
    reports = guard_reports(text)
    if reports:
        return f"{len(reports)} guard report(s) in the log (requests made inert): {reports[0][-300:]}"
    return None


def expected_lines(run: Run) -> list[str]:
    if run.backend == "qsa_core":
        return [CORE_LINE] + ([RING_LINE] if run.drafts else [])
    return [QSA_LINE] if run.backend == "qsa" else []


# -- comparisons and the summary ---------------------------------------------------------------

def compare(a: dict, b: dict) -> tuple[bool, str]:
    """Prompt for prompt (the same number of them), token for token; where the two runs part, every
    run with log-probs must stand at a bf16 tie of its two likeliest tokens there (margin <= TIE),
    and at least one must have log-probs."""
    if len(a["tokens"]) != len(b["tokens"]):
        return False, f"{len(a['tokens'])} against {len(b['tokens'])} prompts"
    notes, ok = [], True
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        j = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if j is None and len(x) == len(y):
            continue
        if j is None:
            ok = False
            notes.append(f"prompt {i}: {len(x)} against {len(y)} tokens")
            continue
        margins = [r["margins"][i][j] for r in (a, b) if r.get("margins") and r["margins"][i]]
        tie = bool(margins) and all(m is not None and m <= TIE for m in margins)
        ok &= tie
        notes.append(f"prompt {i} at token {j}: margins {margins}" + ("" if tie else " (not a tie)"))
    return ok, "; ".join(notes) or "-"


def comparisons(runs: list[Run]) -> list[tuple[str, Run, Run, bool]]:
    """(label, a, b, checked) for every pair the plan defines."""
    names = {r.name for r in runs}
    pairs = []
    for mode in MODES:
        pairs.append((f"{mode}: qsa_core vs qsa", Run("qsa_core", mode), Run("qsa", mode), True))
    for mode in list(MODES)[1:]:
        pairs.append((f"qsa_core: {mode} vs eager", Run("qsa_core", mode), Run("qsa_core", "eager"), True))
        pairs.append((f"qsa: {mode} vs eager (reported)", Run("qsa", mode), Run("qsa", "eager"), False))
    for r in runs:
        if r.drafts:
            checked = r.backend == "qsa_core"
            pairs.append((f"{r.backend} {r.mode}: NEXTN {r.drafts} drafts vs none" + ("" if checked else " (reported)"),
                          r, Run(r.backend, r.mode), checked))
    return [p for p in pairs if p[1].name in names and p[2].name in names]


def summarize(out: str, runs: list[Run], profile: Profile) -> list[str]:
    """Rewrite OUT/summary.md from every run JSON in OUT; the failures."""
    results = {r.name: load(out, r) for r in runs}
    n, count = len(profile.lengths), prompt_count(profile)
    lines = [f"Two waves of prompts of {', '.join(map(str, profile.lengths))} tokens, each wave at once (prompts "
             f"0-{n - 1}, then {n}-{count - 1}: other tokens, the same lengths), {profile.new_tokens} greedy tokens "
             f"each; tie margin {TIE}.", "",
             "| run | start s | first wave s (compiles included) | second wave s | CUDA graphs captured "
             "| NEXTN (verify steps, accepted / proposed) | result |", "|---|---|---|---|---|---|---|"]
    failures = []
    for r in runs:
        res = results[r.name]
        if res is None:
            lines.append(f"| {r.name} | | | | | | not run |")
            continue
        spec = "-"
        if r.drafts and res.get("spec"):
            verify = sum(s.get("spec_verify_ct", 0) for s in res["spec"])
            right = sum(s.get("spec_num_correct_drafts", 0) for s in res["spec"])
            proposed = sum(s.get("spec_num_proposed_drafts", 0) for s in res["spec"])
            spec = f"{verify}, {right} / {proposed}"
            if verify == 0 and "error" not in res:
                res["error"] = "no verify step: speculation did not run"
        lines.append(f"| {r.name} | {res.get('start_s', '')} | {res.get('generate_s', '')} | {res.get('warm_s', '')} | "
                     f"{', '.join(res.get('captured', [])) or '-'} | {spec} | {res.get('error', 'ok')} |")
        if "error" in res:
            failures.append(f"{r.name}: {res['error']}")
    lines += ["", "| comparison | equal prompts | where they part (top-2 log-prob margins) | result |",
              "|---|---|---|---|"]
    for label, a, b, checked in comparisons(runs):
        ra, rb = results.get(a.name), results.get(b.name)
        if not ra or not rb or "error" in ra or "error" in rb:
            lines.append(f"| {label} | | | {'pending' if ra is None or rb is None else 'a run failed'} |")
            continue
        ok, notes = compare(ra, rb)
        same = sum(x == y for x, y in zip(ra["tokens"], rb["tokens"]))
        verdict = "ok" if ok else ("FAILED" if checked else "differs (reported)")
        lines.append(f"| {label} | {same}/{count} | {notes} | {verdict} |")
        if checked and not ok:
            failures.append(label)
    lines += ["", f"failures: {failures or 'none'}"]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return failures


def load(out: str, run: Run) -> dict | None:
    """The run's JSON in OUT; None where there is none or it does not count (`counts`)."""
    path = os.path.join(out, f"{run.name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        result = json.load(f)
    return result if counts(result) else None


def counts(result: dict) -> bool:
    """Whether a run's JSON stands for the run: an error, or both waves' times (`warm_s`); one
    with neither is not this script's result, so the run counts as not run."""
    return "error" in result or "warm_s" in result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="folder for the checkpoint, every run's JSON and log, and summary.md")
    ap.add_argument("--modes", default=None,
                    help="comma-separated subset of eager,graphs,decodegraphs (default eager,graphs; the smoke runs "
                    "eager only). graphs: SGLang's default (decode graphs, breakable prefill graphs); decodegraphs: "
                    "decode graphs with prefill eager")
    ap.add_argument("--backends", default="qsa_core,qsa", help="qsa_core and/or qsa (SGLang's own QSA)")
    ap.add_argument("--spec", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each backend with NEXTN (3 drafts), with graphs (else in the first mode)")
    ap.add_argument("--redo", action="store_true", help="run again the runs whose JSON is already in OUT")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU through SGLang's CPU build")
    args = ap.parse_args(argv)
    modes = (args.modes or ("eager" if args.smoke else "eager,graphs")).split(",")
    backends = args.backends.split(",")
    for name, values, allowed in (("--modes", modes, tuple(MODES)), ("--backends", backends, ("qsa_core", "qsa"))):
        if not values or any(v not in allowed for v in values):
            ap.error(f"{name} takes a comma-separated subset of {','.join(allowed)}, got {','.join(values)}")
    if args.smoke and modes != ["eager"]:
        ap.error(f"--modes {','.join(modes)}: CUDA graphs need a GPU; the smoke runs eager")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU with SGLang's GPU build (torch.cuda.is_available() is False); "
                 "--smoke runs on the CPU")
    profile = SMOKE if args.smoke else GPU
    # `timeout` (or a call's time limit) sends SIGTERM: unwind, so the running server is stopped by its pid.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    folder = write_checkpoint(os.path.join(args.out, "ckpt"), profile)
    print(f"checkpoint {folder}: {time.monotonic() - t0:.0f} s", flush=True)
    # On the CPU SGLang's EAGLE path runs only through qsa_core's plugin (its CPU routing): no NEXTN for qsa there.
    spec_backends = ("qsa_core",) if args.smoke else ("qsa_core", "qsa")
    wanted = plan(backends, modes, args.spec, spec_backends)
    default = plan(["qsa_core", "qsa"], ["eager"] if args.smoke else ["eager", "graphs"], True, spec_backends)
    everything = default + [r for r in wanted if r not in default]  # the summary covers earlier calls' runs too
    for run in wanted:
        earlier = load(args.out, run)
        if not args.redo and earlier is not None and "error" not in earlier:
            print(f"{run.name}: kept from an earlier call", flush=True)
            continue
        result = serve(args.out, folder, run, profile, args.smoke)
        with open(os.path.join(args.out, f"{run.name}.json"), "w") as f:
            json.dump(result, f)
        print(f"{run.name}: {result.get('error', 'ok')} (start {result.get('start_s')} s, first wave "
              f"{result.get('generate_s')} s, second wave {result.get('warm_s')} s, wall {result['wall_s']} s)",
              flush=True)
        if "error" in result:
            print("\n".join(f"    {line}" for line in result.get("tail", [])), flush=True)
        summarize(args.out, everything, profile)
    failures = summarize(args.out, everything, profile)
    with open(os.path.join(args.out, "summary.md")) as f:
        print(f.read())
    print(f"total {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
