"""`QSAPlanner.warm`: the start-up warm-up binds every launch of every step shape `warm_steps`
lists, writes no cache, trips no guard and leaves the planner's schedules as they were; on the
reference backend it does nothing. (Compiling what it binds for sm_90: tests/kernels/test_compile_sm90.py,
which records the same `warm` call.)"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from qsa_core import QSAConfig
from qsa_core.cache import QSACacheLayout
from qsa_core.planner import QSAPlanner, column_bucket
from qsa_core.warmup import column_buckets, row_counts, warm_steps

CFG = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, index_n_heads=4, index_head_dim=128,
           token_topk=16, compress_ratio=4, rotary_dim=32, rope_theta=1e4)


def test_row_counts_and_column_buckets():
    assert row_counts(20) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 20]
    assert row_counts(1) == [1]
    buckets = column_buckets(1 << 20, 4)
    assert buckets[:13] == [1 << i for i in range(13)] and buckets[-1] == 1 << 18
    # every bucket a step can take, and nothing else
    assert buckets == sorted({column_bucket(n) for n in range((1 << 18) + 1)})


def test_warm_steps_fit_the_engine():
    steps = warm_steps(4, max_num_tokens=64, max_model_len=1000, max_num_reqs=8, decode_query_lens=(1, 3))
    assert steps and len(set(steps)) == len(steps)
    for s in steps:
        reqs = s.num_decodes + (s.prefill_rows > 0)
        assert 1 <= reqs <= 8 and s.num_decodes * s.decode_query_len + s.prefill_rows <= 64
        assert max(s.prefill_rows, s.decode_query_len) <= s.max_seq_len <= 1000
    assert {s.decode_query_len for s in steps if s.num_decodes} == {1, 3}
    assert {column_bucket(s.max_seq_len // 4) for s in steps} == set(column_buckets(1000, 4))
    kinds = {(s.num_decodes > 0, s.prefill_rows > 0) for s in steps}
    assert kinds == {(True, False), (False, True), (True, True)}


def _planner(backend: str, **kw) -> tuple[QSAPlanner, list]:
    cfg = QSAConfig(**CFG)
    layout = QSACacheLayout(num_layers=2, page_size=16, num_pages=8, ring_rows=4, num_speculative_tokens=1)
    planner = QSAPlanner(cfg, dtype=torch.float32, page_size=16, ring_capacity=layout.ring_capacity(cfg),
                         max_num_tokens=12, max_model_len=160, max_num_reqs=4, backend=backend,
                         num_slots=layout.num_slots, num_ring_rows=4, **kw)
    return planner, layout.allocate(cfg, torch.float32)


def test_reference_backend_warms_nothing():
    planner, caches = _planner("reference")
    assert planner.warm(caches, decode_query_lens=(1, 2)) == []
    assert planner._schedules == {}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the triton backend on the CPU needs the interpreter")
def test_warm_binds_every_step_and_writes_nothing(monkeypatch):
    from qsa_kernels import launch

    planner, caches = _planner("triton")
    for c in caches:
        for t in (c.k, c.compressed, c.ring, c.ring_positions):
            t.fill_(7)
    before = [[t.clone() for t in (c.k, c.v, c.compressed, c.ring, c.ring_positions)] for c in caches]
    bound: list[str] = []
    bind = launch.Launcher.bind

    def counting(self, *args, **kwargs):
        bound.append(self.fn.__name__)
        return bind(self, *args, **kwargs)

    monkeypatch.setattr(launch.Launcher, "bind", counting)
    kept = dict(planner._schedules)
    steps = planner.warm(caches, decode_query_lens=(1, 2), static=True)
    assert steps == warm_steps(4, max_num_tokens=12, max_model_len=160, max_num_reqs=4, decode_query_lens=(1, 2))
    # both layers share one layout: one cache is bound per step (prepare, select, attention)
    assert bound.count("_prepare_kernel") == len(steps)
    assert bound.count("_metadata_kernel") >= 1 and bound.count("_attn_kernel") == len(steps)
    assert {"_stage_kernel", "_topk_row_kernel", "_scores_decode_kernel", "_scores_prefill_kernel"} <= set(bound)
    assert planner._schedules == kept
    assert int(planner.guard.item()) == 0  # every warm step was well formed
    for c, old in zip(caches, before):
        for t, o in zip((c.k, c.v, c.compressed, c.ring, c.ring_positions), old):
            assert torch.equal(t, o)


def test_start_up_warm_compiles_nothing_where_nothing_compiles(monkeypatch):
    """Engines call `start_up_warm`: on the reference backend, and in the interpreter (a
    planner made under TRITON_INTERPRET=1: the CPU engine suites), it plans nothing and
    returns no line to log."""
    from qsa_core.warmup import start_up_warm

    planner, caches = _planner("reference")
    assert start_up_warm(planner, caches, decode_query_lens=(1, 2)) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    planner, caches = _planner("triton")
    called = []
    monkeypatch.setattr(planner, "warm", lambda *a, **k: called.append(1) or [])
    assert start_up_warm(planner, caches, decode_query_lens=(1, 2)) is None and not called
    # the compiled path (the planner's options say no interpreter): warm runs, static, lengths deduped
    no_interpreter = dataclasses.replace(planner.options.kernel, interpreter=False)
    monkeypatch.setattr(planner, "options", dataclasses.replace(planner.options, kernel=no_interpreter))
    monkeypatch.setattr(planner, "warm", lambda c, **k: called.append(k) or [None] * 3)
    line = start_up_warm(planner, caches, decode_query_lens=(2, 1, 2))
    assert called == [dict(decode_query_lens=(1, 2), static=True)]
    assert line.startswith("QSA: warmed 0 kernel variants over 3 step shapes in ") and line.endswith(" s")
