"""`QSAIndexer`: the QSA indexer as a vLLM module, with the interface of vLLM's upstream one.

It owns the checkpoint weights `index_qk_proj`, `q_layernorm`, `k_layernorm` (under its
prefix), the raw-key ring vLLM allocates (`raw_key_cache`) and the compressed-key view over
the main K/V pages.
Its forward maps vLLM's step onto `qsa_core` and runs the core's fused prepare (indexer
query, ring, group compression, main q/k norm + RoPE, main K/V store) and selection.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.quantization import QuantizationConfig

from qsa_core import QSAConfig, QSAForwardMetadata, QSALayerCache, ops, qsa_select
from qsa_core.config import resolve_dtype
from qsa_core.layer import GemmaRMSNorm

from .cache import QSASideCache, bind_layer_cache, ring_spec
from .context import step_metadata
from .metadata import PagedGeometry


class QSAAttentionLike(Protocol):
    """What `QSAIndexer.forward` reads from the attention layer it serves."""

    layer_name: str  # its static_forward_context name (the main group's metadata key)
    kv_cache: torch.Tensor  # vLLM's main K/V view [blocks, Hkv, page, 2D]
    q_norm: GemmaRMSNorm
    k_norm: GemmaRMSNorm


def qsa_config_for(vllm_config: VllmConfig, config: Any) -> QSAConfig:
    """`QSAConfig` of a HF text config under vLLM's cache settings (validated once)."""
    if vllm_config.cache_config is None:
        raise ValueError("QSA requires a paged KV cache: vllm_config.cache_config is None")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise NotImplementedError(f"cache_config.cache_dtype must be 'auto' for QSA layers, got {cache_dtype!r}")
    return QSAConfig.from_hf(config)


def check_rotary(rotary_emb: nn.Module, config: QSAConfig) -> None:
    """The main attention's rotary embedding must be the NeoX RoPE the config describes."""
    expected = {"rotary_dim": config.rotary_dim, "base": config.rope_theta, "is_neox_style": True}
    for name, want in expected.items():
        got = getattr(rotary_emb, name, None)
        if got is None or type(want)(got) != want:
            raise ValueError(f"rotary_emb.{name} must be {want!r} (from the HF config), got {got!r}")


