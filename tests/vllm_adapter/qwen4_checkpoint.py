"""A tiny Qwen4-Exp checkpoint written by transformers' `Qwen4ExpForCausalLM.save_pretrained`.

Weights are random (norm weights included: HF's start at zero) with two correlations that a
trained model has and that give the indexer's top-k boundary a clear gap: every token
embedding shares a component, and each indexer query head's weights resemble the key's.
`selection_gaps` measures the gap on real prompts (tests check it).
`save_vl_processor` saves the processor a multimodal server needs beside a
`Qwen4ExpForConditionalGeneration` checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Qwen4ExpTextConfig

VOCAB = 512


def tiny_config(*, hybrid: bool = False, **overrides: Any) -> Qwen4ExpTextConfig:
    """2 QSA layers (budget 16 tokens in groups of 4), or with `hybrid` GDN, QSA, GDN, QSA.

    Head dims are ones vLLM's CPU kernels take (attention 64; GDN keys 128).
    """
    layers = ["linear_attention", "indexed_attention"] * 2 if hybrid else ["indexed_attention"] * 2
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=64,
        indexer_budget=16,
        indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        max_position_embeddings=1024,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        hc_count=2,
        hc_lowrank=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        output_gate_type="silu",  # vLLM's GDN asserts an explicit gate activation
        tie_word_embeddings=False,
        architectures=["Qwen4ExpForCausalLM"],
    )
    fields.update(overrides)
    return Qwen4ExpTextConfig(**fields)


def tiny_vl_config(**overrides: Any) -> Qwen4ExpConfig:
    """`Qwen4ExpForConditionalGeneration`: a one-block vision tower and the text model of
    `tiny_config` with the released model's interleaved MRoPE sections (11, 11, 10) (head_dim
    128 with partial rotary 0.5: 64 rotary dims, 32 frequencies). Vision token ids sit at the
    top of the vocabulary. overrides: the text model's (`rope_parameters` entries update the
    MRoPE ones; keep 32 rotary frequencies)."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    fields = {"head_dim": 128, **overrides, "rope_parameters": {**rope, **overrides.get("rope_parameters", {})}}
    text = tiny_config(architectures=None, **fields)
    vocab = text.vocab_size
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text.hidden_size,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[])  # vLLM reads it in multimodal mode (none: no deepstack)
    return Qwen4ExpConfig(text_config=text.to_dict(), vision_config=vision, image_token_id=vocab - 4,
                          video_token_id=vocab - 3, vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1,
                          architectures=["Qwen4ExpForConditionalGeneration"])


