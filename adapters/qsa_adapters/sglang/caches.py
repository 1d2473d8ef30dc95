"""`QSALayerCache` views over SGLang's own `QSATokenToKVPool` buffers (no second copy).

| core cache | SGLang buffer (per layer unless noted) | view |
|---|---|---|
| k, v | `get_key_buffer` / `get_value_buffer` [slots, Hkv, D] | [slots / page, page, Hkv, D] |
| compressed | `get_qsa_compressed_k_buffer` [cap, 1, Di], row = main slot // r | [cap / (page / r), page / r, Di] |
| ring, ring_positions | the adapter's own `ring.AdapterRing` (C rows per request; SGLang's pool ring of r rows is not used) | [request slots, C, Di], [request slots, C, 3] (MRoPE only) |

The getters are called per forward so that the pool's layer-wise transfer waits still apply.
"""

from __future__ import annotations

import torch
from qsa_core import QSAConfig, QSALayerCache, validate_layer_cache

from .ring import AdapterRing

INDEX_DTYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3"}
# The pool's K/V dtype as a `QSAConfig.kv_cache_dtype` (any other: "auto", the model dtype).
KV_DTYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def check_pool(pool, config: QSAConfig, dtype: torch.dtype) -> None:
    """The pool's QSA geometry must be the model's, and its raw-key ring the model dtype
    (checked once, at backend construction)."""
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    if not isinstance(pool, QSATokenToKVPool):
        raise TypeError(f"qsa_core needs runner.token_to_kv_pool to be a QSATokenToKVPool, got {type(pool).__name__}")
    expected = {
        "qsa_compress_ratio": config.compress_ratio,
        "qsa_index_head_dim": config.index_head_dim,
        "qsa_index_kv_heads": 1,
        "qsa_token_topk": config.token_topk,
    }
    for name, want in expected.items():
        got = getattr(pool, name)
        if got != want:
            raise ValueError(f"QSATokenToKVPool.{name} must be {want} for this model, got {got}")
    if pool.page_size % config.compress_ratio:
        raise ValueError(
            f"qsa_core needs page_size to be a multiple of indexer_compress_ratio "
            f"({config.compress_ratio}); got page_size {pool.page_size}"
        )
    ring_dtype = pool.index_state_dtype  # what the pool allocates every layer's raw-key ring in
    if ring_dtype != dtype:
        raise ValueError(
            f"qsa_core serves a QSATokenToKVPool model in its ring's dtype {ring_dtype} only: the pool keeps "
            f"raw keys in {ring_dtype} and QSA pools them as they are (the core's ring holds the model dtype); "
            f"launch with --dtype {str(ring_dtype).removeprefix('torch.')}, got model dtype {dtype}"
        )
    if pool.qsa_compressed_dtype not in INDEX_DTYPES:
        raise ValueError(f"QSATokenToKVPool.qsa_compressed_dtype must be one of {list(INDEX_DTYPES)}, got {pool.qsa_compressed_dtype}")


def _pages(buf: torch.Tensor, rows_per_page: int, *, single_head: bool = False) -> torch.Tensor:
    """[rows, ...] -> [rows // rows_per_page, rows_per_page, ...] (a view). single_head: the
    buffer is [rows, 1, Di] (the indexer's one key head), whose head dim is dropped; K/V keep
    theirs, also when a tensor-parallel rank holds one KV head."""
    n = buf.shape[0] // rows_per_page
    if single_head:
        buf = buf[:, 0]
    return buf[: n * rows_per_page].view(n, rows_per_page, *buf.shape[1:])


def layer_cache(
    pool, ring: AdapterRing, layer_id: int, *, page_size: int, k_scale: float = 1.0, v_scale: float = 1.0
) -> QSALayerCache:
    """The core's view of one QSA layer's caches: K/V and compressed keys in `pool` (global
    `layer_id`), raw keys (and MRoPE positions) in the adapter's `ring`."""
    r = pool.qsa_compress_ratio
    keys, positions = ring.views(layer_id)
    return QSALayerCache(
        k=_pages(pool.get_key_buffer(layer_id), page_size),
        v=_pages(pool.get_value_buffer(layer_id), page_size),
        compressed=_pages(pool.get_qsa_compressed_k_buffer(layer_id), page_size // r, single_head=True),
        ring=keys,
        ring_positions=positions,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def checked_layer_cache(
    pool, ring: AdapterRing, layer_id: int, config: QSAConfig, dtype: torch.dtype, **kw
) -> QSALayerCache:
    """`layer_cache` plus the core's shape and dtype checks for model dtype `dtype` (run once
    per layer)."""
    cache = layer_cache(pool, ring, layer_id, **kw)
    validate_layer_cache(cache, config, kw["page_size"], ring_capacity=ring.capacity, dtype=dtype)
    return cache
