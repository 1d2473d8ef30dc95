"""The hot path reads nothing back: `QSAPlanner.plan` on the GPU's default path (value checks
off, `QSA_DEBUG` unset) reads only the host copy the engine hands it (`seq_lens_cpu`), and a
layer's forward on a plan (the Triton backend: prepare, select and attention launches) reads
no tensor value into Python at all, on the first call of a layer (which binds its launches)
and on every later one.

On a GPU that is `torch.cuda.set_sync_debug_mode("error")`. On the CPU `no_host_read` stands
in for it: a `TorchFunctionMode` refuses the Python-level reads (`item`, `tolist`, `numpy`,
`__array__`, `__bool__` / `__int__` / `__float__` / `__index__` / `__complex__`, `repr` /
`format`, `.cpu()`, `.to(cpu)`, `torch.tensor` of a sequence holding tensors) and a
`TorchDispatchMode` the aten ops that read values or size their output by them, whoever calls
them (`_local_scalar_dense`, behind every scalar conversion, also C++'s, e.g. `x[:t]`;
`nonzero`, `unique`, `masked_select`, `equal`, `allclose`, `is_nonzero`, `bincount`,
`repeat_interleave` without output_size, indexing by a boolean mask). Allowed: reads of the
declared host copies and of what is computed from them alone, and reads that the Triton
interpreter makes itself (the innermost caller outside torch lives in the triton package).
Not seen: a device-to-host copy that names no CPU device (`copy_` into a host buffer: between
CPU tensors it is an ordinary copy), host-to-device uploads (a sync from pageable memory on a
GPU), raw memory reads through `data_ptr`, and a read that product code routes through a
triton function.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import pytest
import torch
import triton
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_oracle import tiny_config
from qsa_core import QSAAttention, QSACacheLayout, QSAConfig, QSAPlanner, QSAStepInputs

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRITON_DIR = os.path.dirname(triton.__file__) + os.sep
aten = torch.ops.aten

# Python-level reads, refused by name (tolist, numpy, repr, cpu and to reach no aten op at all).
_FUNCTION_READS = {"item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__",
                   "__complex__", "__repr__", "__format__", "cpu"}
_FACTORIES = {"tensor", "as_tensor", "asarray"}  # a read when their data holds tensors
# aten ops that read values to the host or size their output by them (a sync on a GPU).
_DISPATCH_READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
                   aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive, aten.equal,
                   aten.allclose, aten.is_nonzero, aten.bincount}
_REPEATS_TENSOR = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostRead(AssertionError):
    """A tensor value was read into Python on the hot path."""


def _tensors(*trees: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(trees)[0] if isinstance(x, torch.Tensor)]


def _caller() -> FrameType | None:
    """The innermost frame outside torch and this file: the code that asked for the read."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame


class _Guard:
    """Which tensors may be read (host copies and values computed from them alone)."""

    def __init__(self, host: Sequence[torch.Tensor]) -> None:
        self.host = {id(t): t for t in host}  # held: no id is reused while the guard lives

    def is_host(self, tensors: list[torch.Tensor]) -> bool:
        return bool(tensors) and all(id(t) in self.host for t in tensors)

    def taint(self, inputs: list[torch.Tensor], out: Any) -> None:
        """A value computed from host copies alone is one too."""
        if self.is_host(inputs):
            self.host.update((id(t), t) for t in _tensors(out))

    def check(self, what: str, tensors: list[torch.Tensor]) -> None:
        if self.is_host(tensors):
            return
        frame = _caller()
        if frame is not None and frame.f_code.co_filename.startswith(_TRITON_DIR):
            return  # the interpreter copying kernel arguments
        where = "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        raise HostRead(f"host read on the hot path: {what} at {where}")


