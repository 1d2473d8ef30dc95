"""The thin launcher: Triton's specialization respected, the same arguments as Triton's own
launch, a rebind where the specialization changes, results equal to the ordinary launch."""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from qsa_kernels import launch  # noqa: E402
from qsa_kernels.launch import Launcher, spec_key  # noqa: E402
from qsa_kernels.options import KernelOptions  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA_BACKEND = make_backend(GPUTarget("cuda", 90, 32))


def _scale_rows(x_ptr, out_ptr, stride_x, n, scale, BLOCK: tl.constexpr):
    """out[i, :n] = x[i, :n] * scale (one program per row)."""
    i = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i * stride_x + c, mask=c < n, other=0.0)
    tl.store(out_ptr + i * BLOCK + c, x * scale, mask=c < n)


def _values():
    """Runtime argument values whose Triton specializations differ in every way there is."""
    base = torch.zeros(64, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1,
            1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    tensors = [base, base[1:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
               base.to(torch.int64), base.to(torch.int8)[1:], base.to(torch.int8)[16:]]
    return ints + tensors + [0.5, 1.0, True, False, None]


@pytest.mark.parametrize("specialize,align", [(True, True), (False, True), (True, False)])
def test_spec_key_equal_exactly_where_triton_specializes_equally(specialize, align):
    values = _values()
    triton_spec = [native_specialize_impl(type(CUDA_BACKEND), x, False, specialize, align) for x in values]
    ours = [spec_key(x, specialize, align) for x in values]
    for i in range(len(values)):
        for j in range(len(values)):
            assert (ours[i] == ours[j]) == (triton_spec[i] == triton_spec[j]), (values[i], values[j])


class FakeCompiled:
    """A compiled kernel's launch surface (`run`, `function`, `packed_metadata`), recording calls."""

    def __init__(self, tag: int, calls: list) -> None:
        self.function, self.packed_metadata, self.calls, self.tag = f"fn{tag}", f"meta{tag}", calls, tag

    @property
    def run(self):
        return lambda *a: self.calls.append((self.tag, a))


@pytest.fixture
def fake_device(monkeypatch):
    """A native JITFunction with Triton's compile replaced by FakeCompiled kernels (CPU tensors)."""
    calls, compiled = [], []

    def compile_(self, grid, values, options):
        compiled.append(list(values))
        return FakeCompiled(len(compiled), calls)

    monkeypatch.setattr(Launcher, "compiled", compile_)
    monkeypatch.setattr(launch, "RUNTIME", replace(  # the CPU tensors' device -1, its stream 999
        launch.RUNTIME, device=lambda: -1, stream_fn=lambda: (lambda device: 1000 + device)))
    fn = JITFunction(_scale_rows, do_not_specialize=["n"])
    return Launcher(fn), fn, calls, compiled


def test_bound_launch_passes_what_triton_passes(fake_device):
    """The fast path hands the compiled kernel's run the grid, the current stream and the
    argument list Triton's own binder makes for the same call (constexprs included), with
    every tensor as its raw pointer."""
    launcher, fn, calls, compiled = fake_device
    x, out = torch.randn(4, 48), torch.empty(4, 32)
    bound = launcher.bind((4,), x, out, 48, 32, 2.0, free=("x_ptr", "n"), BLOCK=32, num_warps=2)
    assert len(compiled) == 1 and not calls
    y = torch.randn(4, 48)
    bound(y, 20)
    binder = create_function_from_signature(fn.signature, fn.params, CUDA_BACKEND)
    want = list(binder(y, out, 48, 20, 2.0, BLOCK=32)[0].values())
    (tag, got), = calls
    assert tag == 1 and got[:9] == (4, 1, 1, 999, "fn1", "meta1", None, None, None)
    want = [w.data_ptr() if isinstance(w, torch.Tensor) else w for w in want]
    assert list(got[9:]) == want


def test_a_specialization_change_rebinds_and_a_repeated_one_reuses(fake_device):
    launcher, fn, calls, compiled = fake_device
    x, out = torch.randn(4, 64), torch.empty(4, 32)
    bound = launcher.bind((4,), x, out, 64, 32, 2.0, free=("x_ptr", "stride_x", "n"), BLOCK=32)
    bound(x, 64, 17)  # n is do_not_specialize: its value never changes the kernel
    bound(x, 64, 1)
    assert len(compiled) == 1 and [t for t, _ in calls] == [1, 1]
    bound(x[:, 1:], 64, 32)  # a 4-byte offset: no 16-byte alignment
    assert len(compiled) == 2 and calls[-1][0] == 2 and compiled[-1][0].data_ptr() == x[:, 1:].data_ptr()
    bound(x, 1, 32)  # stride 1: Triton makes it a constexpr
    bound(x, 17, 32)  # stride not divisible by 16
    bound(x, 1 << 33, 32)  # stride past i32
    assert len(compiled) == 5 and [t for t, _ in calls[-3:]] == [3, 4, 5]
    bound(x, 48, 5)  # back to the bound key: the first kernel, no new compile
    bound(x[:, 1:], 64, 3)
    assert len(compiled) == 5 and [t for t, _ in calls[-2:]] == [1, 2]
    bound(x.to(torch.bfloat16), 64, 3)  # another dtype
    assert len(compiled) == 6


def test_disabled_or_hooked_launches_take_the_ordinary_path(fake_device, monkeypatch):
    launcher, fn, calls, compiled = fake_device
    ordinary = []
    monkeypatch.setattr(Launcher, "ordinary", lambda self, grid, values, options: ordinary.append(values))
    x, out = torch.randn(4, 64), torch.empty(4, 32)
    launcher.bind((4,), x, out, 64, 32, 2.0, free=("n",), options=KernelOptions(fast_launch=False), BLOCK=32)(7)
    bound = launcher.bind((4,), x, out, 64, 32, 2.0, free=("n",), BLOCK=32)
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        bound(8)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    bound(9)
    assert [v[3] for v in ordinary] == [7, 8] and [a[9 + 3] for _, a in calls] == [9]


def test_a_binding_keeps_no_free_argument_alive(fake_device):
    """The binding call's free tensors (an engine's activations) die with the caller's
    references; the fixed ones are held by the binding, which still launches."""
    launcher, fn, calls, compiled = fake_device
    x, out = torch.randn(4, 64), torch.empty(4, 32)
    bound = launcher.bind((4,), x, out, 64, 32, 2.0, free=("x_ptr",), BLOCK=32)
    bound(x)
    compiled.clear()  # the fake compiler's own record of the values
    refs = weakref.ref(x), weakref.ref(out)
    del x, out
    gc.collect()
    assert refs[0]() is None and refs[1]() is not None
    y = torch.randn(4, 64)
    bound(y)
    assert calls[-1][1][9] == y.data_ptr() and calls[-1][1][10] == refs[1]().data_ptr()


def _dropped_frees_without_the_collector(make_binding) -> None:
    """A binding (and the fixed tensors only it holds) dies with its owner's last reference,
    with Python's cycle collector off: no reference cycle keeps a dropped plan's caches and
    workspace (GPU memory) alive until the collector happens to run."""
    gc.collect()
    gc.disable()
    try:
        bound, fixed = make_binding()
        refs = weakref.ref(bound), weakref.ref(fixed)
        del bound, fixed
        assert refs[0]() is None and refs[1]() is None
    finally:
        gc.enable()


def test_a_dropped_binding_frees_its_fixed_arguments_at_once(fake_device):
    launcher = fake_device[0]

    def make():
        x, out = torch.randn(4, 64), torch.empty(4, 32)
        bound = launcher.bind((4,), x, out, 64, 32, 2.0, free=("x_ptr",), BLOCK=32)
        bound(x)
        bound(x[:, 1:])  # another key: the slow path's variant too
        fake_device[2].clear()  # the fake kernel's and compiler's own records of the values
        fake_device[3].clear()
        return bound, out

    _dropped_frees_without_the_collector(make)


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
def test_a_dropped_binding_of_a_real_kernel_frees_its_fixed_arguments_at_once():
    def make():
        x = torch.randn(4, 64, device=_device())
        out = torch.empty(4, 32, device=_device())
        bound = Launcher(scale_rows).bind((4,), x, out, 64, 32, 2.0, free=("x_ptr",), BLOCK=32)
        bound(x)
        return bound, out

    _dropped_frees_without_the_collector(make)


def test_free_arguments_must_be_runtime_parameters(fake_device):
    launcher = fake_device[0]
    x, out = torch.randn(4, 64), torch.empty(4, 32)
    with pytest.raises(ValueError, match="'BLOCK' must be a runtime parameter"):
        launcher.bind((4,), x, out, 64, 32, 2.0, free=("BLOCK",), BLOCK=32)
    with pytest.raises(ValueError, match="'nope' must be a runtime parameter"):
        launcher.bind((4,), x, out, 64, 32, 2.0, free=("nope",), BLOCK=32)


def _with_defaults(x_ptr, n, scale=2.0, BLOCK: tl.constexpr = 32):
    """A kernel signature with defaults (never launched)."""
    tl.store(x_ptr + tl.arange(0, BLOCK), scale, mask=tl.arange(0, BLOCK) < n)


@pytest.mark.parametrize("args,kwargs", [((1, 2), {}), ((1,), {"n": 2}), ((1, 2, 3.0), {"BLOCK": 64}),
                                         ((), {"BLOCK": 16, "n": 5, "x_ptr": 7, "scale": 0.5})])
def test_arguments_are_what_the_signature_binds(args, kwargs):
    """`Launcher.arguments` (a binding's parameter values in order) equals Python's own binding
    of the kernel's signature with defaults applied; a missing, unknown or doubled argument
    raises naming it."""
    import inspect

    launcher = Launcher(triton.jit(_with_defaults))
    call = inspect.signature(_with_defaults).bind(*args, **kwargs)
    call.apply_defaults()
    assert launcher.arguments(args, kwargs) == list(call.arguments.values())
    with pytest.raises(TypeError, match="missing argument 'n'"):
        launcher.arguments((1,), {})
    with pytest.raises(TypeError, match="no parameter 'stride'"):
        launcher.arguments((1, 2), {"stride": 3})
    with pytest.raises(TypeError, match="multiple values for argument 'x_ptr'"):
        launcher.arguments((1, 2), {"x_ptr": 3})
    with pytest.raises(TypeError, match="5 positional arguments, the kernel takes 4"):
        launcher.arguments((1, 2, 3, 4, 5), {})


def test_checked_arguments_skip_dtype_and_device_but_not_alignment(fake_device):
    """A `checked` free tensor (its dtype and device validated by the caller, as a planner
    does for an engine's step tensors) is checked only for its 16-byte alignment."""
    launcher = fake_device[0]
    calls, compiled = fake_device[2], fake_device[3]
    x, out = torch.randn(4, 64), torch.empty(4, 32)
    bound = launcher.bind((4,), x, out, 64, 32, 2.0, free=("x_ptr",), checked=("x_ptr",), BLOCK=32)
    bound(x[:, 1:])  # a 4-byte offset: still another specialization
    assert len(compiled) == 2 and calls[-1][0] == 2
    bound(torch.randn(4, 64))
    assert len(compiled) == 2 and calls[-1][0] == 1
    with pytest.raises(ValueError, match="checked argument 'out_ptr' must be a free argument"):
        launcher.bind((4,), x, out, 64, 32, 2.0, free=("x_ptr",), checked=("out_ptr",), BLOCK=32)


scale_rows = triton.jit(_scale_rows, do_not_specialize=["n"])


def _device() -> str:
    return "cpu" if INTERPRET else "cuda"


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
def test_bound_launch_results_equal_the_ordinary_launch():
    """Interpreter: the ordinary path with the free args substituted; GPU: the fast path,
    across rebinds (misaligned rows, stride 1) and back."""
    dev = _device()
    x = torch.randn(6, 80, device=dev)
    out = torch.zeros(6, 64, device=dev)
    want = torch.zeros(6, 64, device=dev)
    bound = Launcher(scale_rows).bind((6,), x, out, 80, 64, 3.0, free=("x_ptr", "stride_x", "n"), BLOCK=64)
    for src, n in ((x, 64), (x[:, 3:], 50), (x.reshape(-1)[:6].view(6, 1), 1), (x, 7)):
        out.zero_(), want.zero_()
        bound(src, src.stride(0), n)
        scale_rows[(6,)](src, want, src.stride(0), n, 3.0, BLOCK=64)
        assert torch.equal(out, want)
        assert torch.equal(out[:, :n], src[:, :n] * 3.0)


@pytest.mark.gpu
def test_bound_launches_replay_in_a_cuda_graph_gpu():
    x = torch.randn(6, 80, device="cuda")
    out = torch.zeros(6, 64, device="cuda")
    bound = Launcher(scale_rows).bind((6,), x, out, 80, 64, 3.0, free=("n",), BLOCK=64)
    bound(64)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bound(64)
    out.zero_()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x[:, :64] * 3.0)


@pytest.mark.gpu
def test_a_layer_on_bound_launches_equals_the_ordinary_launches_gpu():
    """Plans and layers (metadata, prepare, expand bound; a second shape; a new cache object)
    give bitwise the same outputs and caches with the launcher on and off."""
    from qsa_core import QSAAttention, QSACacheLayout, QSAConfig, QSAOptions, QSAPlanner, QSAStepInputs

    config = QSAConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, index_n_heads=2,
                       index_head_dim=64, token_topk=64, compress_ratio=4, rotary_dim=32, rope_theta=1e4)
    page, dev = 16, "cuda"

    def run(fast: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = QSAAttention(config).to(dev, torch.bfloat16)
        for p in layer.parameters():
            p.data.normal_(0, 0.05 if p.dim() == 2 else 0.3)
        layout = QSACacheLayout(num_layers=2, page_size=page, num_pages=40, ring_rows=4)
        caches = layout.allocate(config, torch.bfloat16, dev)
        planner = QSAPlanner(config, dtype=torch.bfloat16, page_size=page,
                             ring_capacity=layout.ring_capacity(config), max_num_tokens=64, max_model_len=256,
                             device=dev, options=QSAOptions(kernel=KernelOptions(fast_launch=fast)))
        outs = []
        for qlens, ctx in (([40, 9], [0, 0]), ([1, 1], [40, 9]), ([1, 1], [41, 10]), ([5, 3], [42, 11])):
            seq = [c + q for c, q in zip(ctx, qlens)]
            qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32, device=dev)
            table = torch.arange(20, dtype=torch.int32, device=dev).view(2, 10) + 1
            pos = torch.cat([torch.arange(c, s) for c, s in zip(ctx, seq)]).to(dev)
            req = torch.repeat_interleave(torch.arange(2, device=dev), torch.tensor(qlens, device=dev))
            slots = table[req, pos // page].long() * page + pos % page
            inputs = QSAStepInputs(
                query_start_loc=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev), block_table=table,
                slot_mapping=slots, ring_index=torch.tensor([0, 2], dtype=torch.int32, device=dev),
                num_decodes=2 if qlens == [1, 1] else 0, max_query_len=max(qlens), max_seq_len=max(seq),
            )
            plan = planner.plan(inputs)
            hidden = torch.randn(sum(qlens), config.hidden_size, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                for cache in caches:
                    outs.append(layer(hidden, plan, cache).clone())
                    outs.append(plan.schedule.selection.clone())
        return outs + [t for c in caches for t in (c.k, c.v, c.compressed, c.ring)]

    fast, ordinary = run(True), run(False)
    assert len(fast) == len(ordinary)
    for a, b in zip(fast, ordinary):
        assert torch.equal(a, b)


def test_the_runtime_view_is_gated_on_the_triton_version():
    """Only the Triton versions the fast path was written against get its view of Triton's
    internals (others launch the ordinary way)."""
    for version in ("3.6.0", "3.7.1", "3.8.0", "3.9.0+git1a2b"):
        rt = launch.triton_runtime(version)
        assert rt is not None and rt.version == tuple(int(x) for x in version.split(".")[:2])
        assert rt.jit_type is JITFunction
    for version in ("3.5.1", "3.10.0", "4.0.0", "dev"):
        assert launch.triton_runtime(version) is None


def test_an_unknown_triton_launches_the_ordinary_way(fake_device, monkeypatch):
    launcher, fn, calls, compiled = fake_device
    ordinary = []
    monkeypatch.setattr(Launcher, "ordinary", lambda self, grid, values, options: ordinary.append(values))
    monkeypatch.setattr(launch, "RUNTIME", None)
    x, out = torch.randn(4, 64), torch.empty(4, 32)
    bound = launcher.bind((4,), x, out, 64, 32, 2.0, free=("n",), BLOCK=32)
    bound(7)
    assert not bound.native and not compiled and not calls and [v[3] for v in ordinary] == [7]
