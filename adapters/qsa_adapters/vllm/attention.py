"""`QSAAttentionLayer`: a QSA attention layer for vLLM models, built on `QSAIndexer`.

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
from .indexer import QSAIndexer, qsa_config_for


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
        register_layer(vllm_config, self.layer_name, self)

    def get_attn_backend(self) -> type[QSACoreBackend]:
        return QSACoreBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return main_kv_spec(vllm_config, self.qsa_config, self.kv_dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        cfg = self.qsa_config
        qkv = (self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states))
        _, indexed = self.indexer(self.indexer.index_qk_proj(hidden_states), positions, attn=self, qkv=qkv)
        out = hidden_states.new_zeros(hidden_states.shape[0], cfg.num_heads * cfg.head_dim)
        if indexed is not None:
            plan, cache = self.indexer.step_inputs(self, positions)
            qsa_attention(plan, indexed, cache, out=out)
        return self.o_proj(out)
