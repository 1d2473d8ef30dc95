"""A tiny Qwen4-Exp checkpoint SGLang 0.5.23 can serve, written by the tests (not product).

`write_checkpoint(folder)` saves a transformers 5.19 `Qwen4ExpForConditionalGeneration`
(the only Qwen4-Exp class SGLang's model registry takes) with:
- every decoder layer QSA (`layer_types` all `full_attention`: SGLang's GDN layers have no
  CPU path) and the production profile: budget 2048 tokens, groups of r = 4 (SGLang's QSA
  accepts only budget / r of 512 or 2048);
- `full_attention_interval` in config.json (SGLang's `qwen3_5.py` reads it; transformers
  does not write it);
- a `Qwen3VLProcessor` beside it (SGLang loads one even for text-only requests) over a
  tokenizer whose words are one token each: `words([5, 17])` is the text of ids [5, 17];
- weights whose indexer scores have a clear gap at the top-k boundary (`gapped_weights`).

Interleaved MRoPE sections (6, 5, 5) cover the 16 rotary pairs (head_dim 64, factor 0.5);
text-only positions feed all three axes.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

VOCAB_WORDS = 448  # " aa" .. ; the specials and the 53 BPE pieces follow
SPECIALS = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
EOS_ID = VOCAB_WORDS  # "<|endoftext|>"; greedy runs use ignore_eos
VOCAB_SIZE = VOCAB_WORDS + len(SPECIALS) + 53  # every id is a token of the tokenizer
LOW_WORDS = range(0, 240, 4)  # low-importance words of gapped prompts, 0.025 importance apart
HIGH_WORDS = range(250, VOCAB_WORDS)  # importance 1.79 .. 3.0
BUDGET, RATIO = 2048, 4
# Rows of the embedding reserved for structure (see gapped_weights).
SHARED_DIM, INDEX_DIM = 0, 1

TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=BUDGET,
    indexer_compress_ratio=RATIO,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    hc_count=2,
    hc_lowrank=8,
    layer_types=["full_attention", "full_attention"],
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256, num_position_embeddings=64)


def hf_config(**text_overrides: Any):
    from transformers import Qwen4ExpConfig

    ids = {name: VOCAB_WORDS + i for i, name in enumerate(SPECIALS)}
    text = {**TEXT, **text_overrides}
    return Qwen4ExpConfig(
        text_config=text,
        vision_config={**VISION, "out_hidden_size": text["hidden_size"]},  # the merger feeds the text model
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def gapped_weights(model, seed: int = 0) -> None:
    """Random weights (norms included), shaped so that the indexer ranks groups clear-cut.

    Every matrix is N(0, 1 / fan_in) and every norm weight 0.3 * N(0, 1) (HF's start at 0
    and would test little). Then, as in a trained model, the indexer looks at one feature:
    - the embedding carries a shared component (channel SHARED_DIM, 2.0 for every token)
      and a per-token importance (channel INDEX_DIM, IMPORTANCE spread over the vocabulary);
    - the indexer key reads importance into key dims A and the shared component into dims
      B (both past the rotary dims), the indexer query reads the shared component into A:
      a group's score grows strictly with imp / sqrt(a * imp^2 + b) of its mean importance;
    - nothing writes to those two channels after the embedding (their rows of o_proj and
      of the expert down projections are 0, their hyper-connection mix gates constant),
      so every layer sees the same ranking: a group of four equal tokens scores exactly as
      its token's importance says, at any position and in any layer;
    - the main attention's keys of the lowest-importance words match every query, so dense
      attention would weigh most the very groups the indexer leaves out, and the LM head
      ignores the two channels: the tokens depend on what the attention reads.
    The tests build prompts whose groups around the budget boundary have distinct
    importance and measure the score gap there.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                p.zero_()
        lm = model.model.language_model
        emb = lm.embed_tokens.weight
        emb[:, SHARED_DIM] = 2.0
        emb[:, INDEX_DIM] = importance()
        text = model.config.text_config
        H, Hi, Di = text.hidden_size, text.indexer_n_heads, text.indexer_head_dim
        rot = int(text.head_dim * text.rope_parameters["partial_rotary_factor"])
        a = rot + (Di - rot) // 2  # dims [rot, a): A, [a, Di): B
        structure = [SHARED_DIM, INDEX_DIM]
        D, Hq = text.head_dim, text.num_attention_heads
        for layer in lm.layers:
            w = layer.self_attn.indexer.index_qk_proj.weight  # [(Hi + 1) * Di, hidden]
            w.mul_(0.01)
            w[:, structure] = 0.0
            w[Hi * Di + rot : Hi * Di + a, INDEX_DIM] = 1.0
            w[Hi * Di + a :, SHARED_DIM] = 1.0
            for h in range(Hi):
                w[h * Di + rot : h * Di + a, SHARED_DIM] = 1.0
            layer.self_attn.indexer.q_layernorm.weight.zero_()
            layer.self_attn.indexer.k_layernorm.weight.zero_()
            # Main attention: keys of low-importance tokens match every query, so dense
            # attention would put its weight on the very groups the indexer leaves out.
            half = (rot + D) // 2  # dims [half, D) of each head: past the rotary dims
            wq, wk = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
            for h in range(Hq):
                wq[h * 2 * D + half : h * 2 * D + D, SHARED_DIM] = 1.5  # q half (gate half follows)
            for h in range(text.num_key_value_heads):
                # 8 * (0.4 - imp): keys of the few words below importance 0.4 match the query,
                # every other key opposes it
                wk[h * D + half : (h + 1) * D, INDEX_DIM] = -8.0
                wk[h * D + half : (h + 1) * D, SHARED_DIM] = 1.6
            layer.self_attn.v_proj.weight.mul_(4.0)  # the attention's share of the residual stream
            layer.self_attn.o_proj.weight[structure] = 0.0
            layer.mlp.experts.down_proj[:, structure] = 0.0
            layer.mlp.shared_expert.down_proj.weight[structure] = 0.0
            for hc in (layer.attn_hyper_connection, layer.mlp_hyper_connection):
                rows = [s * H + c for s in range(text.hc_count) for c in structure]
                hc.input_mix_weight_up.weight[rows] = 0.0  # sigmoid(0): a constant gate
                hc.hc_norm.weight[rows] = 0.0  # the same scale on every stream
        model.lm_head.weight[:, structure] = 0.0  # the tokens follow the attention, not the features


