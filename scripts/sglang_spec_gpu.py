"""Speculative decoding (NEXTN, the MTP layer) with `--attention-backend qsa_core` on a GPU.

    python scripts/sglang_spec_gpu.py CHECKPOINT [--tp 1] [--new 48] [--out sglang-spec-gpu]

Needs a CUDA host with SGLang 0.5.23 and this repo installed in the running python (its
`sglang.srt.plugins` entry point registers `qsa_core`), and a Qwen4-Exp checkpoint with its
MTP layer (the released Qwen3.8-Flash-Next, or a mini one with `mtp.*` weights). The CPU CI
runs NEXTN through the server on a tiny checkpoint without trained MTP weights
(tests/sglang_adapter/test_server.py); this is the GPU check, with SGLang's CUDA paths,
CUDA graphs and real acceptance.

One server at a time on 127.0.0.1 (each stopped by its pid before the next starts), the same
greedy requests to each: three token-id prompts of 2200, 3100 and 4500 tokens (past the
budget of 2048: every row past it selects 512 groups), `max_new_tokens` --new, ignore_eos.
Servers:

| name | backend | speculation |
|---|---|---|
| core | qsa_core | none |
| core-mtp1 | qsa_core | NEXTN, 1 draft token (steps 1, draft tokens 2) |
| core-mtp3 | qsa_core | NEXTN, 3 draft tokens (steps 3, draft tokens 4): C = 8 ring rows |
| qsa | SGLang's qsa | none |
| qsa-mtp3 | SGLang's qsa | NEXTN, 3 draft tokens: SGLang's ring of r rows |

Checks (exit code 1 if one fails): core-mtp1 and core-mtp3 give core's ids token for token;
core gives qsa's. qsa-mtp3 against qsa is reported, not checked: with 3 draft tokens SGLang's
own ring can lose a committed raw key after a rejection (design.md §6.7), which shows as a
divergence only when the wrong group key moves a group across a later row's top-k boundary.
A divergence is printed with the first differing position and the non-speculative run's
top-2 logprob margin there (a margin below ~0.02 is a bf16 near-tie, not a bug). The
acceptance rate and length come from SGLang's `meta_info`. Everything lands in
OUT/summary.json and OUT/<name>.log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from server_process import ServerProcess  # noqa: E402

START_TIMEOUT_S = 1200  # weights, CUDA graphs, Triton/JIT compiles of a large checkpoint
REQUEST_TIMEOUT_S = 900
PROMPT_LENS = (2200, 3100, 4500)
SERVERS = {
    "core": ("qsa_core", 0),
    "core-mtp1": ("qsa_core", 1),
    "core-mtp3": ("qsa_core", 3),
    "qsa": ("qsa", 0),
    "qsa-mtp3": ("qsa", 3),
}
CHECKED = (("core-mtp1", "core"), ("core-mtp3", "core"), ("core", "qsa"))
REPORTED = (("qsa-mtp3", "qsa"),)


def command(model: str, backend: str, drafts: int, port: int, tp: int) -> list[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--attention-backend", backend,
        "--dtype", "bfloat16", "--tp-size", str(tp), "--host", "127.0.0.1", "--port", str(port),
        "--max-running-requests", "4", "--disable-radix-cache",
    ]
    if drafts:
        cmd += ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(drafts),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(drafts + 1)]
    return cmd


def serve(name: str, model: str, prompts: list[list[int]], new: int, tp: int, out_dir: str) -> dict:
    backend, drafts = SERVERS[name]
    served = ServerProcess.launch(lambda port: command(model, backend, drafts, port, tp),
                                  os.path.join(out_dir, f"{name}.log"), timeout_s=START_TIMEOUT_S)
    url = served.url
    try:
        results = []
        for ids in prompts:
            r = requests.post(url + "/generate", timeout=REQUEST_TIMEOUT_S, json={
                "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
            })
            r.raise_for_status()
            body = r.json()
            meta = body["meta_info"]
            top = meta.get("output_top_logprobs") or []
            margins = [round(t[0][0] - t[1][0], 4) if t and len(t) > 1 else None for t in top]
            results.append({
                "ids": body["output_ids"], "margins": margins,
                "accept_rate": meta.get("spec_accept_rate"), "accept_length": meta.get("spec_accept_length"),
            })
        return {"backend": backend, "drafts": drafts, "requests": results}
    finally:
        served.stop()


def compare(runs: dict, a: str, b: str) -> list[dict]:
    """Per prompt: equal, or the first differing position and b's top-2 margin there."""
    rows = []
    for i, (ra, rb) in enumerate(zip(runs[a]["requests"], runs[b]["requests"])):
        first = next((j for j, (x, y) in enumerate(zip(ra["ids"], rb["ids"])) if x != y), None)
        rows.append({"prompt": PROMPT_LENS[i], "equal": first is None, "first_difference": first,
                     "margin_there": None if first is None else rb["margins"][first]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--out", default="sglang-spec-gpu")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    config = json.load(open(os.path.join(args.checkpoint, "config.json")))
    vocab = (config.get("text_config") or config)["vocab_size"]
    rng = random.Random(0)
    lo, hi = min(1000, vocab // 2), min(vocab, 100_000)  # clear of the special tokens of small vocabularies
    prompts = [[rng.randrange(lo, hi) for _ in range(n)] for n in PROMPT_LENS]
    runs = {}
    for name in args.servers:
        t0 = time.monotonic()
        runs[name] = serve(name, args.checkpoint, prompts, args.new, args.tp, args.out)
        accept = [(r["accept_rate"], r["accept_length"]) for r in runs[name]["requests"]]
        print(f"{name}: {time.monotonic() - t0:.0f} s; acceptance (rate, length) per prompt: {accept}", flush=True)
    summary = {"runs": runs, "checked": {}, "reported": {}}
    failed = False
    for kind, pairs in (("checked", CHECKED), ("reported", REPORTED)):
        for a, b in pairs:
            if a in runs and b in runs:
                rows = compare(runs, a, b)
                summary[kind][f"{a} vs {b}"] = rows
                print(f"{kind} {a} vs {b}: {rows}")
                failed |= kind == "checked" and not all(r["equal"] for r in rows)
    json.dump(summary, open(os.path.join(args.out, "summary.json"), "w"), indent=1)
    print("FAILED" if failed else "OK", "->", os.path.join(args.out, "summary.json"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
