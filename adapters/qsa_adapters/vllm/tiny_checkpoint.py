"""A `QSATinyForCausalLM` checkpoint folder: tiny config, random weights, safetensors.

Weight names and shapes are the ones `tiny_model.QSATinyForCausalLM.load_weights` takes
(and that its standalone twins load with `load_state_dict`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Qwen4ExpTextConfig


def tiny_config(**overrides: Any) -> Qwen4ExpTextConfig:
    """A tiny config: 2 QSA layers, hidden 128, 4 x 64 heads (2 KV), indexer 2 x 64,
    budget 16 tokens in groups of 4 (prompts past ~20 tokens exercise selection)."""
    fields: dict[str, Any] = dict(
        architectures=["QSATinyForCausalLM"],
        vocab_size=384,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=64,
        indexer_budget=16,
        indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
    )
    fields.update(overrides)
    fields.setdefault("layer_types", ["full_attention"] * fields["num_hidden_layers"])
    return Qwen4ExpTextConfig(**fields)


def tiny_weight_shapes(config: Qwen4ExpTextConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every `QSATinyForCausalLM` weight."""
    H, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    Hq, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    Hi, Di = config.indexer_n_heads, config.indexer_head_dim
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(config.num_hidden_layers):
        layer = {
            "input_layernorm.weight": (H,),
            "post_attention_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (Hq * 2 * D, H),
            "self_attn.k_proj.weight": (Hkv * D, H),
            "self_attn.v_proj.weight": (Hkv * D, H),
            "self_attn.o_proj.weight": (H, Hq * D),
            "self_attn.q_norm.weight": (D,),
            "self_attn.k_norm.weight": (D,),
            "self_attn.indexer.index_qk_proj.weight": ((Hi + 1) * Di, H),
            "self_attn.indexer.q_layernorm.weight": (Di,),
            "self_attn.indexer.k_layernorm.weight": (Di,),
            "mlp.gate_proj.weight": (I, H),
            "mlp.up_proj.weight": (I, H),
            "mlp.down_proj.weight": (H, I),
        }
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


# RMSNorm weights (x * w); every other 1-D weight is a GemmaRMSNorm weight (x * (1 + w)).
PLAIN_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")


def random_tiny_weights(config: Qwen4ExpTextConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights, norms included (HF's Gemma norm weights start at zero).

    As in a trained indexer, indexer queries resemble the key, so most group scores are
    above zero and the budget, not ReLU ties, decides the selection.
    """
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in tiny_weight_shapes(config).items():
        w = torch.randn(shape, generator=g)
        if len(shape) == 2:
            weights[name] = w * shape[-1] ** -0.5
        elif name.endswith(PLAIN_NORMS):
            weights[name] = 1.0 + 0.3 * w
        else:
            weights[name] = 0.3 * w
    Di = config.indexer_head_dim
    for i in range(config.num_hidden_layers):
        w = weights[f"model.layers.{i}.self_attn.indexer.index_qk_proj.weight"]
        w[:-Di] = 0.5 * w[:-Di] + w[-Di:].repeat(config.indexer_n_heads, 1)
    return weights


def save_tiny_checkpoint(folder: str | os.PathLike, config: Qwen4ExpTextConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write config.json and model.safetensors: a folder `vllm.LLM` / `vllm serve` can load."""
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, "model.safetensors"))
