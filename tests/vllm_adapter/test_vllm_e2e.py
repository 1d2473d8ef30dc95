"""End to end: `vllm.LLM` with the plugin's QSATinyForCausalLM generates the standalone
Runner's greedy tokens (same random weights, fp32, prompts longer than the budget; the last
two prompts share their first 50 tokens with the third and hit vLLM's prefix cache)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_twin import twin_greedy  # noqa: E402

from qsa_adapters.vllm.tiny_checkpoint import random_tiny_weights, save_tiny_checkpoint, tiny_config  # noqa: E402

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_generate.py")
LENGTHS = [41, 57, 76, 9, 63, 30, 9, 21]  # budget 16 tokens: selection from ~20 tokens on
MAX_TOKENS = [10, 6, 12, 8, 10, 4, 8, 6]
SHARED = 50  # the last two prompts start with the third prompt's first 50 tokens


def test_vllm_generates_the_standalone_greedy_tokens(tmp_path):
    config = tiny_config()
    weights = random_tiny_weights(config, seed=0)
    save_tiny_checkpoint(tmp_path / "model", config, weights)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    prompts[-2:] = [prompts[2][:SHARED] + p for p in prompts[-2:]]
    (tmp_path / "request.json").write_text(json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS}))
    run = subprocess.run(
        [sys.executable, DRIVER, str(tmp_path / "model"), str(tmp_path / "request.json"), str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=540,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads((tmp_path / "out.json").read_text())
    got = result["tokens"]
    # hits are whole blocks (16 tokens, 4 groups): they end on a group boundary
    assert max(result["cached_tokens"][-2:]) == 48

    ref = twin_greedy(config, weights, prompts, max(MAX_TOKENS))
    assert got == [r[:n] for r, n in zip(ref, MAX_TOKENS)]
    # selection matters: with a budget above every length (dense attention) tokens change
    dense = twin_greedy(tiny_config(indexer_budget=256), weights, prompts, max(MAX_TOKENS))
    assert sum(d[:n] != t for d, t, n in zip(dense, got, MAX_TOKENS)) >= 4
