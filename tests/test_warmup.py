"""`QSAPlanner.warm`: the start-up warm-up binds every launch of every step shape `warm_steps`
lists with compiling deferred, compiles each distinct variant once (`launch.compile_bindings`,
through Triton's AsyncCompileMode), writes no cache, trips no guard and leaves the planner's
schedules as they were; on the reference backend it does nothing. (Compiling what it binds for
sm_90: tests/kernels/test_compile_sm90.py, which records the same `warm` call; that random
steps and their calls need nothing it missed: tests/kernels/test_warmup_complete.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton.language as tl

from qsa_core import QSAConfig
from qsa_core.cache import QSACacheLayout
from qsa_core.planner import QSAPlanner, column_bucket
from qsa_core.warmup import column_buckets, row_counts, warm_block_table, warm_steps

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


@pytest.mark.parametrize("sizes", [
    dict(max_num_tokens=64, max_model_len=1000, max_num_reqs=8, decode_query_lens=(1, 3)),
    # a typical SGLang eager planner: 128K context, 8192 rows, 32 request slots, MTP of 3 drafts
    dict(max_num_tokens=8192, max_model_len=131072, max_num_reqs=32, decode_query_lens=(1, 4)),
    dict(max_num_tokens=12, max_model_len=160, max_num_reqs=None, decode_query_lens=(2,)),
])
def test_warm_steps_without_mixed_drop_exactly_the_mixed_shapes(sizes):
    """mixed=False (SGLang: its steps are decode-only or prefill-only) is the default list, in
    its order, without the shapes of decodes and a prefill together, and there were some."""
    both = warm_steps(4, **sizes)
    apart = warm_steps(4, mixed=False, **sizes)
    mixed = [s for s in both if s.num_decodes > 0 and s.prefill_rows > 0]
    assert mixed and apart == [s for s in both if not (s.num_decodes > 0 and s.prefill_rows > 0)]
    assert len(apart) == len(both) - len(mixed)
    assert {(s.num_decodes > 0, s.prefill_rows > 0) for s in apart} == {(True, False), (False, True)}


@pytest.mark.interpreter  # the triton backend on the CPU
def test_planner_warm_passes_mixed_to_warm_steps(monkeypatch):
    from qsa_core import warmup

    planner, caches = _planner("triton")
    seen = []
    monkeypatch.setattr(warmup, "warm_steps", lambda *a, **k: seen.append(k["mixed"]) or [])
    monkeypatch.setattr("qsa_kernels.launch.compile_bindings", lambda b, workers: 0)
    assert planner.warm(caches, decode_query_lens=(1, 2), static=True) == []
    assert planner.warm(caches, decode_query_lens=(1, 2), static=True, mixed=False) == []
    assert seen == [True, False]


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


@pytest.mark.interpreter  # the triton backend on the CPU
def test_warm_binds_every_step_compiles_each_variant_once_and_writes_nothing(monkeypatch):
    from qsa_core.layer import QSANormWeights, bind_layer
    from qsa_core.warmup import step_inputs
    from qsa_kernels import launch

    planner, caches = _planner("triton")
    for c in caches:
        for t in (c.k, c.compressed, c.ring, c.ring_positions):
            t.fill_(7)
    before = [[t.clone() for t in (c.k, c.v, c.compressed, c.ring, c.ring_positions)] for c in caches]
    bound: list[str] = []
    keys: list[tuple] = []  # binding_key of every deferred bind
    compiled: list[tuple] = []
    bind = launch.Launcher.bind

    def counting(self, grid, *args, **kwargs):
        bound.append(self.fn.__name__)
        if launch._DEFERRED:  # inside `deferred_binds`
            params, launcher_args = self.signature.parameters, ("free", "checked", "options")
            call = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
            call.apply_defaults()
            keys.append(launch.binding_key(self, list(call.arguments.values()), {
                k: v for k, v in kwargs.items() if k not in params and k not in launcher_args}))
        return bind(self, grid, *args, **kwargs)

    monkeypatch.setattr(launch.Launcher, "bind", counting)
    monkeypatch.setattr(launch, "compile_bindings", lambda b, workers: compiled.append((list(b), workers)) or len(b))
    kept = dict(planner._schedules)
    steps = planner.warm(caches, decode_query_lens=(1, 2), static=True, workers=3)
    assert steps == warm_steps(4, max_num_tokens=12, max_model_len=160, max_num_reqs=4, decode_query_lens=(1, 2))
    # both layers share one layout: one cache is bound per step (prepare, select, attention)
    assert bound.count("_prepare_kernel") == len(steps)
    assert bound.count("_metadata_kernel") >= 1 and bound.count("_attn_kernel") == len(steps)
    assert {"_stage_kernel", "_topk_row_kernel", "_scores_decode_kernel", "_scores_prefill_kernel"} <= set(bound)
    # every layer bind deferred; one compile call with one binding per distinct key, of many more binds
    assert len(keys) == len(bound) - bound.count("_metadata_kernel") - bound.count("_stage_kernel")
    assert len(compiled) == 1 and compiled[0][1] == 3
    bindings = compiled[0][0]
    assert len(keys) > 3 * len(bindings) and len(bindings) == len(set(keys))
    assert {launch.binding_key(b[0], b[2], b[3]) for b in bindings} == set(keys)
    assert planner._schedules == kept
    assert int(planner.guard.item()) == 0  # every warm step was well formed
    for c, old in zip(caches, before):
        for t, o in zip((c.k, c.v, c.compressed, c.ring, c.ring_positions), old):
            assert torch.equal(t, o)
    # the engine's plans after warm bind launchable launches (warm's deferred ones were dropped)
    plan = planner.plan(step_inputs(steps[-1], torch.zeros(4, 10, dtype=torch.int32)), static=True)
    cfg, n = planner.config, plan.num_tokens
    norms = QSANormWeights(*(torch.zeros(d) for d in (cfg.index_head_dim, cfg.index_head_dim, cfg.head_dim,
                                                      cfg.head_dim)))
    proj = [torch.zeros(n, w) for w in ((cfg.index_n_heads + 1) * cfg.index_head_dim, 2 * cfg.num_heads * cfg.head_dim,
                                        cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)]
    bind_layer(plan, norms, *proj, caches[0])
    kinds = _launch_kinds(plan.launches(caches[0]), launch)
    assert kinds == {"BoundLaunch"}, kinds


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
    assert called == [dict(decode_query_lens=(1, 2), static=True, block_table_strides=(), mixed=True)]
    assert line.startswith("QSA: warmed 0 kernel variants over 3 step shapes in ") and line.endswith(" s")
    start_up_warm(planner, caches, decode_query_lens=(1,), static=False, block_table_strides=(1, 16, 17), mixed=False)
    assert called[1] == dict(decode_query_lens=(1,), static=False, block_table_strides=(1, 16, 17), mixed=False)


def test_warm_block_table_specializes_as_the_engines_row_stride():
    from qsa_kernels.launch import spec_key

    for stride in (1, 0, 16, 128, 131, 3, 4096, 4099):
        pages = 1 if stride == 1 else 5
        t = warm_block_table(7, pages, stride, torch.device("cpu"))
        assert t.shape == (7, pages) and t.dtype == torch.int32 and t.stride(1) == 1
        assert spec_key(t.stride(0)) == spec_key(stride) and int(t.abs().sum()) == 0
        assert t.untyped_storage().nbytes() <= 4 * (6 * 3 + pages)  # rows overlap: no rows x stride table


def _jit_rows(x_ptr, n, BLOCK: tl.constexpr):
    pass


def test_deferred_binds_collect_each_variant_once_and_launch_nothing():
    from triton.runtime.jit import JITFunction

    from qsa_kernels import launch

    launcher = launch.Launcher(JITFunction(_jit_rows))
    x = torch.zeros(64)
    found: dict = {}
    with launch.deferred_binds(found):
        a = launcher.bind((1,), x, 32, BLOCK=16)
        launcher.bind((4,), x, 48, BLOCK=16)  # same variant: a grid and another multiple of 16
        launcher.bind((1,), x[1:], 32, BLOCK=16)  # unaligned pointer
        launcher.bind((1,), x, 1, BLOCK=16)  # n == 1
        launcher.bind((1,), x, 32, BLOCK=32)  # another constexpr
        launcher.bind((1,), x, 32, BLOCK=16, num_warps=8)  # another launch option
    assert not launch._DEFERRED and len(found) == 5  # left: binds build launches again
    assert all(entry[0] is launcher for entry in found.values())
    with pytest.raises(RuntimeError, match="_jit_rows: bound under deferred_binds"):
        a(x)
    with pytest.raises(ValueError), launch.deferred_binds({}):
        raise ValueError("inside")
    assert not launch._DEFERRED  # left on the way out of an error too


@pytest.mark.parametrize("workers", [1, 3])
def test_compile_bindings_compiles_each_native_binding_through_async_compile(workers, monkeypatch):
    """Each binding of a JITFunction is compiled once with its own values and options (the
    call `Launcher.bind` makes: `run(..., warmup=True)`), inside Triton's AsyncCompileMode
    with more than one worker; the interpreter's functions compile nothing."""
    import triton
    from triton.runtime import _async_compile
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from qsa_kernels import launch

    fn = JITFunction(_jit_rows)
    runs = []
    monkeypatch.setattr(fn, "run", lambda *args, grid, warmup, **kw: runs.append(
        (args, grid, warmup, kw, _async_compile.active_mode.get())))
    x = torch.zeros(8)
    bindings = [(launch.Launcher(fn), (1,), [x, 16, 8], {"num_warps": 4}),
                (launch.Launcher(fn), (2,), [x, 1, 8], {}),
                (launch.Launcher(InterpretedFunction(_jit_rows)), (1,), [x, 16, 8], {})]  # nothing to compile
    assert launch.compile_bindings(bindings, workers) == 2
    assert [(r[0], r[1], r[2], r[3]) for r in runs] == [((x, 16, 8), (1,), True, {"num_warps": 4}),
                                                        ((x, 1, 8), (2,), True, {})]
    modes = {type(r[4]).__name__ for r in runs}
    if workers > 1 and hasattr(triton, "AsyncCompileMode"):
        assert modes == {"AsyncCompileMode"}
    else:
        assert modes == {"NoneType"}


def _launch_kinds(obj, launch, depth: int = 6) -> set[str]:
    """The class names of the bound launches reachable from obj's attributes (lists, tuples, dicts)."""
    if isinstance(obj, (launch.BoundLaunch, launch._Deferred)):
        return {type(obj).__name__}
    if depth == 0 or isinstance(obj, (torch.Tensor, str, int, float, type(None))):
        return set()
    items = (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple))
             else vars(obj).values() if hasattr(obj, "__dict__") else ())
    return set().union(*(_launch_kinds(x, launch, depth - 1) for x in items)) if items else set()
