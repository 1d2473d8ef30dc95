"""Padding rows are inert, NaN never leaks into caches or outputs, steps are deterministic
(reference ops and Triton kernels alike)."""

import pytest
import torch

from hf_oracle import DEVICE, random_hf_attention, tiny_config
from qsa_core import QSAAttention
from qsa_core.standalone import Runner


def make_runner(**kw):
    layers = [QSAAttention.from_hf(random_hf_attention(tiny_config(), seed)).to(DEVICE) for seed in (0, 1)]
    return Runner(layers, page_size=8, num_pages=32, max_requests=4, shuffle_pages=True, **kw)


def snapshot(runner):
    return [{k: getattr(c, k).clone() for k in ("k", "v", "compressed", "ring")} for c in runner.caches]


def test_nan_padding_rows_write_nothing_and_output_zero(backend):
    r = make_runner()
    g = torch.Generator().manual_seed(0)
    r.step({"a": torch.randn(21, 256, generator=g), "b": torch.randn(6, 256, generator=g)})
    before = snapshot(r)
    x = {"a": torch.randn(1, 256, generator=g), "b": torch.randn(9, 256, generator=g)}
    out = r.step(x, padding=torch.full((5, 256), float("nan")))
    meta = r.last_metadata
    assert meta.num_padding_rows == 5 and meta.positions[-5:].tolist() == [-1] * 5
    assert torch.equal(r.last_padding_output.cpu(), torch.zeros(5, 256))
    assert all(torch.isfinite(o).all() for o in out.values())
    written = meta.slot_mapping[meta.slot_mapping >= 0]
    for old, cache in zip(before, r.caches):
        for name in ("k", "v", "compressed", "ring"):
            assert torch.isfinite(getattr(cache, name)).all(), name
        changed = (cache.k != old["k"]).flatten(2).any(-1).flatten().nonzero().flatten()
        assert set(changed.tolist()) <= set(written.tolist())
        ring_changed = (cache.ring != old["ring"]).any(-1).flatten().nonzero().flatten()  # flat ring slots
        assert set(ring_changed.tolist()) <= set(meta.ring_slot[meta.ring_slot >= 0].tolist())
        comp_changed = (cache.compressed != old["compressed"]).any(-1).flatten().nonzero().flatten()
        assert set(comp_changed.tolist()) <= set(meta.compressed_slot[meta.compressed_slot >= 0].tolist())


def test_same_step_twice_is_bitwise_equal(backend):
    g = torch.Generator().manual_seed(1)
    steps = [{"a": torch.randn(30, 256, generator=g), "b": torch.randn(17, 256, generator=g)},
             {"a": torch.randn(1, 256, generator=g), "b": torch.randn(12, 256, generator=g)}]
    results = []
    for _ in range(2):
        r = make_runner()
        results.append([r.step(s) for s in steps])
    for one, two in zip(*results):
        for k in one:
            assert torch.equal(one[k], two[k])


def test_decodes_are_ordered_first_and_share_one_query_length():
    r = make_runner(num_speculative_tokens=1)
    g = torch.Generator().manual_seed(2)
    r.step({"a": torch.randn(9, 256, generator=g), "b": torch.randn(5, 256, generator=g)})
    r.step({"b": torch.randn(3, 256, generator=g), "a": torch.randn(2, 256, generator=g),
            "c": torch.randn(2, 256, generator=g)})
    meta = r.last_metadata
    assert (meta.num_decodes, meta.decode_query_len) == (1, 2)  # "a" holds context: a decode
    assert meta.query_start_loc.tolist() == [0, 2, 5, 7]  # a, then b and the new c
    assert meta.positions.tolist() == [9, 10, 5, 6, 7, 0, 1]


def test_runner_errors_name_what_is_wrong():
    r = make_runner()
    with pytest.raises(ValueError, match="chunk of request 'a'"):
        r.step({"a": torch.randn(0, 256)})
    with pytest.raises(RuntimeError, match="out of KV pages"):
        r.step({"a": torch.randn(33 * 8, 256)})
    with pytest.raises(ValueError, match="different QSAConfig"):
        Runner([QSAAttention.from_hf(random_hf_attention(tiny_config(), 0)),
                QSAAttention.from_hf(random_hf_attention(tiny_config(indexer_budget=8), 0))],
               page_size=8, num_pages=4, max_requests=1)
