"""A Qwen4-Exp attention layer's `self_attention` run on `qsa_core`.

The layer's own linear modules compute the projections (quantized or TP-sharded as SGLang
built them); `layer.attn` (SGLang's RadixAttention, which keeps its padding and
breakable-graph handling) carries them to `QSACoreBackend`, whose output is already gated;
`o_proj` finishes the layer. SGLang's own indexer, its ring and compression writes and its
MTP index sharing are bypassed.
"""

from __future__ import annotations

from typing import Any

import torch
from qsa_core import QSANormWeights

from .backend import QSALayerInputs


def run_qsa_layer(layer: Any, hidden_states: torch.Tensor, forward_batch: Any) -> torch.Tensor:
    """hidden_states [T, hidden] (model dtype) -> [T, hidden]; same contract as self_attention."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"qsa_core expects hidden_states to be a tensor, got {type(hidden_states).__name__}")
    if not getattr(layer, "attn_output_gate", True):
        raise ValueError(f"layer {layer.layer_id}: QSA layers have an output gate (attn_output_gate=True)")
    for field, what in (("attn_cp_metadata", "prefill context parallelism"), ("attn_dcp_metadata", "decode context parallelism")):
        if getattr(forward_batch, field, None) is not None:
            raise NotImplementedError(f"qsa_core does not serve {what} (forward_batch.{field} is set)")
    qkv, _ = layer.qkv_proj(hidden_states)
    q_gate, k, v = qkv.split([2 * layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    index_qk, _ = layer.indexer.index_qk_proj(hidden_states)
    norms = QSANormWeights(
        index_q=layer.indexer.q_layernorm.weight,
        index_k=layer.indexer.k_layernorm.weight,
        q=layer.q_norm.weight,
        k=layer.k_norm.weight,
    )
    T, D = q_gate.shape[0], layer.head_dim
    # RadixAttention sizes its outputs from q: hand it the [T, Hq, D] query half.
    q = q_gate.view(T, layer.num_heads, 2 * D)[..., :D]
    out = layer.attn(q, k, v, forward_batch, qsa_inputs=QSALayerInputs(q_gate, index_qk, norms))
    out, _ = layer.o_proj(out.reshape(T, -1))
    return out
