"""vLLM's own Qwen4-Exp model classes with their QSA layers on `qsa_core`.

`Qwen4ExpForCausalLM`, `Qwen4ExpForConditionalGeneration` and `Qwen4ExpMTP` subclass
upstream's classes (`vllm.models.qwen4_exp`). When `uses_qsa_core(vllm_config)` holds (the
user chose the `QSA_CORE` attention backend, or the platform is the CPU, where upstream's
QSA cannot run), each is built with `QSACoreAttention` in place of upstream's
`Qwen4ExpQSAAttention`; otherwise it is upstream's model unchanged. Everything else (embedding,
HyperConnection, MoE, GDN, PLE, weight loading) stays vLLM's.

`QSACoreAttention` keeps upstream's parameters and loaders: the fused `qkv_proj`
(q|gate, k, v and the indexer's `index_qk_proj` as shard 3), `o_proj`, `q_norm`, `k_norm`,
`indexer.{q_layernorm, k_layernorm}`, and upstream's `load_weights`. Under tensor parallelism
it shards as upstream does: each rank's `qkv_proj` holds its query heads and KV heads
(`QSAConfig.head_shard`: KV heads replicated when TP > Hkv) with the indexer's projection
whole, `o_proj` is row-parallel (its all-reduce sums the ranks' heads), and the rank's core
config, planner and caches have its heads only. From the projections on,
`qsa_core` runs the layer (through `QSAIndexer` and `run_core_attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention.attention import set_default_quant_scales
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen3_vl import mrope_positions_factor
from vllm.models.qwen4_exp.nvidia import model as upstream_model
from vllm.models.qwen4_exp.nvidia import mtp as upstream_mtp
from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAAttention, Qwen4ExpQSAQKVIndexerLinear
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import KVCacheSpec

from .attention import run_core_attention
from .backend import QSACoreBackend
from .cache import (
    QSASideCache, check_kv_cache_settings, checked_kv_scale, kv_storage_dtype, main_kv_spec, mtp_ring_prefixes,
    ring_spec,
)
from .config_hooks import microbatching_refusal, uses_qsa_core
from .hc_ops import register_torch_hc_ops
from .indexer import QSAIndexer, qsa_config_for
from .spec_decode import name_image_token_for_proposer

# Upstream's HyperConnection ops are Triton bodies registered for the platform's dispatch
# key; on a platform without Triton (the CPU) they get PyTorch bodies.
if not current_platform.is_cuda_alike():
    register_torch_hc_ops(current_platform.dispatch_key)


def check_supported(vllm_config: VllmConfig, config: Any, quant_config: QuantizationConfig | None = None) -> None:
    """Refuse, naming the setting, what the core-backed layer does not serve yet."""
    check_kv_cache_settings(vllm_config, quant_config)
    if (config.rope_parameters or {}).get("mrope_section") and vllm_config.speculative_config is not None:
        raise NotImplementedError(
            "QSA_CORE: speculative decoding (speculative_config) with MRoPE (rope_parameters.mrope_section) is "
            "not served yet: draft steps would rotate at logical, not 3-axis, positions"
        )
    parallel = vllm_config.parallel_config
    if parallel.prefill_context_parallel_size > 1 or parallel.decode_context_parallel_size > 1:
        raise NotImplementedError("QSA_CORE: context parallelism is not supported")
    microbatching = microbatching_refusal(parallel)
    if microbatching is not None:
        raise NotImplementedError(microbatching)


class QSACoreAttention(Qwen4ExpQSAAttention):
    """Upstream's QSA layer (same parameters, shards and loaders) run by qsa_core.

    `forward(positions [N], hidden_states [N, hidden]) -> [N, hidden]`; rows vLLM did not
    schedule and steps without metadata (profiling) give o_proj(0).
    """

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        config: Any,
        layer_id: int,
        quant_config: QuantizationConfig | None = None,
        reduce_results: bool = True,
        prefix: str = "",
    ) -> None:
        nn.Module.__init__(self)
        check_supported(vllm_config, config, quant_config)
        self.config = config
        self.hidden_size = int(config.hidden_size)
        # This rank's heads, split as QKVParallelLinear splits them (KV heads replicated when
        # TP > Hkv); the indexer stays whole on every rank.
        rank_config = qsa_config_for(vllm_config, config).for_rank(
            get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        )
        self.total_num_heads = int(config.num_attention_heads)
        self.total_num_kv_heads = int(config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = rank_config.num_heads, rank_config.num_kv_heads
        self.head_dim = rank_config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.attn_output_gate = True
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size,
            self.head_dim,
            2 * self.total_num_heads,  # per head [q | gate]
            self.total_num_kv_heads,
            bias=False,
            quant_config=upstream_model.without_modelopt_fp4(quant_config),
            prefix=f"{prefix}.qkv_proj",
        )
        if (self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads) != (2 * self.num_heads, self.num_kv_heads):
            raise RuntimeError(
                f"QSA_CORE: vLLM's QKVParallelLinear holds {self.qkv_proj.num_heads // 2} query / "
                f"{self.qkv_proj.num_kv_heads} KV heads on this rank, QSAConfig.for_rank "
                f"{self.num_heads} / {self.num_kv_heads}"
            )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            self.hidden_size,
            bias=False,
            reduce_results=reduce_results,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            head_size=self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            mrope_positions_factor=mrope_positions_factor(vllm_config),
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.layer_name = f"{prefix}.attn"
        # vLLM's name and page dtype of the main K/V (uint8 for fp8, as upstream's layer); the
        # core's dtype is rank_config.kv_cache_dtype. Scales: `process_weights_after_loading`.
        self.kv_cache_dtype = vllm_config.cache_config.cache_dtype
        self.kv_cache_torch_dtype = kv_storage_dtype(rank_config, vllm_config.model_config.dtype)
        self.kv_sharing_target_layer_name = None
        self.kv_cache = torch.tensor([])
        set_default_quant_scales(self, register_buffer=True)
        self.indexer = QSAIndexer(
            vllm_config=vllm_config,
            config=config,
            layer_id=layer_id,
            rotary_emb=self.rotary_emb,
            quant_config=quant_config,
            prefix=f"{prefix}.indexer",
            qsa_config=rank_config,
        )
        # Upstream's fused projection: the indexer's index_qk_proj becomes shard 3 of
        # qkv_proj (LoRA keeps it separate), and upstream's load_weights maps it there.
        self.fuse_indexer_projection = vllm_config.lora_config is None
        if self.fuse_indexer_projection:
            self.index_qk_size = self.indexer.index_qk_proj.output_size
            self.qkv_proj = Qwen4ExpQSAQKVIndexerLinear(
                self.qkv_proj, self.index_qk_size, upstream_model.without_modelopt_fp4(quant_config)
            )
            del self.indexer.index_qk_proj
        # The selection rows of a step; MTP steps with indexer.skip_topk reuse step 0's.
        self.register_buffer(
            "topk_indices_buffer",
            torch.zeros(
                vllm_config.scheduler_config.max_num_batched_tokens,
                self.indexer.packed_output_width,
                dtype=torch.int32,
            ),
            persistent=False,
        )
        context = vllm_config.compilation_config.static_forward_context
        if self.layer_name in context:
            raise ValueError(f"duplicate layer name {self.layer_name!r} in static_forward_context")
        context[self.layer_name] = self

    def get_attn_backend(self) -> type[QSACoreBackend]:
        return QSACoreBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return main_kv_spec(vllm_config, self.indexer.qsa_config, self.indexer.dtype, self.indexer.index_dtype)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Once the checkpoint is loaded (vLLM calls this on attention layers): the per-tensor
        K/V scales as floats, read once here, never per step. Upstream's loader puts a
        checkpoint's `k_scale` / `v_scale` (also `k_proj.k_scale`, `attn.k_scale`, ...) into
        the `_k_scale` / `_v_scale` buffers; without them they stay 1.0."""
        self._k_scale_float, self._v_scale_float = (
            checked_kv_scale(f"{self.layer_name}: {name}", getattr(self, name)) for name in ("_k_scale", "_v_scale"))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        if self.fuse_indexer_projection:
            qkv, projected_qk = qkv.split([2 * self.q_size + 2 * self.kv_size, self.index_qk_size], dim=-1)
        else:
            projected_qk = self.indexer.index_qk_proj(hidden_states)
        out = run_core_attention(self, self.indexer, positions, projected_qk, qkv, self.topk_indices_buffer)
        return self.o_proj(out)[0]


