"""QSAConfig and the cache plan: read from HF as it is, bad geometry rejected by field name."""

import dataclasses
import json

import pytest
import torch

from hf_oracle import tiny_config
from qsa_core import QSACacheLayout, QSAConfig, ring_capacity, validate_layer_cache

GOOD = dict(
    hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, index_n_heads=4, index_head_dim=128,
    token_topk=16, compress_ratio=4, rotary_dim=32, rope_theta=1e4,
)


def test_from_hf_config_object_dict_and_path(tmp_path):
    hf = tiny_config()
    from_obj = QSAConfig.from_hf(hf)
    assert from_obj == QSAConfig(**GOOD)
    assert QSAConfig.from_hf(hf.to_dict()) == from_obj
    (tmp_path / "config.json").write_text(json.dumps({"text_config": hf.to_dict()}))
    assert QSAConfig.from_hf(tmp_path) == from_obj
    assert (from_obj.block_topk, from_obj.selection_width, from_obj.packed_width) == (4, 19, 20)


def test_from_hf_production_geometry_and_mrope():
    cfg = QSAConfig.from_hf(
        dict(
            hidden_size=2048, num_attention_heads=24, num_key_value_heads=2, head_dim=256,
            indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
            indexer_compress_ratio=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        )
    )
    assert (cfg.rotary_dim, cfg.block_topk, cfg.selection_width) == (64, 512, 2051)
    assert cfg.mrope_section == (11, 11, 10)
    axes = cfg.rope_axes().tolist()
    assert axes[:6] == [0, 1, 2, 0, 1, 2] and axes[30:] == [0, 1]


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(compress_ratio=1, token_topk=16), "compress_ratio"),
        (dict(token_topk=18), "token_topk"),
        (dict(index_kv_heads=2), "index_kv_heads"),
        (dict(rotary_dim=256, head_dim=256), "rotary_dim"),
        (dict(num_heads=5), "num_heads"),
        (dict(index_dtype="fp16"), "index_dtype"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
    ],
)
def test_invalid_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        QSAConfig(**{**GOOD, **change})


def test_from_hf_rejects_a_config_without_qsa():
    with pytest.raises(ValueError, match="indexer_n_heads"):
        QSAConfig.from_hf(dict(hidden_size=8, num_attention_heads=2))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(indexer_budget=18), r"indexer_budget \[token_topk\] \(18\) must be divisible by "
                                  r"indexer_compress_ratio \[compress_ratio\] \(4\)"),
        (dict(indexer_compress_ratio=1), r"indexer_compress_ratio \[compress_ratio\] must be >= 2, got 1"),
        (dict(indexer_budget=16.5), r"indexer_budget \[token_topk\]: .*integer.*16\.5"),
        (dict(indexer_kv_heads=2), r"indexer_kv_heads \[index_kv_heads\] must be 1"),
        (dict(indexer_n_heads=0), r"indexer_n_heads \[index_n_heads\]: .*greater than 0"),
        (dict(num_attention_heads=3, head_dim=64), r"num_attention_heads \[num_heads\] \(3\) must be "
                                                   r"divisible by num_key_value_heads \[num_kv_heads\] \(2\)"),
        (dict(indexer_head_dim=16), r"head_dim \* rope_parameters.partial_rotary_factor \[rotary_dim\] \(32\) "
                                    r"must be <= indexer_head_dim \[index_head_dim\] \(16\)"),
        (dict(rope_parameters=dict(rope_type="default", rope_theta=-1.0, partial_rotary_factor=0.5)),
         r"rope_parameters.rope_theta \[rope_theta\]: .*greater than 0"),
        (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.3)),
         r"rope_parameters.partial_rotary_factor \(0.3\) \* head_dim \(64\) must be a whole number"),
        (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4)), r"rope_parameters.rope_type must be 'default'"),
        (dict(hidden_size=None), r"missing required fields \['hidden_size'\]"),
    ],
)
def test_from_hf_errors_name_the_hf_field(change, message):
    """A config.json the user edited: the error names the HF key, then the QSAConfig field."""
    with pytest.raises(ValueError, match=message):
        QSAConfig.from_hf({**tiny_config().to_dict(), **change})


def test_from_hf_overrides_keep_their_own_names():
    with pytest.raises(ValueError, match=r"index_dtype: Input should be 'auto'"):
        QSAConfig.from_hf(tiny_config(), index_dtype="fp16")