def importance() -> torch.Tensor:
    """fp32 [VOCAB_SIZE]: token t's importance, increasing with t over the words (0.25 .. 3)."""
    imp = torch.full((VOCAB_SIZE,), 1.0)
    imp[:VOCAB_WORDS] = torch.linspace(0.25, 3.0, VOCAB_WORDS)
    return imp


def vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary and merges: word i is " " + two letters, one token.

    transformers loads Qwen4-Exp tokenizers as `Qwen3_5Tokenizer` (its own byte-level
    pre-tokenizer over the saved vocabulary and merges), so the words are byte-level BPE
    tokens: "Ġ" (a space) + two letters, built by two merges.
    """
    letters = [chr(ord("a") + i) for i in range(26)]
    words = ["\u0120" + x + y for x in letters for y in letters][:VOCAB_WORDS]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({name: VOCAB_WORDS + i for i, name in enumerate(SPECIALS)})
    for piece in ["\u0120"] + letters + ["\u0120" + x for x in letters]:
        vocab[piece] = len(vocab)
    merges = [("\u0120", x) for x in letters] + [(w[:2], w[2]) for w in words]
    assert len(vocab) == VOCAB_SIZE
    return vocab, merges


def words(ids) -> str:
    """The prompt text of word ids: " ab cd ..." (each word one token)."""
    vocab, _ = vocabulary()
    names = {i: w for w, i in vocab.items()}
    return "".join(names[int(i)].replace("\u0120", " ") for i in ids)


def gapped_prompt(length: int, seed: int, num_low: int = len(LOW_WORDS)) -> list[int]:
    """Word ids of a prompt whose top-k boundary is clear-cut for `gapped_weights`.

    `length` / RATIO groups: `num_low` of them, at random places, are four copies of one
    distinct low-importance word each (LOW_WORDS, well apart); the others are four random
    high-importance words. While no more than Kb = 512 high groups are visible, every high
    group is chosen and the lowest low groups are the ones left out, so the boundary falls
    between two distinct low words. Needs at most 512 high groups in all.
    """
    g = torch.Generator().manual_seed(seed)
    groups = length // RATIO
    if groups - num_low > BUDGET // RATIO or num_low > len(LOW_WORDS):
        raise ValueError(f"{groups} groups with {num_low} low ones cannot keep the boundary among the low groups")
    low_at = set(torch.randperm(groups, generator=g)[:num_low].tolist())
    low_words = iter(torch.tensor(list(LOW_WORDS))[torch.randperm(len(LOW_WORDS), generator=g)].tolist())
    high = torch.tensor(list(HIGH_WORDS))
    ids: list[int] = []
    for i in range(groups):
        if i in low_at:
            ids += [next(low_words)] * RATIO
        else:
            ids += high[torch.randint(len(high), (RATIO,), generator=g)].tolist()
    ids += high[torch.randint(len(high), (length - len(ids),), generator=g)].tolist()
    return ids


def random_prompt(length: int, seed: int) -> list[int]:
    """Word ids drawn uniformly (prompts that need no designed boundary)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB_WORDS, (length,), generator=g).tolist()


def save_processor(folder: str) -> None:
    """The word tokenizer and a Qwen3VLProcessor around it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    vocab, merges = vocabulary()
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:], clean_up_tokenization_spaces=False,
    )
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(), tokenizer=fast, video_processor=Qwen3VLVideoProcessor(),
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    processor.save_pretrained(folder)


def write_checkpoint(folder: str, seed: int = 0) -> str:
    """Write the checkpoint (bf16 safetensors), its processor and config.json; return folder."""
    from transformers import Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen4ExpForConditionalGeneration(hf_config())
    gapped_weights(model, seed)
    model.to(torch.bfloat16).save_pretrained(folder)
    save_processor(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["text_config"]["full_attention_interval"] = 1  # every layer QSA
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return folder
