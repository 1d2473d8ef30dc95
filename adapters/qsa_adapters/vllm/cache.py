"""KV-cache specs of a QSA layer and the binding of vLLM's tensors to `QSALayerCache` views.

vLLM's allocator owns all three caches of a QSA layer:
- main K/V: `FullAttentionSpec` (page [Hkv, page_size, 2D], K and V side by side);
- compressed keys: `MLAAttentionSpec(tokens_per_state=r)` in the same KV-cache group, so it
  shares the main block table (page_size / r rows per block: row = main slot // r);
- raw-key ring: `CircularBufferSpec(block_size=C)`, a group of its own, one block per request.
All QSA backends declare block-outermost layouts (mixed page sizes in several groups need
them), so one block holds every layer's page; the core's paged views keep vLLM's block
strides (core page = vLLM block), with no renumbering.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
)

from qsa_core import QSAConfig, QSALayerCache, ring_capacity, validate_layer_cache

from .context import register_layer
from .metadata import PagedGeometry


def speculative_tokens(vllm_config: VllmConfig) -> int:
    """Draft tokens per step (0 without speculative decoding): sizes the ring."""
    spec = vllm_config.speculative_config
    return int(spec.num_speculative_tokens or 0) if spec is not None else 0


def main_kv_spec(vllm_config: VllmConfig, config: QSAConfig, dtype: torch.dtype) -> FullAttentionSpec:
    """Main K/V: [Hkv, page_size, 2D] per block, K then V in the last dim."""
    return FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_dim,
        head_size_v=config.head_dim,
        dtype=dtype,
    )


def compressed_key_spec(vllm_config: VllmConfig, config: QSAConfig, dtype: torch.dtype) -> MLAAttentionSpec:
    """Compressed keys: page_size / r rows of Di per block, in the main K/V's group."""
    block_size = vllm_config.cache_config.block_size
    if block_size % config.compress_ratio:
        raise ValueError(
            f"cache_config.block_size ({block_size}) must be a multiple of compress_ratio "
            f"({config.compress_ratio})"
        )
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=config.index_head_dim,
        dtype=dtype,
        tokens_per_state=config.compress_ratio,
    )


def ring_spec(vllm_config: VllmConfig, config: QSAConfig, dtype: torch.dtype) -> CircularBufferSpec:
    """Raw-key ring: one block of C = r * ceil((r + num_spec) / r) rows of Di per request."""
    return CircularBufferSpec(
        block_size=ring_capacity(config.compress_ratio, speculative_tokens(vllm_config)),
        num_kv_heads=1,
        head_size=config.index_head_dim,
        head_size_v=0,
        dtype=dtype,
    )


class QSASideCache(nn.Module, AttentionLayerBase):
    """A QSA side cache that vLLM allocates and binds: the raw-key ring or the compressed keys.

    Registers itself in `static_forward_context[prefix]`; after binding, `kv_cache` is
    vLLM's view [num_blocks, 1, rows per block, Di].
    """

    def __init__(self, *, vllm_config: VllmConfig, spec: KVCacheSpec, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.spec = spec
        self.kv_cache = torch.tensor([])
        register_layer(vllm_config, prefix, self)

    def get_attn_backend(self):
        from .backend import QSACoreBackend

        return QSACoreBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        want = (1, self.spec.num_states, self.spec.head_size)
        if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != want or kv_cache.dtype != self.spec.dtype:
            raise ValueError(
                f"{self.prefix}: cache must be [blocks, {want[0]}, {want[1]}, {want[2]}] {self.spec.dtype}, "
                f"got {tuple(kv_cache.shape)} {kv_cache.dtype}"
            )
        self.kv_cache = kv_cache


def bind_layer_cache(
    kv_cache: torch.Tensor, compressed: torch.Tensor, ring: torch.Tensor, config: QSAConfig
) -> tuple[QSALayerCache, PagedGeometry]:
    """The core's cache views of one QSA layer over vLLM's three bound tensors.

    kv_cache [B, Hkv, page, 2D]; compressed [B, 1, page / r, Di]; ring [B, 1, C, Di].
    Returns the views and the `PagedGeometry` the step metadata must use with them.
    """
    if config.uses_mrope:
        raise NotImplementedError("the vLLM adapter keeps no ring positions: MRoPE (mrope_section) is not supported")
    page = kv_cache.shape[2]
    rows_per_page = page // config.compress_ratio
    if compressed.shape[2] != rows_per_page:
        raise ValueError(
            f"compressed cache must hold page_size / r = {rows_per_page} rows per block, got {compressed.shape[2]}"
        )
    # Core page = vLLM block for all three caches: the views keep vLLM's block strides.
    D = kv_cache.shape[3] // 2
    k, v = kv_cache[..., :D].transpose(1, 2), kv_cache[..., D:].transpose(1, 2)
    C = ring.shape[2]
    geometry = PagedGeometry(compress_ratio=config.compress_ratio, page_size=page, ring_capacity=C)
    cache = QSALayerCache(k=k, v=v, compressed=compressed[:, 0], ring=ring[:, 0], ring_positions=None)
    validate_layer_cache(cache, config, page, ring_capacity=C)
    return cache, geometry