def test_ring_capacity_and_allocation():
    assert [ring_capacity(4, s) for s in (0, 1, 3, 4, 5)] == [4, 8, 8, 8, 12]
    cfg = QSAConfig(**GOOD, index_dtype="fp8_e4m3", mrope_section=(6, 5, 5))
    layout = QSACacheLayout(num_layers=2, page_size=8, num_pages=5, ring_rows=3, num_speculative_tokens=3)
    caches = layout.allocate(cfg, torch.bfloat16)
    c = caches[0]
    assert c.k.shape == (5, 8, 2, 64) and c.v.shape == (5, 8, 2, 64) and c.k.stride(-1) == 1
    assert c.k.data_ptr() != c.v.data_ptr()
    assert c.compressed.shape == (5, 2, 128) and c.compressed.dtype == torch.float8_e4m3fn
    assert c.ring.shape == (3, 8, 128) and c.ring_positions.shape == (3, 8, 3)
    one_d = QSACacheLayout(num_layers=1, page_size=8, num_pages=5, ring_rows=3).allocate(QSAConfig(**GOOD), torch.float32)
    assert one_d[0].ring_positions.shape == (3, 4, 3)  # 1-D models remember RoPE positions too
    with pytest.raises(ValueError, match="page_size"):
        QSACacheLayout(num_layers=1, page_size=6, num_pages=2, ring_rows=1).allocate(cfg, torch.bfloat16)


def test_engine_owned_cache_views_are_checked_once_at_binding():
    cfg = QSAConfig(**GOOD, mrope_section=(6, 5, 5))
    good = QSACacheLayout(num_layers=1, page_size=8, num_pages=4, ring_rows=2).allocate(cfg, torch.float32)[0]
    validate_layer_cache(good, cfg, page_size=8, dtype=torch.float32)
    bad = [
        (dict(k=good.k[:, :, :1]), "cache.k must be"),
        (dict(v=good.v.transpose(-1, -2)), "cache.v must be"),
        (dict(v=good.v[:2]), r"cache.v must have as many pages as cache.k \(4\), got 2"),
        (dict(compressed=good.compressed[:3]), "cache.compressed needs >= 4 pages"),
        (dict(compressed=good.compressed.flatten(0, 1)), "cache.compressed must be \\[num_pages, 2, 128\\]"),
        (dict(ring=good.ring[..., :64]), "cache.ring must be"),
        (dict(ring_positions=good.ring_positions[:1]), "ring_positions must be int64"),
        (dict(ring_positions=None), "ring_positions is required"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            validate_layer_cache(dataclasses.replace(good, **change), cfg, page_size=8, dtype=torch.float32)


def test_each_cache_must_hold_the_dtype_its_stores_assume():
    """Main K/V hold kv_cache_dtype, compressed keys index_dtype ("auto": the model dtype), the
    ring the model dtype, ring positions int64. The stores cast to whatever the cache holds,
    so a wrong dtype (an fp8 pool's uint8 storage, bf16 keys where fp8 was configured, an fp8
    ring) would round or garble silently: each is refused, naming the field and its dtype."""
    cfg = QSAConfig(**GOOD, index_dtype="fp8_e4m3", kv_cache_dtype="fp8_e5m2", mrope_section=(6, 5, 5))
    good = QSACacheLayout(num_layers=1, page_size=8, num_pages=4, ring_rows=2).allocate(cfg, torch.bfloat16)[0]
    validate_layer_cache(good, cfg, page_size=8, dtype=torch.bfloat16)
    kv, index = r"torch.float8_e5m2 \(kv_cache_dtype 'fp8_e5m2'\)", r"torch.float8_e4m3fn \(index_dtype 'fp8_e4m3'\)"
    ring = r"torch.bfloat16 \(the model dtype: raw keys are pooled as they are\)"
    bad = [
        (dict(k=good.k.to(torch.bfloat16)), rf"cache.k must be {kv}, got torch.bfloat16"),
        (dict(v=good.v.view(torch.uint8)), rf"cache.v must be {kv}, got torch.uint8"),
        (dict(compressed=good.compressed.to(torch.bfloat16)), rf"cache.compressed must be {index}, got torch.bfloat16"),
        (dict(compressed=good.compressed.view(torch.float8_e5m2)),
         rf"cache.compressed must be {index}, got torch.float8_e5m2"),
        (dict(ring=good.ring.to(torch.float8_e4m3fn)), rf"cache.ring must be {ring}, got torch.float8_e4m3fn"),
        (dict(ring=good.ring.float()), rf"cache.ring must be {ring}, got torch.float32"),
        (dict(ring_positions=good.ring_positions.int()), r"cache.ring_positions must be int64 .*, got torch.int32"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            validate_layer_cache(dataclasses.replace(good, **change), cfg, page_size=8, dtype=torch.bfloat16)
    auto = QSAConfig(**GOOD)  # "auto" caches follow the model dtype the layer runs in
    caches = QSACacheLayout(num_layers=1, page_size=8, num_pages=4, ring_rows=2).allocate(auto, torch.bfloat16)[0]
    with pytest.raises(ValueError, match=r"cache.k must be torch.float32 \(kv_cache_dtype 'auto' = the model dtype\)"):
        validate_layer_cache(caches, auto, page_size=8, dtype=torch.float32)
    caches.k = caches.k.float()
    caches.v = caches.v.float()
    with pytest.raises(ValueError, match=r"cache.compressed must be torch.float32 \(index_dtype 'auto' = the model "):
        validate_layer_cache(caches, auto, page_size=8, dtype=torch.float32)
