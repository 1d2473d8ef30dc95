"""The one place the vLLM adapter calls the core's layer (`run_core_attention`), and
`QSAAttentionLayer`: a QSA attention layer for other vLLM models, built on `QSAIndexer`.

Checkpoint names under `prefix` (normally `model.layers.N.self_attn`) are the HF ones:
q_proj (per head [q | gate]), k_proj, v_proj, o_proj, q_norm, k_norm and
indexer.{index_qk_proj, q_layernorm, k_layernorm}. Projections are vLLM `ReplicatedLinear`
layers (so `quant_config` applies; every tensor-parallel rank runs the whole layer);
everything from the projections on is `qsa_core`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.v1.kv_cache_interface import KVCacheSpec

from qsa_core import GemmaRMSNorm, qsa_attention

from .backend import QSACoreBackend
from .cache import main_kv_spec
from .context import register_layer
from .indexer import QSAAttentionLike, QSAIndexer, qsa_config_for


class QSAAttentionLayer(nn.Module, AttentionLayerBase):
    """A QSA layer: `forward(positions [N], hidden_states [N, hidden]) -> [N, hidden]`.

    Registers itself as `{prefix}.attn` (its main K/V cache); its indexer registers the
    ring and compressed-key caches. Rows vLLM did not schedule (padding past T) give 0.
    """

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        config: Any,
        layer_id: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        cfg = qsa_config_for(vllm_config, config)
        if cfg.kv_cache_dtype.startswith("fp8"):
            raise ValueError(
                f"QSAAttentionLayer does not serve --kv-cache-dtype {vllm_config.cache_config.cache_dtype} (it loads "
                "no k_scale / v_scale): the Qwen4-Exp model classes serve fp8 KV caches"
            )
        H, Hq, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def linear(n_in: int, n_out: int, name: str) -> ReplicatedLinear:
            return ReplicatedLinear(
                n_in, n_out, bias=cfg.attention_bias, quant_config=quant_config,
                prefix=f"{prefix}.{name}", return_bias=False,
            )

        self.q_proj = linear(H, Hq * 2 * D, "q_proj")
        self.k_proj = linear(H, Hkv * D, "k_proj")
        self.v_proj = linear(H, Hkv * D, "v_proj")
        self.o_proj = linear(Hq * D, H, "o_proj")
        self.q_norm = GemmaRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(D, cfg.rms_norm_eps)
        self.rotary_emb = get_rope(
            D,
            max_position=int(config.max_position_embeddings),
            is_neox_style=True,
            rope_parameters=dict(config.rope_parameters),
        )
        self.indexer = QSAIndexer(
            vllm_config=vllm_config,
            config=config,
            layer_id=layer_id,
            rotary_emb=self.rotary_emb,
            quant_config=quant_config,
            prefix=f"{prefix}.indexer",
        )
        self.qsa_config = cfg
        self.kv_dtype = vllm_config.model_config.dtype
        self.layer_name = f"{prefix}.attn"
        self.kv_cache = torch.tensor([])
        self._k_scale_float = self._v_scale_float = 1.0  # no fp8 cache here (above)
        register_layer(vllm_config, self.layer_name, self)

    def get_attn_backend(self) -> type[QSACoreBackend]:
        return QSACoreBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return main_kv_spec(vllm_config, self.qsa_config, self.kv_dtype, self.indexer.index_dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = (self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states))
        return self.o_proj(run_core_attention(self, self.indexer, positions, self.indexer.index_qk_proj(hidden_states), qkv))


def run_core_attention(
    attn: QSAAttentionLike,
    indexer: QSAIndexer,
    positions: torch.Tensor,
    projected_qk: torch.Tensor,
    qkv: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    selection_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated attention output [N, Hq*D] of a QSA layer from its projections (o_proj not
    applied): the core's indexer half, then its attention half into the output.

    projected_qk [N, (Hi+1)*Di]; qkv: fused [N, Hq*2D + 2*Hkv*D] (per head [q | gate], k, v)
    or the (q_gate, k, v) tuple; selection_buffer int32 [>= T, W + 1] receives the selection
    (MTP steps with `indexer.skip_topk` reuse it). Rows past the step's T and steps without
    metadata give 0.
    """
    cfg = indexer.qsa_config
    n = projected_qk.shape[0]
    step = indexer.step_inputs(attn, positions)
    if step is None:
        return projected_qk.new_zeros(n, cfg.num_heads * cfg.head_dim)
    plan, cache = step
    selection = None if selection_buffer is None else selection_buffer[: plan.num_tokens]
    _, indexed = indexer(projected_qk, positions, selection, attn=attn, qkv=qkv)
    if n == plan.num_tokens:  # vLLM's rows are the step's rows: the plan's workspace serves
        return qsa_attention(plan, indexed, cache)
    out = projected_qk.new_zeros(n, cfg.num_heads * cfg.head_dim)
    qsa_attention(plan, indexed, cache, out=out)
    return out
