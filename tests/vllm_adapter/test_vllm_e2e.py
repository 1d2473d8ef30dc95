"""End to end: vLLM's own Qwen4-Exp model (QSA layers on qsa_core) against transformers.

Checkpoints are written by transformers' `save_pretrained` (conftest); vLLM runs in a
subprocess (`vllm_generate.py`) with small batches on purpose: chunked prefills, decodes
beside prefills, finished requests' blocks and rings reused by waiting ones.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from hf_reference import greedy, prompt_logprobs, selection_gaps
from qwen4_checkpoint import VOCAB, tiny_config

from transformers import Qwen4ExpForCausalLM

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_generate.py")
# budget 16 tokens: every prompt from 20 tokens on selects (all but the first)
LENGTHS = [9, 41, 57, 76, 30, 63, 21]
MAX_TOKENS = [8, 10, 6, 12, 8, 10, 6]
ENGINE = dict(block_size=16, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32,
              enable_chunked_prefill=True, kv_cache_memory_bytes=64 << 20)
MIN_GAP = 1e-4  # relative top-k boundary margin: 10x the ~1e-5 relative fp32 drift of hidden states


def make_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


PROMPTS = make_prompts(1, LENGTHS)


def run_vllm(tmp_path, name: str, request: dict) -> dict:
    (tmp_path / f"{name}.json").write_text(json.dumps(request))
    out = tmp_path / f"{name}.out.json"
    run = subprocess.run([sys.executable, DRIVER, str(tmp_path / f"{name}.json"), str(out)],
                         capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def hf_greedy(full_checkpoint):
    """HF's greedy tokens of PROMPTS, and the top-k boundary gaps of every selection made."""
    _, model = full_checkpoint
    with selection_gaps() as gaps:
        tokens = greedy(model, PROMPTS, MAX_TOKENS)
    return tokens, gaps


def test_checkpoint_selections_have_a_clear_gap(hf_greedy):
    _, gaps = hf_greedy
    assert len(gaps) > 400  # selections happened (rows past the budget, both layers)
    assert min(gaps) > MIN_GAP, sorted(gaps)[:5]


def test_fp32_greedy_tokens_equal_transformers(tmp_path, full_checkpoint, hf_greedy):
    folder, model = full_checkpoint
    want, _ = hf_greedy
    result = run_vllm(tmp_path, "full", {
        "llm": dict(model=folder, dtype="float32", enable_prefix_caching=False, **ENGINE),
        "prompts": PROMPTS, "max_tokens": MAX_TOKENS})
    assert result["tokens"] == want
    # selection matters: with a budget above every length (dense attention) tokens change
    dense = Qwen4ExpForCausalLM(tiny_config(indexer_budget=256)).float().eval()
    dense.load_state_dict(model.state_dict())
    changed = [d != t for d, t in zip(greedy(dense, PROMPTS, MAX_TOKENS), want)]
    assert not changed[0] and sum(changed) >= 3  # the 9-token prompt never selects


def test_prefix_caching_without_linear_layers_is_refused(tmp_path, full_checkpoint):
    folder, _ = full_checkpoint
    request = {"llm": dict(model=folder, dtype="float32", enable_prefix_caching=True, **ENGINE),
               "prompts": PROMPTS[:1], "max_tokens": [1]}
    (tmp_path / "pc.json").write_text(json.dumps(request))
    run = subprocess.run([sys.executable, DRIVER, str(tmp_path / "pc.json"), str(tmp_path / "pc.out")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "set enable_prefix_caching=False" in run.stderr


# The hybrid model: prompts that share their first 48 tokens (3 blocks of 16 = 12 groups)
HYBRID_LENGTHS = [70, 37, 52, 25]
SHARED = 48


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_hybrid_bf16_prompt_logprobs_as_close_as_transformers_bf16(tmp_path, hybrid_checkpoint, prefix_caching):
    folder, model = hybrid_checkpoint
    prompts = make_prompts(2, HYBRID_LENGTHS)
    prompts[1:] = [prompts[0][:SHARED] + p for p in prompts[1:]]
    engine = dict(ENGINE, block_size=None, max_num_seqs=1, max_num_batched_tokens=64)
    del engine["block_size"]
    result = run_vllm(tmp_path, "hybrid", {
        "llm": dict(model=folder, dtype="bfloat16", enable_prefix_caching=prefix_caching, **engine),
        "prompts": prompts, "max_tokens": [1] * len(prompts), "prompt_logprobs": True})
    if prefix_caching:  # later prompts reuse the first one's blocks (QSA and GDN state)
        assert all(n > 0 for n in result["cached_tokens"][1:])
    else:
        assert result["cached_tokens"] == [0] * len(prompts)
    hf_bf16 = Qwen4ExpForCausalLM(model.config).to(torch.bfloat16).eval()
    hf_bf16.load_state_dict(model.state_dict())
    for i, prompt in enumerate(prompts):
        ref = prompt_logprobs(model, prompt)
        mine = torch.tensor(result["prompt_logprobs"][i])
        theirs = prompt_logprobs(hf_bf16, prompt)
        err, hf_err = (mine - ref).abs().mean(), (theirs - ref).abs().mean()
        # two independent bf16 roundings of the same fp32 math: within 2x of HF's own, and
        # far below the spread of the log-probs themselves
        assert err <= 2 * hf_err + 1e-3, (i, float(err), float(hf_err))
        assert err < 0.05 * ref.std()
