"""Tensor parallelism of the core: each rank holds its heads' share of a QSA layer (the
engines' split, `QSAConfig.head_shard`), its own caches, and the whole weight-free indexer.

Ranks run as spawned processes over torch.distributed (gloo); their all-reduced outputs must
equal the unsharded layer's, and every rank must select the same tokens.
"""

import pytest
import torch

from qsa_core import QSAConfig
from tp_ranks import TINY, TPLayer, check_ranks, model, run_ranks, run_schedule, shard_layer

PRODUCTION = QSAConfig(**{**TINY.model_dump(), "hidden_size": 2048, "num_heads": 24, "num_kv_heads": 2, "head_dim": 256})


@pytest.mark.parametrize(
    "tp, query_heads, kv_heads",
    [
        (1, [range(0, 24)], [range(0, 2)]),
        (2, [range(0, 12), range(12, 24)], [range(0, 1), range(1, 2)]),
        # more ranks than KV heads: each KV head on tp / Hkv consecutive ranks (kv head = rank // 2)
        (4, [range(0, 6), range(6, 12), range(12, 18), range(18, 24)], [range(0, 1)] * 2 + [range(1, 2)] * 2),
        (8, [range(3 * r, 3 * r + 3) for r in range(8)], [range(0, 1)] * 4 + [range(1, 2)] * 4),
    ],
)
def test_head_shard_follows_the_engines_split(tp, query_heads, kv_heads):
    shards = [PRODUCTION.head_shard(tp, r) for r in range(tp)]
    assert [s.query_heads for s in shards] == query_heads
    assert [s.kv_heads for s in shards] == kv_heads
    for r, s in enumerate(shards):
        rank = PRODUCTION.for_rank(tp, r)
        assert (rank.num_heads, rank.num_kv_heads) == (len(s.query_heads), len(s.kv_heads))
        assert rank.model_dump(exclude={"num_heads", "num_kv_heads"}) == PRODUCTION.model_dump(
            exclude={"num_heads", "num_kv_heads"})
        # each query head keeps the model's KV head (GQA group Hq / Hkv = 12)
        assert {h // 12 for h in s.query_heads} == set(s.kv_heads)


@pytest.mark.parametrize(
    "tp, rank, message",
    [(5, 0, "num_heads \\(24\\) must be divisible by tp_size \\(5\\)"),
     (3, 0, "tp_size \\(3\\) must be divisible by num_kv_heads \\(2\\)"),
     (2, 2, "rank must be in \\[0, tp_size = 2\\)"),
     (0, 0, "tp_size must be a positive integer")],
)
def test_bad_tensor_parallel_split_names_the_field(tp, rank, message):
    with pytest.raises(ValueError, match=message):
        PRODUCTION.for_rank(tp, rank)


def test_kv_heads_must_divide_by_tp_when_not_replicated():
    with pytest.raises(ValueError, match="num_kv_heads \\(6\\) must be divisible by tp_size \\(4\\)"):
        QSAConfig(**{**TINY.model_dump(), "num_heads": 12, "num_kv_heads": 6}).for_rank(4, 0)


@pytest.fixture(scope="module")
def tp1():
    """The unsharded layers' run of the schedule (fp32)."""
    return run_schedule([TPLayer(layer) for layer in model()], torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layers_equal_the_unsharded_layers(tmp_path, tp1, world):
    # world 4: each of the 2 KV heads on two ranks
    check_ranks(run_ranks(world, tmp_path), tp1, rtol=1e-5, atol=1e-5)  # fp32


def test_shard_layer_keeps_the_o_proj_bias_once():
    cfg = QSAConfig(**{**TINY.model_dump(), "attention_bias": True})
    full = model(cfg, 1)[0]
    x = torch.randn(3, cfg.hidden_size)
    parts = [shard_layer(full, 2, r) for r in range(2)]
    attn = torch.randn(3, cfg.num_heads * cfg.head_dim)
    halves = attn.chunk(2, dim=1)
    torch.testing.assert_close(sum(p.o_proj(h) for p, h in zip(parts, halves)), full.o_proj(attn))
    torch.testing.assert_close(torch.cat([p.q_proj(x) for p in parts], 1), full.q_proj(x))
