"""A tensor-parallel rank's view of SGLang: its heads (`rank_config`) and its pool's caches.

The TP 2 server itself runs in test_server.py; these check the pieces on real SGLang pools.
"""

import pytest
import torch
from qsa_adapters.sglang.backend import rank_config
from qsa_adapters.sglang.caches import checked_layer_cache
from qsa_adapters.sglang.ring import AdapterRing
from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

from qsa_core import QSAConfig

MODEL = QSAConfig(
    hidden_size=2048, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4, index_head_dim=128,
    token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7,
)
PAGE = 64


@pytest.mark.parametrize("tp, heads", [(1, (24, 2)), (2, (12, 1)), (4, (6, 1)), (8, (3, 1))])
def test_rank_config_has_the_ranks_heads(tp, heads):
    # SGLang's KV pool holds max(1, Hkv / tp) heads per rank (replicated past Hkv ranks)
    for rank in range(tp):
        cfg = rank_config(MODEL, tp, rank, heads[1])
        assert (cfg.num_heads, cfg.num_kv_heads) == heads
        assert (cfg.index_n_heads, cfg.index_head_dim, cfg.token_topk) == (4, 128, 2048)  # the indexer whole


def test_rank_config_refuses_a_pool_with_other_kv_heads():
    with pytest.raises(ValueError, match="QSATokenToKVPool.head_num is 2, but attention-TP rank 1 of 2 holds 1 of"):
        rank_config(MODEL, 2, 1, 2)


def test_layer_cache_of_a_rank_with_one_kv_head():
    """A TP 2 rank's pool holds one KV head: its K/V views keep the head dim ([pages, page, 1, D])
    and the indexer's single-head buffers drop theirs."""
    cfg = MODEL.for_rank(2, 1)
    slots, requests = 8 * PAGE, 3
    pool = QSATokenToKVPool(
        size=slots, dtype=torch.bfloat16, page_size=PAGE, head_num=cfg.num_kv_heads, head_dim=cfg.head_dim,
        full_attention_layer_ids=[0], device="cpu", mamba_pool=None, qsa_index_kv_heads=1,
        qsa_index_head_dim=cfg.index_head_dim, qsa_compress_ratio=cfg.compress_ratio,
        qsa_token_topk=cfg.token_topk, num_request_slots=requests,
    )
    ring = AdapterRing.for_pool(pool, capacity=4, mrope=False)
    cache = checked_layer_cache(pool, ring, 0, cfg, torch.bfloat16, page_size=PAGE)
    pages = cache.k.shape[0]
    assert tuple(cache.k.shape) == tuple(cache.v.shape) == (pages, PAGE, 1, 256)
    assert cache.k.data_ptr() == pool.get_key_buffer(0).data_ptr()  # a view, no copy
    assert tuple(cache.compressed.shape[1:]) == (PAGE // 4, 128)
    assert tuple(cache.ring.shape) == (requests, 4, 128) and cache.ring_positions is None