class QSAIndexer(nn.Module):
    """QSA indexer weights, side caches and selection for one vLLM attention layer.

    `prefix` is the checkpoint's indexer prefix (normally `model.layers.N.self_attn.indexer`);
    the ring registers as `{prefix}.raw_key_cache`; compressed keys sit in the main K/V pages.
    """

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        config: Any,
        layer_id: int,
        rotary_emb: nn.Module,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        cfg = qsa_config_for(vllm_config, config)
        check_rotary(rotary_emb, cfg)
        self.qsa_config = cfg
        self.layer_id = int(layer_id)
        self.rotary_emb = rotary_emb
        self.prefix = prefix
        # MTP steps after the first keep the step-0 selection while the caches still update.
        self.skip_topk = False
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        self.index_qk_proj = ReplicatedLinear(
            cfg.hidden_size,
            (Hi + cfg.index_kv_heads) * Di,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.index_qk_proj" if prefix else "index_qk_proj",
            return_bias=False,
        )
        self.q_layernorm = GemmaRMSNorm(Di, cfg.rms_norm_eps)
        self.k_layernorm = GemmaRMSNorm(Di, cfg.rms_norm_eps)
        # The core ops take the RoPE table as fp32 inverse frequencies (main attention's).
        self.register_buffer("inv_freq", cfg.inv_freq(), persistent=False)
        self.register_buffer("rope_axes", cfg.rope_axes(), persistent=False)
        dtype = vllm_config.model_config.dtype
        cache_prefix = f"{prefix}." if prefix else ""
        self.raw_key_cache = QSASideCache(
            vllm_config=vllm_config,
            make_spec=lambda vc: ring_spec(vc, cfg, dtype),
            prefix=f"{cache_prefix}raw_key_cache",
        )
        # The compressed keys live in the main K/V pages (cache.main_kv_spec).
        self.index_dtype = resolve_dtype(cfg.index_dtype, dtype)
        self._bound: tuple[tuple[torch.Tensor, ...], QSALayerCache, PagedGeometry] | None = None

    @property
    def output_width(self) -> int:
        """Selection (token) columns per row: W = K + r - 1."""
        return self.qsa_config.selection_width

    @property
    def packed_output_width(self) -> int:
        """W + 1: the trailing column holds each row's count of valid entries."""
        return self.qsa_config.packed_width

    def layer_cache(self, kv_cache: torch.Tensor) -> tuple[QSALayerCache, PagedGeometry]:
        """Core views over vLLM's bound main K/V and side caches (rebuilt only on rebinding)."""
        tensors = (kv_cache, self.raw_key_cache.kv_cache)
        if self._bound is None or any(a is not b for a, b in zip(self._bound[0], tensors)):
            self._bound = (tensors, *bind_layer_cache(*tensors, self.qsa_config, self.index_dtype))
        return self._bound[1], self._bound[2]

    def step_inputs(self, attn: QSAAttentionLike) -> tuple[QSAForwardMetadata, QSALayerCache] | None:
        """This step's core record (built by the backend's builders) and cache views; None
        when vLLM runs without metadata (profiling, dummy runs)."""
        records = step_metadata(attn.layer_name, self.raw_key_cache.prefix)
        if records is None:
            return None
        main, ring = records
        if ring.step is not main.step:
            raise RuntimeError(f"{self.raw_key_cache.prefix}: its group's metadata belongs to another step")
        cache, geometry = self.layer_cache(attn.kv_cache)
        return main.step.record(geometry), cache

    def forward(
        self,
        projected_qk: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        attn: QSAAttentionLike,
        qkv: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Update the caches and select; returns (selection, (q, gate) or None).

        projected_qk [N, (Hi+1)*Di] = index_qk_proj(hidden); qkv [N, Hq*2D + 2*Hkv*D]: the
        main projections (per head [q | gate], then k, then v). The core's prepare is fused,
        so the same call writes `attn`'s K/V and returns its normed, rotated q [T, Hq, D] and
        gate [T, Hq, D]. Main slots come from the step metadata: `slot_mapping` is accepted
        for upstream's signature only. Selection: int32 [T, W + 1], -1 padded
        request-relative positions, last column the count (T = rows vLLM scheduled; rows past
        T are padding). Without step metadata: inert rows (all -1, count 0) and None.
        """
        cfg = self.qsa_config
        step = self.step_inputs(attn)
        if step is None:
            if self.skip_topk and out is not None:
                return out, None
            inert = torch.full((projected_qk.shape[0], cfg.packed_width), -1, dtype=torch.int32, device=projected_qk.device)
            inert[:, -1] = 0
            return (out.copy_(inert) if out is not None else inert), None
        if qkv is None:
            raise ValueError("QSAIndexer.forward needs qkv: the core's prepare also writes the main K/V")
        meta, cache = step
        T = meta.num_tokens
        Hi, Di, Hq, Hkv, D = cfg.index_n_heads, cfg.index_head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        index_qk = projected_qk[:T]
        q_gate, k, v = qkv[:T].split((Hq * 2 * D, Hkv * D, Hkv * D), dim=-1)
        q_idx, q, gate = ops.prepare(
            index_qk[:, : Hi * Di],
            index_qk[:, Hi * Di :],
            q_gate,
            k,
            v,
            meta.rope_positions,
            index_q_norm=self.q_layernorm.weight,
            index_k_norm=self.k_layernorm.weight,
            q_norm=attn.q_norm.weight,
            k_norm=attn.k_norm.weight,
            eps=cfg.rms_norm_eps,
            inv_freq=self.inv_freq,
            rope_axes=self.rope_axes,
            index_dtype=resolve_dtype(cfg.index_dtype, index_qk.dtype),
            cache=cache,
            meta=meta,
        )
        if self.skip_topk:
            if out is None:
                raise ValueError("skip_topk reuses the step-0 selection: pass it as out")
            return out, (q, gate)
        if out is not None and tuple(out.shape) != (T, cfg.packed_width):
            raise ValueError(f"out must be [{T}, {cfg.packed_width}] int32, got {tuple(out.shape)}")
        return qsa_select(cfg, q_idx, meta, cache, out), (q, gate)
