"""The eager planner: sized at start-up for the largest step SGLang runs eagerly (`eager.py`),
warmed right after the backend is built, rebuilt only for a step above that bound.

On the CPU the warm-up compiles nothing (`start_up_warm` returns None on the reference
backend), so these tests record its call and check the planner it got and its arguments."""

import logging

import pytest
from qsa_adapters.sglang import backend
from qsa_adapters.sglang.eager import eager_max_tokens
from sglang.srt import runtime_context
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_harness import Env, ensure_plugin, publish_cpu_context


def test_bound_is_the_chunk_or_max_prefill_tokens_or_the_decode_rows():
    kw = dict(max_prefill_tokens=16384, num_request_slots=4, speculative_tokens=0)
    assert eager_max_tokens(chunked_prefill_size=1024, **kw) == 1024  # chunking on: the chunk, not max_prefill
    assert eager_max_tokens(chunked_prefill_size=None, **kw) == 16384  # off: max_prefill_tokens
    assert eager_max_tokens(chunked_prefill_size=-1, **kw) == 16384  # SGLang's "off" spelling
    # Decode / verify rows of every request slot when they exceed the prefill bound.
    assert eager_max_tokens(chunked_prefill_size=1024, max_prefill_tokens=16384, num_request_slots=300,
                            speculative_tokens=3) == 1200
    assert eager_max_tokens(chunked_prefill_size=2048, max_prefill_tokens=16384, num_request_slots=300,
                            speculative_tokens=3) == 2048
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1, got 0"):
        eager_max_tokens(chunked_prefill_size=None, max_prefill_tokens=0, num_request_slots=4, speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_tokens must be >= 0, got -1"):
        eager_max_tokens(chunked_prefill_size=8, max_prefill_tokens=8, num_request_slots=4, speculative_tokens=-1)


@pytest.fixture
def warm_calls(monkeypatch):
    """Every start_up_warm call of the backend: (planner, caches, keyword arguments); the real
    one runs too (None on the CPU's reference backend)."""
    ensure_plugin()
    publish_cpu_context()
    calls, real = [], backend.start_up_warm

    def spy(planner, caches, **kw):
        caches = list(caches)
        calls.append((planner, caches, kw))
        out = real(planner, caches, **kw)
        assert out is None and planner.backend.name == "reference"
        return out

    monkeypatch.setattr(backend, "start_up_warm", spy)
    return calls


def schedule(**kw):
    """SGLang's published schedule config with these leaves, for the block (its own scoped override)."""
    return runtime_context.get_schedule().override(**kw)


@pytest.mark.parametrize("drafts", [0, 3])
def test_backend_builds_the_eager_planner_at_the_bound_and_warms_it(warm_calls, monkeypatch, drafts):
    spec = None
    if drafts:  # NEXTN as SGLang resolves it: EAGLE, 1 + drafts draft tokens published
        monkeypatch.setattr(runtime_context, "max_speculative_num_draft_tokens", lambda: drafts + 1)
        spec = SpeculativeAlgorithm.from_string("EAGLE")
    with schedule(chunked_prefill_size=1024, max_prefill_tokens=16384):
        env = Env(max_reqs=300, spec_algorithm=spec)
    be = env.backend
    assert be.planner.max_num_tokens == max(1024, 300 * (1 + drafts))
    assert be.planner.static is None  # eager: plans static=False on the step's own tables
    (planner, caches, kw), = warm_calls  # once, as the backend is built
    assert planner is be.planner
    ids = list(env.pool.full_attention_layer_id_mapping)
    assert [c.k.data_ptr() for c in caches] == [env.pool.get_key_buffer(i).data_ptr() for i in ids]
    assert [c.ring.data_ptr() for c in caches] == [be.ring.keys[i].data_ptr() for i in ids]
    assert kw == dict(decode_query_lens=(1, 1 + drafts) if drafts else (1,), static=False,
                      block_table_strides=(16,), mixed=False)  # eager steps never mix; tables 16-aligned (batch_map)


def test_without_chunked_prefill_the_bound_is_max_prefill_tokens(warm_calls):
    with schedule(chunked_prefill_size=None, max_prefill_tokens=3000):
        env = Env()
    assert env.backend.planner.max_num_tokens == 3000


def test_steps_within_the_bound_keep_the_planner_and_a_larger_one_grows_it(warm_calls, caplog):
    with schedule(chunked_prefill_size=1024, max_prefill_tokens=16384):
        env = Env(max_ctx=2048, slots=4096)
    be = env.backend
    planner = be.planner
    env.admit("a")
    env.admit("b")
    # A chunk of the whole bound (two requests), then a decode: the warmed planner plans both.
    be.init_forward_metadata(env.extend({"a": 600, "b": 424}))
    assert be.plan.num_tokens == 1024 and be.planner is planner
    be.init_forward_metadata(env.decode(["a", "b"]))
    assert be.plan.num_tokens == 2 and be.planner is planner
    assert "exceeds the eager planner" not in caplog.text
    # Above the bound (a server whose chunk the scheduler overrode): grown, unwarmed, logged.
    env.admit("c")
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        be.init_forward_metadata(env.extend({"c": 1100}))
    assert be.planner is not planner and be.planner.max_num_tokens == 2048 and be.plan.num_tokens == 1100
    assert "an eager step of 1100 rows exceeds the eager planner's 1024: rebuilt for 2048 rows" in caplog.text
    assert len(warm_calls) == 1  # the grown planner is not warmed mid-serving
