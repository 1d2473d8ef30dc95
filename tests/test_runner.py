"""Padding rows are inert, NaN never leaks into caches or outputs, steps are deterministic
(reference ops and Triton kernels alike)."""

import pytest
import torch

from hf_oracle import DEVICE, random_hf_attention, tiny_config
from qsa_core import QSAAttention
from qsa_core.standalone import Runner


def make_runner(**kw):
    layers = [QSAAttention.from_hf(random_hf_attention(tiny_config(), seed)).to(DEVICE) for seed in (0, 1)]
    args = dict(page_size=8, num_pages=32, max_requests=4, shuffle_pages=True)
    return Runner(layers, **{**args, **kw})


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
        for name in ("k", "v"):  # stray K or V writes show against the step's slots
            changed = (getattr(cache, name) != old[name]).flatten(2).any(-1).flatten().nonzero().flatten()
            assert set(changed.tolist()) <= set(written.tolist()), name
            assert changed.numel() > 0, name
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
    with pytest.raises(ValueError, match="at least one request"):
        r.step({})
    with pytest.raises(ValueError, match=r"chunk of request 'a' must be \[n >= 1, hidden_size = 256\]"):
        r.step({"a": torch.randn(3, 255)})
    with pytest.raises(ValueError, match=r"rope_positions of request 'a' must be int64 \[3\] or \[3, 3\]"):
        r.step({"a": torch.randn(3, 256)}, rope_positions={"a": torch.arange(4)})
    with pytest.raises(ValueError, match=r"rope_positions name requests not in this step: \['b'\]"):
        r.step({"a": torch.randn(3, 256)}, rope_positions={"b": torch.arange(3)})
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        r.free("zz")
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        r.truncate("zz", 0)
    assert r.num_free_pages == 32 and r.num_free_ring_rows == 4 and r.request_ids == []


def test_freed_ids_are_not_silently_restarted():
    r = make_runner()
    r.step({"a": torch.randn(5, 256)})
    r.free("a")
    with pytest.raises(KeyError, match="request 'a' was already freed"):
        r.free("a")
    with pytest.raises(ValueError, match="request 'a' was freed"):
        r.step({"a": torch.randn(1, 256)})
    assert r.num_free_pages == 32 and r.num_free_ring_rows == 4 and r.request_ids == []


def state(r):
    return r.num_free_pages, r.num_free_ring_rows, {rid: r.seq_len(rid) for rid in r.request_ids}


@pytest.mark.parametrize("failure", ["pages", "ring"])
def test_a_failed_step_admits_nothing_and_holds_nothing(failure):
    """The failed step leaves no trace: the next steps give bitwise what they give without it."""
    g = torch.Generator().manual_seed(3)
    xa, xb, xc = (torch.randn(n, 256, generator=g) for n in (70, 30, 200))
    kw = dict(max_requests=2) if failure == "ring" else {}
    r, twin = make_runner(**kw), make_runner(**kw)
    for runner in (r, twin):
        runner.step({"a": xa[:60]})
    before = state(r)
    bad = {"a": xa[60:61], "b": xb, "c": xc[:30]} if failure == "ring" else {"a": xa[60:61], "b": xb, "c": xc}
    with pytest.raises(RuntimeError, match="ring row" if failure == "ring" else "out of KV pages"):
        r.step(bad)
    assert state(r) == before
    for step in ({"a": xa[60:61], "b": xb}, {"a": xa[61:70], "b": xb[:1]}):
        got, want = r.step(step), twin.step(step)
        for k in step:
            assert torch.equal(got[k], want[k]), k
    assert state(r) == state(twin)
    with pytest.raises(ValueError, match="different QSAConfig"):
        Runner([QSAAttention.from_hf(random_hf_attention(tiny_config(), 0)),
                QSAAttention.from_hf(random_hf_attention(tiny_config(indexer_budget=8), 0))],
               page_size=8, num_pages=4, max_requests=1)


def test_a_step_failing_inside_a_layer_holds_nothing(monkeypatch):
    r = make_runner()
    r.step({"a": torch.randn(9, 256)})
    before = state(r)

    def fails(*args, **kwargs):
        raise FloatingPointError("layer 1 failed")

    monkeypatch.setattr(r.layers[1], "forward", fails)
    with pytest.raises(FloatingPointError):
        r.step({"a": torch.randn(1, 256), "b": torch.randn(20, 256)})
    assert state(r) == before
    monkeypatch.undo()
    r.step({"a": torch.randn(1, 256), "b": torch.randn(20, 256)})
    assert r.seq_len("a") == 10 and r.seq_len("b") == 20
