"""The HF oracle: a tiny transformers `Qwen4ExpTextAttention` with every weight randomised.

`hf_forward(layers, x, positions)` runs a chain of HF layers over a whole sequence with a
causal mask; its row p is what any chunked or decoded schedule must reproduce at position p.
"""

from __future__ import annotations

import os

import torch
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    Qwen4ExpTextAttention,
    Qwen4ExpTextRotaryEmbedding,
)

# QSA_TEST_DEVICE=cuda runs the core (and so the Triton kernels) on the GPU against the
# same CPU oracle.
DEVICE = torch.device(os.environ.get("QSA_TEST_DEVICE", "cpu"))

TINY = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=16,
    indexer_compress_ratio=4,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    rms_norm_eps=1e-6,
)


def tiny_config(mrope_section: list[int] | None = None, **overrides) -> Qwen4ExpTextConfig:
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    if mrope_section is not None:
        rope.update(mrope_section=list(mrope_section), mrope_interleaved=True)
    cfg = Qwen4ExpTextConfig(**{**TINY, **overrides}, rope_parameters=rope)
    cfg._attn_implementation = "eager"
    return cfg


def random_hf_attention(config: Qwen4ExpTextConfig, seed: int, dtype=torch.float32, layer_idx: int = 0):
    """An HF attention layer with all weights (norm weights included) drawn at random."""
    torch.manual_seed(seed)
    attn = Qwen4ExpTextAttention(config, layer_idx)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        # Trained indexers score most groups above zero; correlate each query head with the
        # key projection so that exact ReLU-zero ties (where torch.topk's order, and so the
        # oracle, is undefined) stay rare at the top-k boundary.
        w = attn.indexer.index_qk_proj.weight
        di = attn.indexer.index_head_dim
        k_rows = w[-di:]
        for h in range(attn.indexer.index_n_heads):
            w[h * di : (h + 1) * di] = 0.5 * w[h * di : (h + 1) * di] + k_rows
    return attn.to(dtype).eval()


def hf_forward(
    layers: list, x: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Run HF layers in a chain over x [L, hidden] (one sequence); positions [L] or [3, L]."""
    L = x.shape[0]
    config = layers[0].config
    rotary = Qwen4ExpTextRotaryEmbedding(config)
    if positions is None:
        positions = torch.arange(L)
    pos = positions[None, :] if positions.dim() == 1 else positions[:, None, :]
    h = x[None]
    cos, sin = rotary(h, pos)
    mask = torch.full((L, L), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
    with torch.no_grad():
        for layer in layers:
            h, _ = layer(h, (cos, sin), mask)
    return h[0]
