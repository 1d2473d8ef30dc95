"""`QSAIndexer`: the QSA indexer as a vLLM module, with the interface of vLLM's upstream one.

It owns the checkpoint weights `index_qk_proj`, `q_layernorm`, `k_layernorm` (under its
prefix), the raw-key ring vLLM allocates (`raw_key_cache`) and the compressed-key view over
the main K/V pages.
Its forward runs the core's indexer half (`qsa_indexer`: the fused prepare - indexer query,
ring, group compression, main q/k norm + RoPE, main K/V store - then selection and expansion)
on the step's plan.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.quantization import QuantizationConfig

from qsa_core import GemmaRMSNorm, QSAConfig, QSAIndexed, QSALayerCache, QSANormWeights, QSAPlan, qsa_indexer
from qsa_core import resolve_dtype

from .cache import QSASideCache, bind_layer_cache, core_kv_cache_dtype, ring_spec
from .context import step_metadata
from .metadata import PagedGeometry


class QSAAttentionLike(Protocol):
    """What `QSAIndexer.forward` reads from the attention layer it serves."""

    layer_name: str  # its static_forward_context name (the main group's metadata key)
    kv_cache: torch.Tensor  # vLLM's main K/V view [blocks, Hkv, page, 2D] (uint8 for an fp8 cache)
    _k_scale_float: float  # per-tensor fp8 K/V scales, read once after the weights load (1.0 otherwise)
    _v_scale_float: float
    q_norm: GemmaRMSNorm
    k_norm: GemmaRMSNorm


def qsa_config_for(vllm_config: VllmConfig, config: Any) -> QSAConfig:
    """`QSAConfig` of a HF text config under vLLM's cache settings (validated once): the main
    K/V dtype from `--kv-cache-dtype` (`core_kv_cache_dtype`)."""
    if vllm_config.cache_config is None:
        raise ValueError("QSA requires a paged KV cache: vllm_config.cache_config is None")
    kv = core_kv_cache_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config.dtype)
    return QSAConfig.from_hf(config, kv_cache_dtype=kv)


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
    `qsa_config`: the attention layer's geometry on this rank (its heads under tensor
    parallelism, `QSAConfig.for_rank`); default the whole model's. The indexer itself (its
    projection, norms, ring and compressed keys) is whole on every rank.
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
        qsa_config: QSAConfig | None = None,
    ) -> None:
        super().__init__()
        cfg = qsa_config_for(vllm_config, config) if qsa_config is None else qsa_config
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
        dtype = vllm_config.model_config.dtype
        self.dtype = dtype
        cache_prefix = f"{prefix}." if prefix else ""
        ring_prefix = f"{cache_prefix}raw_key_cache"
        # A draft (MTP) layer adopts the ring its target model registered for it.
        adopted = QSASideCache.adopt(vllm_config, ring_prefix)
        self.raw_key_cache = adopted or QSASideCache(
            vllm_config=vllm_config, make_spec=lambda vc: ring_spec(vc, cfg, dtype), prefix=ring_prefix
        )
        self.is_draft = adopted is not None
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

    def layer_cache(
        self, kv_cache: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0
    ) -> tuple[QSALayerCache, PagedGeometry]:
        """Core views over vLLM's bound main K/V and side caches, with the attention layer's
        fp8 K/V scales (rebuilt only on rebinding)."""
        tensors = (kv_cache, self.raw_key_cache.kv_cache)
        bound = self._bound
        if bound is None or any(a is not b for a, b in zip(bound[0], tensors)) or (
                (bound[1].k_scale, bound[1].v_scale) != (k_scale, v_scale)):
            self._bound = (tensors, *bind_layer_cache(*tensors, self.qsa_config, self.index_dtype, self.dtype,
                                                      k_scale, v_scale))
        return self._bound[1], self._bound[2]

    def step_inputs(
        self, attn: QSAAttentionLike, positions: torch.Tensor | None = None
    ) -> tuple[QSAPlan, QSALayerCache] | None:
        """This step's plan (made by the backend's builders) and cache views; None
        when vLLM runs without metadata (profiling, dummy runs). positions: what vLLM hands
        the model (int64 [N], or [3, N] under MRoPE: the plan then rotates at them)."""
        records = step_metadata(attn.layer_name)
        if records is None:
            return None
        main, = records
        # vLLM's proposer builds a draft step's main group only (the plan then has the ring blocks)
        ring = step_metadata(self.raw_key_cache.prefix)
        if ring is not None and ring[0].step is not main.step:
            raise RuntimeError(f"{self.raw_key_cache.prefix}: its group's metadata belongs to another step")
        cache, geometry = self.layer_cache(attn.kv_cache, attn._k_scale_float, attn._v_scale_float)
        mrope = positions if self.qsa_config.uses_mrope and positions is not None and positions.dim() == 2 else None
        return main.step.record(geometry, mrope), cache

    def forward(
        self,
        projected_qk: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        attn: QSAAttentionLike,
        qkv: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        slot_mapping: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, QSAIndexed | None]:
        """Update the caches and select (the core's `qsa_indexer`); returns (selection, the
        indexer half's result or None).

        projected_qk [N, (Hi+1)*Di] = index_qk_proj(hidden); positions: the model's, int64 [N]
        or [3, N] (MRoPE: the rope positions of the step, `QSAStep.record`); qkv: the main
        projections, one fused [N, Hq*2D + 2*Hkv*D] tensor (per head [q | gate], then k, then v; split into
        views) or the (q_gate, k, v) tuple. The core's prepare is fused, so the same call
        writes `attn`'s K/V and returns its normed, rotated q and gate (in the `QSAIndexed`).
        Main slots come from the step metadata: `slot_mapping` is accepted for upstream's
        signature only. Selection: int32 [T, W + 1], -1 padded
        request-relative positions, last column the count (T = rows vLLM scheduled; rows past
        T are padding). Without step metadata: inert rows (all -1, count 0) and None.
        """
        cfg = self.qsa_config
        step = self.step_inputs(attn, positions)
        if step is None:
            if self.skip_topk and out is not None:
                return out, None
            inert = torch.full((projected_qk.shape[0], cfg.packed_width), -1, dtype=torch.int32, device=projected_qk.device)
            inert[:, -1] = 0
            return (out.copy_(inert) if out is not None else inert), None
        if qkv is None:
            raise ValueError("QSAIndexer.forward needs qkv: the core's prepare also writes the main K/V")
        plan, cache = step
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_gate, k, v = qkv if isinstance(qkv, tuple) else qkv.split((Hq * 2 * D, Hkv * D, Hkv * D), dim=-1)
        norms = QSANormWeights(
            index_q=self.q_layernorm.weight, index_k=self.k_layernorm.weight, q=attn.q_norm.weight, k=attn.k_norm.weight
        )
        indexed = qsa_indexer(plan, norms, projected_qk, q_gate, k, v, cache, selection_out=out, skip_topk=self.skip_topk)
        return indexed.selection, indexed