class _FunctionReads(TorchFunctionMode):
    def __init__(self, guard: _Guard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(args, kwargs)
        if name in _FUNCTION_READS or (name == "to" and _to_host(args[1:], kwargs)):
            self.guard.check(f"Tensor.{name}", inputs)
        elif name in _FACTORIES and args and not isinstance(args[0], torch.Tensor) and _tensors(args[0]):
            self.guard.check(f"torch.{name} of tensors", _tensors(args[0]))
        out = func(*args, **kwargs)
        self.guard.taint(inputs, out)
        return out


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` names the CPU (a device-to-host copy on a GPU)."""
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return device is not None and device.type == "cpu"


class _DispatchReads(TorchDispatchMode):
    def __init__(self, guard: _Guard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = func.overloadpacket
        inputs = _tensors(args, kwargs)
        if (op in _DISPATCH_READS
                or (func in _REPEATS_TENSOR and kwargs.get("output_size") is None)
                or (op in _MASK_INDEXED and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])))):
            self.guard.check(str(func), inputs)
        out = func(*args, **kwargs)
        self.guard.taint(inputs, out)
        return out


@contextlib.contextmanager
def no_host_read(host: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Raise `HostRead` on any read of a tensor value into Python but of `host` (declared
    host copies, and values computed from them alone) or by the Triton interpreter."""
    guard = _Guard(host)
    with _FunctionReads(guard), _DispatchReads(guard):
        yield


S = torch.tensor(3)
V = torch.tensor([3, 1, 2])
MASK = torch.tensor([True, False, True])
READS: dict[str, Callable[[], Any]] = {
    "item": lambda: S.item(), "int": lambda: int(S), "float": lambda: float(S), "bool": lambda: bool(S),
    "index": lambda: range(S), "if any": lambda: 1 if V.any() else 0, "slice bound": lambda: V[:S],
    "f-string": lambda: f"{S}", "repr": lambda: repr(V), "in": lambda: 3 in V, "tolist": lambda: V.tolist(),
    "numpy": lambda: V.numpy(), "cpu": lambda: V.cpu(), "to cpu": lambda: V.to("cpu"),
    "to device": lambda: V.to(device=torch.device("cpu"), dtype=torch.int64), "tensor of": lambda: torch.tensor([S, S]),
    "nonzero": lambda: V.nonzero(), "where": lambda: torch.where(MASK), "unique": lambda: V.unique(),
    "equal": lambda: torch.equal(V, V), "allclose": lambda: torch.allclose(V.float(), V.float()),
    "mask index": lambda: V[MASK], "mask store": lambda: V.clone().__setitem__(MASK, torch.tensor([0, 0])),
    "masked_select": lambda: V.masked_select(MASK), "repeat_interleave": lambda: V.repeat_interleave(V),
    "bincount": lambda: V.bincount(), "storage": lambda: V.untyped_storage()[0],
}


@pytest.mark.parametrize("read", list(READS))
def test_guard_refuses_each_read(read):
    with no_host_read(), pytest.raises(HostRead):
        READS[read]()


def test_guard_allows_host_copies_and_launch_only_work():
    """Reads of a declared host copy (and of values computed from it alone) and reads made by
    code of the triton package pass; the same read of a device tensor (its twin here) or of a
    mix of both does not; work that reads nothing passes."""
    host, device = V.clone(), V.clone()
    interpreter_read = compile("int(t.sum())", os.path.join(_TRITON_DIR, "runtime", "interpreter.py"), "eval")
    with no_host_read([host]):
        assert int(host.max()) == 3 and host.tolist() == [3, 1, 2]
        assert eval(interpreter_read, {"t": device}) == 6
        out = device.repeat_interleave(2, output_size=6) + device.new_zeros(6)
        assert out.shape == (6,) and V[torch.tensor([0, 2])].shape == (2,)
        with pytest.raises(HostRead):
            int(device.max())
        with pytest.raises(HostRead):
            int((host + device).max())


# Budget 32 tokens: Kb 8 groups, selection width 35, so decode steps split the attention in two.
CONFIG = QSAConfig.from_hf(tiny_config(indexer_budget=32))
PAGE, PAGES_PER_REQ, MAX_REQS, LAYERS, MAX_ROWS = 16, 32, 16, 2, 32
LAYOUT = QSACacheLayout(num_layers=LAYERS, page_size=PAGE, num_pages=MAX_REQS * PAGES_PER_REQ + 1,
                        ring_rows=MAX_REQS, num_speculative_tokens=1)


class Engine:
    """Layers on caches of random contents (every context is already there), and a planner on
    the GPU's default path: no value checks."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.layers = [QSAAttention(CONFIG) for _ in range(LAYERS)]
        with torch.no_grad():
            for layer in self.layers:
                for p in layer.parameters():
                    p.normal_(0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.3, generator=g)
        self.caches = LAYOUT.allocate(CONFIG, torch.float32)
        for cache in self.caches:
            for t in (cache.k, cache.v, cache.compressed, cache.ring):
                t.copy_(torch.randn(t.shape, generator=g))
        self.pages = (torch.randperm(MAX_REQS * PAGES_PER_REQ, generator=g) + 1).view(MAX_REQS, PAGES_PER_REQ)
        self.planner = QSAPlanner(
            CONFIG, dtype=torch.float32, page_size=PAGE, ring_capacity=LAYOUT.ring_capacity(CONFIG),
            max_num_tokens=MAX_ROWS, max_model_len=PAGE * PAGES_PER_REQ, max_num_reqs=MAX_REQS,
            num_slots=LAYOUT.num_slots, num_ring_rows=MAX_REQS, backend="triton", value_checks=False,
        )

    def inputs(self, requests: list[tuple[int, int]], num_decodes: int, decode_query_len: int = 1,
               num_padding_rows: int = 0) -> QSAStepInputs:
        """A step of (context, rows) per request, decodes first; a request of 0 rows is a
        CUDA-graph padding request."""
        qlens = [n for _, n in requests]
        seq = [c + n for c, n in requests]
        slots = [int(self.pages[i, p // PAGE]) * PAGE + p % PAGE for i, (c, n) in enumerate(requests)
                 for p in range(c, c + n)] + [-1] * num_padding_rows
        seq_lens = torch.tensor(seq, dtype=torch.int32)
        return QSAStepInputs(
            query_start_loc=torch.tensor([0] + qlens).cumsum(0).to(torch.int32), seq_lens=seq_lens,
            block_table=self.pages[: len(requests)].to(torch.int32), slot_mapping=torch.tensor(slots),
            ring_index=torch.arange(len(requests), dtype=torch.int32), num_decodes=num_decodes,
            decode_query_len=decode_query_len, max_query_len=max(qlens), max_seq_len=max(seq),
            num_padding_rows=num_padding_rows, seq_lens_cpu=seq_lens.clone(),
        )

    def step(self, inputs: QSAStepInputs, static: bool = False) -> torch.Tensor:
        """Plan (reading only the host copy) and run every layer on the plan (reading nothing)."""
        x = torch.randn(inputs.num_tokens, CONFIG.hidden_size)
        with torch.no_grad():
            with no_host_read([inputs.seq_lens_cpu]):
                plan = self.planner.plan(inputs, static=static)
            with no_host_read():
                for layer, cache in zip(self.layers, self.caches):
                    x = layer(x, plan, cache)
        return x


def routes(planner: QSAPlanner) -> set[str]:
    """The select routes and attention kinds (split-K or one pass) of the planner's schedules."""
    found = set()
    for s in planner._schedules.values():
        found.add("attention split" if s.attention.n_splits > 1 else "attention one pass")
        for sel in (s.select_decode, s.select_prefill):
            if sel is None:
                continue
            route = ("unscored" if not sel.scored else "prefill" if sel.prefill is not None
                     else "decode samples" if sel.decode_samples is not None
                     else "topk short" if sel.topk_tiles is not None else "radix fused" if sel.fused else "radix")
            found.add(("decode " if sel.decode else "prefill ") + route)
    return found


@pytest.fixture(autouse=True)
def default_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's default path: no QSA_DEBUG value checks, the default decode routes."""
    monkeypatch.delenv("QSA_DEBUG", raising=False)
    monkeypatch.delenv("QSA_DECODE_SAMPLES", raising=False)


# name: (requests as (context, rows), num_decodes, decode_query_len, the select routes planned)
STEPS = {
    "decode": ([(40, 1), (100, 1), (20, 1)], 3, 1, {"decode topk short", "attention split"}),
    "decode of short contexts": ([(20, 1), (9, 1)], 2, 1, {"decode unscored", "attention split"}),
    "long decode": ([(250, 1), (200, 1), (180, 1)], 3, 1, {"decode decode samples", "attention split"}),
    "MTP decode": ([(250, 2), (130, 2)], 2, 2, {"decode decode samples", "attention split"}),
    "mixed": ([(200, 1), (90, 1), (150, 8), (0, 7)], 2, 1,
              {"decode decode samples", "prefill prefill", "attention one pass"}),
    "prefill": ([(60, 6), (0, 9)], 0, 1, {"prefill radix fused", "attention one pass"}),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(STEPS))
def test_plan_and_layers_read_nothing(name):
    """Each step is planned reading only seq_lens_cpu, and both layers run on the plan
    reading nothing, over the select routes and attention kinds named."""
    requests, num_decodes, dq, want = STEPS[name]
    engine = Engine()
    out = engine.step(engine.inputs(requests, num_decodes, dq))
    assert routes(engine.planner) == want
    assert torch.isfinite(out).all()


@pytest.mark.interpreter
def test_repeated_decode_reads_nothing():
    """A later step of the same shape reuses the schedule and the bound launches: that path
    too reads nothing."""
    engine = Engine()
    for contexts in ((40, 100, 20), (41, 101, 21)):
        engine.step(engine.inputs([(c, 1) for c in contexts], 3))
    assert len(engine.planner._schedules) == 1


@pytest.mark.interpreter
def test_cuda_graph_step_reads_nothing():
    """plan(static=True) (copies into the planner's buffers, live rows bound on the device)
    with CUDA-graph padding: requests of no rows and trailing padding rows; twice, as replays
    of one graph would run it."""
    engine = Engine()
    for requests, padding in (([(130, 1), (250, 1), (1, 0), (1, 0)], 2), ([(131, 1), (251, 1), (90, 1), (1, 0)], 1)):
        out = engine.step(engine.inputs(requests, 4, num_padding_rows=padding), static=True)
        assert torch.isfinite(out).all()
    assert routes(engine.planner) == {"decode decode samples", "attention split"}


@pytest.mark.interpreter
def test_decode_routes_without_samples_read_nothing(monkeypatch):
    """With QSA_DECODE_SAMPLES=0 long decode chunks take the fused radix top-k (few rows and 16
    rows: past the short top-k's columns)."""
    monkeypatch.setenv("QSA_DECODE_SAMPLES", "0")
    engine = Engine()
    engine.step(engine.inputs([(250, 1), (200, 1)], 2))
    engine.step(engine.inputs([(100 + 9 * i, 1) for i in range(16)], 16))
    assert routes(engine.planner) == {"decode radix fused", "attention split", "attention one pass"}