@contextlib.contextmanager
def core_attention_layers(vllm_config: VllmConfig) -> Iterator[None]:
    """While upstream builds its decoder layers, let them build `QSACoreAttention` (when
    `uses_qsa_core`); upstream's module attribute is restored afterwards."""
    if not uses_qsa_core(vllm_config):
        yield
        return
    original = upstream_model.Qwen4ExpQSAAttention
    upstream_model.Qwen4ExpQSAAttention = QSACoreAttention
    try:
        yield
    finally:
        upstream_model.Qwen4ExpQSAAttention = original


def hyperconnections_in_model_dtype(model: nn.Module, vllm_config: VllmConfig) -> None:
    """Upstream builds HyperConnection weights in bf16 whatever the model dtype (its QSA is
    bf16-only); with the core serving fp32 models they follow the model dtype, as in HF."""
    dtype = vllm_config.model_config.dtype
    if uses_qsa_core(vllm_config) and dtype != torch.bfloat16:
        for module in model.modules():
            if isinstance(module, upstream_model.GatedResidual):
                module.to(dtype)


def register_draft_rings(vllm_config: VllmConfig) -> list[QSASideCache]:
    """With MTP speculative decoding, register the draft QSA layers' rings as target layers
    (`QSASideCache.for_draft_layer`: vLLM's proposer needs every draft layer's cache in one
    KV-cache group, and a ring is a group of its own)."""
    if not uses_qsa_core(vllm_config):
        return []
    text = vllm_config.model_config.hf_text_config
    config, dtype = qsa_config_for(vllm_config, text), vllm_config.model_config.dtype
    return [
        QSASideCache.for_draft_layer(vllm_config=vllm_config, make_spec=lambda vc: ring_spec(vc, config, dtype),
                                     prefix=prefix)
        for prefix in mtp_ring_prefixes(vllm_config, text)
    ]


