"""A tiny Qwen4-Exp checkpoint written by transformers' `Qwen4ExpForCausalLM.save_pretrained`.

Weights are random (norm weights included: HF's start at zero) with two correlations that a
trained model has and that give the indexer's top-k boundary a clear gap: every token
embedding shares a component, and each indexer query head's weights resemble the key's.
`selection_gaps` measures the gap on real prompts (tests check it).
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
    top of the 512-token vocabulary."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    text = tiny_config(head_dim=128, rope_parameters=rope, architectures=None, **overrides)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text.hidden_size,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    return Qwen4ExpConfig(text_config=text.to_dict(), vision_config=vision, image_token_id=VOCAB - 4,
                          video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2, vision_end_token_id=VOCAB - 1,
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
