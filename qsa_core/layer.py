"""`QSAAttention`: a whole QSA layer on the op API (weights named as in the HF checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import ops
from .cache import QSALayerCache
from .config import QSAConfig, resolve_dtype
from .metadata import QSAForwardMetadata


class GemmaRMSNorm(nn.Module):
    """Weight holder of `x * rsqrt(mean(x^2) + eps) * (1 + w)`; the ops apply it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps


class QSAIndexerWeights(nn.Module):
    """The indexer's trainable weights: index_qk_proj, q_layernorm, k_layernorm."""

    def __init__(self, config: QSAConfig) -> None:
        super().__init__()
        Hi, Di = config.index_n_heads, config.index_head_dim
        self.index_qk_proj = nn.Linear(config.hidden_size, (Hi + 1) * Di, bias=False)
        self.q_layernorm = GemmaRMSNorm(Di, config.rms_norm_eps)
        self.k_layernorm = GemmaRMSNorm(Di, config.rms_norm_eps)


class QSAAttention(nn.Module):
    """One QSA layer: projections, indexer, selection, sparse attention, output gate, o_proj.

    `forward(hidden [T, hidden_size], meta, cache) -> [T, hidden_size]`. The step's K/V,
    ring rows and compressed keys are written to `cache` first; padding rows write nothing
    and give o_proj(0).
    """

    def __init__(self, config: QSAConfig) -> None:
        super().__init__()
        self.config = config
        H, Hq, Hkv, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, Hq * D * 2, bias=bias)
        self.k_proj = nn.Linear(H, Hkv * D, bias=bias)
        self.v_proj = nn.Linear(H, Hkv * D, bias=bias)
        self.o_proj = nn.Linear(Hq * D, H, bias=bias)
        self.q_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.indexer = QSAIndexerWeights(config)
        self.register_buffer("inv_freq", config.inv_freq(), persistent=False)
        self.register_buffer("rope_axes", config.rope_axes(), persistent=False)
        # MTP draft steps may keep the step-0 selection while the caches still update.
        self.skip_topk = False

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round the RoPE frequencies; they stay fp32 like HF's.
        super()._apply(fn, recurse)
        self.inv_freq = self.config.inv_freq().to(self.inv_freq.device)
        return self

    @classmethod
    def from_hf(cls, hf_attention: nn.Module, **overrides: Any) -> "QSAAttention":
        """Copy a transformers `Qwen4ExpTextAttention` (weights and rotary settings)."""
        layer = cls(QSAConfig.from_hf(hf_attention.config, **overrides))
        missing, unexpected = layer.load_state_dict(hf_attention.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(f"HF attention weights do not match: missing {missing}, unexpected {unexpected}")
        p = next(hf_attention.parameters())
        return layer.to(device=p.device, dtype=p.dtype)

    def norm_weights(self) -> "QSANormWeights":
        return QSANormWeights(
            index_q=self.indexer.q_layernorm.weight,
            index_k=self.indexer.k_layernorm.weight,
            q=self.q_norm.weight,
            k=self.k_norm.weight,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        meta: QSAForwardMetadata,
        cache: QSALayerCache,
        selection_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = qsa_attend(
            self.config,
            self.norm_weights(),
            self.inv_freq,
            self.rope_axes,
            self.indexer.index_qk_proj(hidden_states),
            self.q_proj(hidden_states),
            self.k_proj(hidden_states),
            self.v_proj(hidden_states),
            meta,
            cache,
            selection_out=selection_out,
            skip_topk=self.skip_topk,
        )
        return self.o_proj(out)


@dataclass(frozen=True)
class QSANormWeights:
    """GemmaRMSNorm weights (the `w` of `1 + w`) of a QSA layer, each [head dim]."""

    index_q: torch.Tensor
    index_k: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor


def qsa_attend(
    config: QSAConfig,
    norms: QSANormWeights,
    inv_freq: torch.Tensor,
    rope_axes: torch.Tensor,
    index_qk: torch.Tensor,
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: QSAForwardMetadata,
    cache: QSALayerCache,
    selection_out: torch.Tensor | None = None,
    skip_topk: bool = False,
) -> torch.Tensor:
    """A QSA layer from its projections: prepare, select, expand, sparse attention.

    index_qk [T, (Hi+1)*Di], q_gate [T, Hq*2D], k, v [T, Hkv*D] (model dtype); inv_freq
    fp32 [Rd/2], rope_axes int32 [Rd/2]. Returns the gated attention output [T, Hq*D]
    (o_proj not applied). Engines with their own projection layers call this directly.
    """
    Hi, Di = config.index_n_heads, config.index_head_dim
    q_idx, q, gate = ops.prepare(
        index_qk[:, : Hi * Di],
        index_qk[:, Hi * Di :],
        q_gate,
        k,
        v,
        meta.rope_positions,
        index_q_norm=norms.index_q,
        index_k_norm=norms.index_k,
        q_norm=norms.q,
        k_norm=norms.k,
        eps=config.rms_norm_eps,
        inv_freq=inv_freq,
        rope_axes=rope_axes,
        index_dtype=resolve_dtype(config.index_dtype, index_qk.dtype),
        cache=cache,
        meta=meta,
    )
    if skip_topk:
        if selection_out is None:
            raise ValueError("skip_topk reuses a selection: pass the step-0 buffer as selection_out")
        selection = selection_out
    else:
        selection = qsa_select(config, q_idx, meta, cache, selection_out)
    return ops.sparse_attention(
        q,
        gate,
        cache.k,
        cache.v,
        meta.block_table,
        meta.token_to_req,
        meta.seq_lens,
        selection,
        softmax_scale=config.softmax_scale,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    )


def qsa_select(
    config: QSAConfig,
    q_idx: torch.Tensor,
    meta: QSAForwardMetadata,
    cache: QSALayerCache,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selection rows int32 [T, W + 1]: decode and prefill top-k, then expansion.

    q_idx [T, Hi, Di] in the index dtype; decode rows come first (meta.num_decode_tokens).
    """
    T = meta.num_tokens
    if out is None:
        out = torch.empty(T, config.packed_width, dtype=torch.int32, device=q_idx.device)
    blocks = torch.empty(T, config.block_topk, dtype=torch.int32, device=q_idx.device)
    nd = meta.num_decode_tokens
    kw = dict(
        page_size=meta.page_size,
        compress_ratio=config.compress_ratio,
        block_topk=config.block_topk,
        max_seq_len=meta.max_seq_len,
    )
    comp, table = cache.compressed, meta.block_table
    to_req, vis = meta.token_to_req, meta.visible_blocks
    if nd:
        ops.select_decode(q_idx[:nd], comp, table, to_req[:nd], vis[:nd], out=blocks[:nd], **kw)
    if nd < T:
        ops.select_prefill(q_idx[nd:], comp, table, to_req[nd:], vis[nd:], out=blocks[nd:], **kw)
    return ops.expand(blocks, meta.positions, vis, compress_ratio=config.compress_ratio, out=out)
