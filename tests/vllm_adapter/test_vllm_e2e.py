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
from hf_reference import greedy, selection_gaps
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


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, full_checkpoint):
    """vLLM's greedy tokens of PROMPTS (fp32) and the metadata of every step it ran."""
    folder, _ = full_checkpoint
    tmp = tmp_path_factory.mktemp("fp32_run")
    result = run_vllm(tmp, "full", {
        "llm": dict(model=folder, dtype="float32", enable_prefix_caching=False, **ENGINE),
        "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "record_steps": str(tmp / "steps.pt")})
    return result["tokens"], torch.load(tmp / "steps.pt")


def test_fp32_greedy_tokens_equal_transformers(full_checkpoint, hf_greedy, fp32_run):
    _, model = full_checkpoint
    want, _ = hf_greedy
    tokens, _ = fp32_run
    assert tokens == want
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


# The hybrid model: vLLM raises its block size to 256 (the GDN state's page), so prefix-cache
# hits are 256 tokens (64 groups): the later prompts share the first prompt's first 280.
HYBRID_LENGTHS = [300, 40, 70]
SHARED = 280


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_hybrid_bf16_logprobs_as_close_as_transformers_bf16(tmp_path, hybrid_checkpoint, prefix_caching):
    """Log-probs of the 20 likeliest tokens at each generated position (vLLM does not serve prompt
    log-probs from cached blocks, so generated positions carry the prefix-cache case)."""
    folder, model = hybrid_checkpoint
    prompts = make_prompts(2, HYBRID_LENGTHS)
    prompts[1:] = [prompts[0][:SHARED] + p for p in prompts[1:]]
    engine = dict(ENGINE, max_model_len=512, max_num_seqs=1, max_num_batched_tokens=128)
    del engine["block_size"]
    n = 4
    result = run_vllm(tmp_path, "hybrid", {
        "llm": dict(model=folder, dtype="bfloat16", enable_prefix_caching=prefix_caching, **engine),
        "prompts": prompts, "max_tokens": [n] * len(prompts), "logprobs": 20})
    if prefix_caching:  # later prompts reuse the first one's 256-token block (QSA pages, GDN state)
        assert result["cached_tokens"][1:] == [256] * (len(prompts) - 1)
    else:
        assert result["cached_tokens"] == [0] * len(prompts)
    hf_bf16 = Qwen4ExpForCausalLM(model.config).to(torch.bfloat16).eval()
    hf_bf16.load_state_dict(model.state_dict())
    for i, prompt in enumerate(prompts):
        seq = prompt + result["tokens"][i]
        ref, theirs = generated_logprobs(model, seq, n), generated_logprobs(hf_bf16, seq, n)
        for j, top in enumerate(result["logprobs"][i]):
            ids = torch.tensor([int(t) for t in top])
            mine = torch.tensor(list(top.values()))
            err, hf_err = (mine - ref[j, ids]).abs().max(), (theirs[j, ids] - ref[j, ids]).abs().max()
            # two independent bf16 roundings of the same fp32 math: within 2x of HF's own
            assert err <= 2 * hf_err + 2e-2, (i, j, float(err), float(hf_err))


@torch.no_grad()
def generated_logprobs(model, seq: list[int], n: int) -> torch.Tensor:
    """fp32 log-softmax [n, vocab] at the positions that predicted the last n tokens of seq."""
    logits = model(torch.tensor([seq])).logits[0, -n - 1 : -1].float()
    return torch.log_softmax(logits, -1)


def test_core_record_of_every_real_vllm_step(fp32_run):
    """The map on the metadata vLLM's scheduler and model runner produced for this run, checked
    against what vLLM itself says about each row (its own positions, slots, block tables)."""
    _, steps = fp32_run
    r, kinds = 4, set()
    for step in steps:
        c, meta, g = step["common"], step["meta"], step["geometry"]
        R, T = c["num_reqs"], c["num_actual_tokens"]
        qsl = c["query_start_loc_cpu"].long()
        qlen, seq = qsl[1:] - qsl[:-1], c["seq_lens"][:R].long()
        real = int(qsl[-1])
        req = torch.repeat_interleave(torch.arange(R), qlen)
        pos = c["positions"][:real]
        assert meta["num_tokens"] == T and meta["num_reqs"] == R
        assert torch.equal(meta["token_to_req"][:real].long(), req)
        assert torch.equal(meta["positions"][:real], pos)  # vLLM's own positions
        assert (meta["positions"][real:] == -1).all() and (meta["visible_blocks"][real:] == 0).all()
        assert torch.equal(meta["visible_blocks"][:real].long(), torch.minimum((pos + 1) // r, seq[req] // r))
        # vLLM's slot of each row, renumbered to the core's pages (block * page_scale)
        slots = c["slot_mapping"][:T]
        page, scale = g["page_size"], g["page_scale"]
        core = torch.where(slots >= 0, (slots // page) * scale * page + slots % page, -1)
        assert torch.equal(meta["slot_mapping"], core)
        closes = torch.zeros(T, dtype=torch.bool)
        closes[:real] = (pos + 1) % r == 0
        assert torch.equal(meta["compressed_slot"], torch.where(closes & (core >= 0), core // r, -1))
        C = g["ring_capacity"]
        ring_row = step["ring_block_table"][:R, 0].long() * g["ring_stride"]
        last_c = torch.arange(real) >= (qsl[1:][req] - C)
        want_ring = torch.where(last_c, ring_row[req] * C + pos % C, -1)
        assert torch.equal(meta["ring_slot"][:real], want_ring)
        assert torch.equal(meta["block_table"][:R], c["block_table"][:R] * scale)
        decodes = int((torch.cumprod((qlen == 1).int(), 0)).sum())
        assert meta["num_decodes"] == decodes
        kinds.add("decode" if decodes == R else "prefill" if decodes == 0 else "mixed")
        if ((seq - qlen > 0) & (qlen > 1)).any():
            kinds.add("chunked")
        if T > real:
            kinds.add("padded")
    assert {"decode", "prefill", "mixed", "chunked"} <= kinds, kinds