class Qwen4ExpForCausalLM(upstream_model.Qwen4ExpForCausalLM):
    """Upstream's text model; QSA layers on qsa_core when `uses_qsa_core`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        with core_attention_layers(vllm_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        hyperconnections_in_model_dtype(self, vllm_config)
        self.qsa_draft_rings = register_draft_rings(vllm_config)  # a list: no submodules


class Qwen4ExpForConditionalGeneration(upstream_model.Qwen4ExpForConditionalGeneration):
    """Upstream's vision-language model; QSA layers on qsa_core when `uses_qsa_core`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:
        with core_attention_layers(vllm_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        hyperconnections_in_model_dtype(self, vllm_config)
        self.qsa_draft_rings = register_draft_rings(vllm_config)
        if vllm_config.speculative_config is not None:
            name_image_token_for_proposer(self.config)


class Qwen4ExpMTP(upstream_mtp.Qwen4ExpMTP):
    """Upstream's MTP drafter; its QSA layer on qsa_core when `uses_qsa_core`, with the ring
    its target model registered (`register_draft_rings`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        with core_attention_layers(vllm_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        hyperconnections_in_model_dtype(self, vllm_config)
        for module in self.modules():
            if isinstance(module, QSAIndexer) and not module.is_draft:
                raise RuntimeError(
                    f"QSA_CORE: the MTP layer's ring {module.raw_key_cache.prefix!r} was not registered by the "
                    "target model (it registers mtp.layers.{num_hidden_layers + i}.self_attn.indexer.raw_key_cache): "
                    "vLLM would put it in a KV-cache group of its own, which its proposer refuses"
                )


ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP")
