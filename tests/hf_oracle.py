"""The HF oracle: a tiny transformers `Qwen4ExpTextAttention` with every weight randomised.

`hf_forward(layers, x, positions)` runs a chain of HF layers over a whole sequence with a
causal mask; its row p is what any chunked or decoded schedule must reproduce at position p.
HF's `torch.topk` orders equal scores arbitrarily; inside `hf_forward` its ties are broken by
design.md §2.7 (higher score first, then lower group index, -0.0 == +0.0), see `spec_topk`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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


def random_hf_attention(
    config: Qwen4ExpTextConfig, seed: int, dtype=torch.float32, layer_idx: int = 0, correlation: float = 1.0
):
    """An HF attention layer with all weights (norm weights included) drawn at random.

    correlation: weight of the key projection mixed into each indexer query head (1: most
    scores above zero; negative: most scores are exact ReLU zeros, ties everywhere).
    """
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
            w[h * di : (h + 1) * di] = 0.5 * w[h * di : (h + 1) * di] + correlation * k_rows
    return attn.to(dtype).eval()


_TORCH_TOPK = torch.Tensor.topk


def _spec_order_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """`Tensor.topk` whose 1-D largest-k ties go to the lower index (design.md §2.7)."""
    if self.dim() != 1 or not largest:
        return _TORCH_TOPK(self, k, dim, largest, sorted)
    # `+ 0.0` folds -0.0 into +0.0; a stable descending sort keeps equal scores in index order.
    order = torch.sort(self + 0.0, descending=True, stable=True).indices[:k]
    return torch.return_types.topk((self[order], order))


@contextlib.contextmanager
def spec_topk(order: str = "spec") -> Iterator[None]:
    """Break the ties of HF's group top-k (a method call on its 1-D score vector).

    order "spec": design.md §2.7; "reversed": ties to the HIGHER index (a wrong rule, for tests that
    prove their inputs have ties that decide the result).
    """
    if order == "spec":
        topk = _spec_order_topk
    elif order == "reversed":
        def topk(self, k, dim=-1, largest=True, sorted=True):
            if self.dim() != 1 or not largest:
                return _TORCH_TOPK(self, k, dim, largest, sorted)
            flipped = _spec_order_topk(self.flip(0), k)
            return torch.return_types.topk((flipped.values, self.shape[0] - 1 - flipped.indices))
    else:
        raise ValueError(f"order must be 'spec' or 'reversed', got {order!r}")
    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = _TORCH_TOPK


def hf_forward(
    layers: list,
    x: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    left_padding: list[int] | None = None,
    tie_order: str = "spec",
) -> torch.Tensor:
    """Run HF layers in a chain over x [L, hidden] (one sequence) or [B, L, hidden] (a batch).

    positions: [L], [B, L] or [3, L] (default arange(L)). left_padding: per sequence, the
    number of leading pad tokens, masked as keys (as an HF attention_mask masks them); their
    rows are garbage. tie_order: see `spec_topk`.
    """
    h = x if x.dim() == 3 else x[None]
    B, L = h.shape[:2]
    config = layers[0].config
    rotary = Qwen4ExpTextRotaryEmbedding(config)
    if positions is None:
        positions = torch.arange(L)
    if positions.dim() == 1:
        pos = positions[None, :].expand(B, -1)
    elif positions.shape[0] == 3 and B == 1:
        pos = positions[:, None, :]
    else:
        pos = positions
    cos, sin = rotary(h, pos)
    neg = torch.finfo(x.dtype).min
    mask = torch.full((L, L), neg, dtype=x.dtype).triu(1)[None, None].repeat(B, 1, 1, 1)
    for b, pad in enumerate(left_padding or []):
        mask[b, :, :, :pad] = neg
    with torch.no_grad(), spec_topk(tie_order):
        for layer in layers:
            h, _ = layer(h, (cos, sin), mask)
    return h if x.dim() == 3 else h[0]