@torch.no_grad()
def randomize(model: Qwen4ExpForCausalLM, seed: int) -> None:
    """Random weights with a shared embedding component and indexer queries like the key."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    for name, p in model.named_parameters():
        w = torch.randn(p.shape, generator=g)
        if p.dim() >= 2:
            p.copy_(w * p.shape[-1] ** -0.5)
        elif "A_log" in name or "dt_bias" in name:
            p.copy_(0.5 * w)
        else:
            p.copy_(0.3 * w)
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    config = getattr(config, "text_config", config)
    embed = text.embed_tokens.weight
    embed += 2.0 * torch.randn(config.hidden_size, generator=g) * config.hidden_size**-0.5
    Di = config.indexer_head_dim
    for layer in text.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        w = attn.indexer.index_qk_proj.weight
        w[:-Di] = 0.5 * w[:-Di] + w[-Di:].repeat(config.indexer_n_heads, 1)


def write_checkpoint(folder: str | os.PathLike, config: Qwen4ExpTextConfig | Qwen4ExpConfig, seed: int = 0):
    """Build, randomise and `save_pretrained` an fp32 model into `folder` (`Qwen4ExpForCausalLM`
    for a text config, `Qwen4ExpForConditionalGeneration` for a `Qwen4ExpConfig`); returns it (eval)."""
    torch.manual_seed(seed)
    cls = Qwen4ExpForConditionalGeneration if isinstance(config, Qwen4ExpConfig) else Qwen4ExpForCausalLM
    model = cls(config).float().eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def add_mtp_layer(folder: str | os.PathLike, model: Qwen4ExpForCausalLM, seed: int) -> None:
    """Add one MTP layer (`mtp.*`, the released checkpoint's names, which transformers ignores)
    to the checkpoint in `folder` and declare it in config.json (`mtp_num_hidden_layers` 1,
    `index_share_for_mtp_iteration`: later draft steps reuse step 0's QSA selection).

    A drafter that is right some of the time, so that a test sees drafts both accepted and
    rejected: the MTP passes the target's last hidden stream on nearly unchanged (fc_hidden the
    identity, no embedding branch, the layer's writes into the stream scaled by 1e-2, the
    target's final mixer), so it proposes the token just generated again. Its QSA layer is an
    indexed_attention decoder layer with weights as `randomize` makes them.
    """
    import json

    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    config = getattr(model.config, "text_config", model.config)
    H, hc, Di = config.hidden_size, config.hc_count, config.indexer_head_dim
    qsa = max(i for i, t in enumerate(config.layer_types) if t == "indexed_attention")
    weights = {}
    for name, p in text.layers[qsa].named_parameters():
        w = torch.randn(p.shape, generator=g)
        w = w * p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.3 * w
        if name.startswith("self_attn.o_proj") or "down_proj" in name:
            w = 1e-2 * w
        weights[f"mtp.layers.0.{name}"] = w
    w = weights["mtp.layers.0.self_attn.indexer.index_qk_proj.weight"]
    w[:-Di] = 0.5 * w[:-Di] + w[-Di:].repeat(config.indexer_n_heads, 1)
    weights |= {f"mtp.hyper_connection_mixer.{name}": p.detach().clone()
                for name, p in text.hyper_connection_mixer.named_parameters()}
    weights |= {"mtp.fc_embedding.weight": torch.zeros(H, H), "mtp.fc_hidden.weight": torch.eye(H),
                "mtp.pre_fc_norm_embedding.weight": torch.zeros(H),
                "mtp.pre_fc_norm_hidden.weight": torch.zeros(H * hc)}
    path = os.path.join(folder, "model.safetensors")
    save_file({**load_file(path), **weights}, path, metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        saved = json.load(f)
    (saved["text_config"] if "text_config" in saved else saved).update(
        mtp_num_hidden_layers=1, index_share_for_mtp_iteration=True)
    with open(config_path, "w") as f:
        json.dump(saved, f, indent=2)


VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")  # ids VOCAB-4 ..
# A message's text parts and its image (the vision span), each followed by a space.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.content is string %}{{ m.content }} {% else %}{% for c in m.content %}"
    "{% if c.type in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif c.type == 'text' %}{{ c.text }} {% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def byte_alphabet() -> list[str]:
    """The 256 characters of byte-level BPE, sorted: token ids 0 .. 255 of `save_vl_processor`'s
    tokenizer (an ASCII letter is its own character: text of letters is one token a letter)."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def save_vl_processor(folder: str | os.PathLike, config: Qwen4ExpConfig) -> None:
    """Save the `Qwen3VLProcessor` of a `tiny_vl_config` checkpoint into `folder`.

    Tokenizer: transformers loads any tokenizer of a qwen4_exp checkpoint as `Qwen3_5Tokenizer`
    (byte-level BPE), so it is one, without merges: ids 0 .. 255 are the byte characters
    (`byte_alphabet`), ids up to VOCAB - 5 fill the vocabulary (generated, never read from text),
    and `VISION_TOKENS` are the config's image / video / vision start / end ids. Image and
    video processors follow the vision tower (patch 16, merge 2, temporal patch 2) with 4 to 64
    merged tokens per image; `CHAT_TEMPLATE` is the chat template. The video processor class is
    built directly: transformers hides it without torchvision (scripts/vllm_cpu_torchvision_shim.py
    lets vLLM load it the same way).
    """
    import importlib

    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    ids = (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    if ids != tuple(range(VOCAB - 4, VOCAB)):
        raise ValueError(f"vision token ids must be {VOCAB - 4} .. {VOCAB - 1} (tiny_vl_config), got {ids}")
    chars = byte_alphabet()
    vocab = {c: i for i, c in enumerate(chars)} | {f"<|t{i}|>": i for i in range(len(chars), VOCAB - 4)}
    tokenizer = Qwen3_5Tokenizer(vocab=vocab | dict(zip(VISION_TOKENS, ids)), merges=[], unk_token=f"<|t{VOCAB - 5}|>",
                                 eos_token=f"<|t{VOCAB - 5}|>", pad_token=f"<|t{VOCAB - 5}|>",
                                 extra_special_tokens=list(VISION_TOKENS), chat_template=CHAT_TEMPLATE)
    vision = config.vision_config
    patch, merge, temporal = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    pixels_per_token = (patch * merge) ** 2
    size = {"shortest_edge": 4 * pixels_per_token, "longest_edge": 64 * pixels_per_token}
    shape = dict(patch_size=patch, merge_size=merge, temporal_patch_size=temporal, size=size)
    video = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl").Qwen3VLVideoProcessor
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(**shape), tokenizer=tokenizer,
                     video_processor=video(**shape), chat_template=CHAT_TEMPLATE).save_pretrained(folder)
