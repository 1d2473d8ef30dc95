"""A thin Triton launcher: bind a `@triton.jit` kernel once, relaunch it with the runtime args only.

`JITFunction.run` costs tens of microseconds of host time per launch: binding the arguments, the
specialization key, the compiled-kernel lookup, launch metadata and hooks, and in the
compiled launcher a `data_ptr()` call and a driver query per pointer. A QSA layer launches
the same kernels with the same workspace, caches and constexprs on every call, so a
`BoundLaunch` does that work once and then calls Triton's own compiled-kernel handle, the
`CompiledKernel.run` launcher that `JITFunction.run` ends with (triton 3.6 to 3.9), with the
grid, the current stream and the argument list, pointers as raw ints, in which only the
`free` arguments change. Calling the C launch under that launcher directly would save a little
more but reaches one more internal per Triton version: not taken (NOTES.md (Kernels)).

Specialization is respected: Triton compiles a different kernel when a tensor's dtype or
16-byte alignment, or an int's range (i32/i64/u64), its being 1 or its divisibility by 16
changes (the last two not for `do_not_specialize` ints). A bound launch checks that key for
its free arguments on every call (and their device) and, where it differs from the bound
one, fetches (once) the compiled kernel of the new key through the ordinary path; fixed
arguments must not change (bind anew). The fast path skips Triton's check that the kernel's
global variables are unchanged (ours are module constants) and runs only where no launch
hook (profiler) is installed; with a hook, for the interpreter's functions, or where the
binding's `KernelOptions.fast_launch` is off, every call is the ordinary `kernel[grid](...)`.

    _stage = Launcher(_stage_kernel)                         # once, at module level
    bound = _stage.bind(grid, *args, free=("qsl_ptr", ...), options=options, num_warps=4)
    bound(qsl, ...)                                           # per call: the free args, in order

Programmatic dependent launch (PDL, sm_90+): a kernel with a `PDL` constexpr starts with
`pdl_start(PDL)` and ends with `pdl_end(PDL)`; `bind` sets PDL to the mode `KernelOptions.pdl`
names and Triton's `launch_pdl` on a CUDA device of compute capability >= 9. Such
a launch may begin while the kernel before it in the stream still runs: its programs wait
(`griddepcontrol.wait`) until that kernel has finished and its writes are visible, before
touching memory. The next kernel may begin launching (`griddepcontrol.launch_dependents`)
once every program has signalled or exited: mode 1 signals right after the wait, so the next
grid's programs take SM slots while this one's last wave runs; mode 2 signals at the end of
each program, so only the launch latency overlaps; 0 is off. A CUDA graph keeps the overlap.

A binding is for the device current when it is made; it launches on that device's current
stream (a CUDA-graph capture records it). Fixed tensors are held alive by the binding; the
free arguments of the binding call are not (an engine's activations stay its own).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import triton
import triton.language as tl

from .options import DEFAULT, KernelOptions

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
# Triton versions whose internals `triton_runtime` was written against (3.6: torch 2.10-2.11's;
# 3.7: 2.12-2.13's; 3.8: 2.14's; 3.9: the newest a CPU install brings).
SUPPORTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))


@dataclass(frozen=True)
class TritonRuntime:
    """The Triton internals the fast path uses, nowhere else read (`triton_runtime`).

    jit_type: `JITFunction` (an interpreter's function is not one: it launches the ordinary
    way); device(): the current device; stream_fn(): the driver's function of a device to its
    current stream; launch_hooks: the object whose launch_enter_hook / launch_exit_hook are
    the installed hooks (a profiler's); compile(fn, grid, values, options):
    the compiled kernel of the arguments (Triton's cache, compiling if needed; async results
    resolved); handles(kernel): its (run, function, packed metadata); spec_flags(fn): per
    parameter name, (specialize ints, specialize alignment) as Triton's binder reads them (off
    for `do_not_specialize` / `do_not_specialize_on_alignment`)."""

    version: tuple[int, int]
    jit_type: type
    device: Callable[[], int]
    stream_fn: Callable[[], Callable[[int], int]]
    launch_hooks: Any
    compile: Callable[[Any, Sequence[int], list, dict], Any]
    handles: Callable[[Any], tuple[Any, Any, Any]]
    spec_flags: Callable[[Any], dict[str, tuple[bool, bool]]]


def triton_runtime(version: str = triton.__version__) -> TritonRuntime | None:
    """The fast path's view of Triton `version`, or None where it is not one of
    SUPPORTED_TRITON (every bound launch then takes the ordinary `kernel[grid](...)`).

    Common to 3.6-3.9: `JITFunction.run(*args, grid=, warmup=True, **options)` compiles (3.8+
    may return an async handle: `.result()`), a `CompiledKernel` holds `run` (the launcher:
    `run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook,
    exit_hook, *args)`), `function` and `packed_metadata`, and `triton.runtime.driver.active`
    gives the current device and stream."""
    try:
        key = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    if key not in SUPPORTED_TRITON:
        return None
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    def compile_(fn: Any, grid: Sequence[int], values: list, options: dict) -> Any:
        kernel = fn.run(*values, grid=grid, warmup=True, **options)
        return kernel.result() if hasattr(kernel, "result") else kernel

    return TritonRuntime(
        version=key, jit_type=JITFunction,
        device=lambda: driver.active.get_current_device(),
        stream_fn=lambda: driver.active.get_current_stream, launch_hooks=knobs.runtime,
        compile=compile_,
        handles=lambda kernel: (kernel.run, kernel.function, kernel.packed_metadata),
        spec_flags=lambda fn: {p.name: (not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                               for p in fn.params},
    )



def _fast() -> bool:
    """Whether no Triton launch enter/exit hook (a profiler's) is installed: the fast path's
    condition at every call."""
    hooks = RUNTIME.launch_hooks
    for hook in (hooks.launch_enter_hook, hooks.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: with PDL (1 or 2, a launch made with launch_pdl), wait for
    the previous kernel in the stream to finish and flush; with PDL 1, then let the next one
    launch."""
    if PDL > 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_end(PDL: tl.constexpr):
    """A kernel's last statement: with PDL 2, let the next kernel in the stream launch (a
    program that returns early signals by exiting)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


def _off() -> bool:
    """The fast path's condition where `KernelOptions.fast_launch` is off."""
    return False


def pdl_enabled(fn: Any, mode: int) -> bool:
    """Whether launches of fn (a `JITFunction`: not the interpreter's) use PDL: mode
    (`KernelOptions.pdl`) is not 0 and the current device is an NVIDIA GPU of compute
    capability >= 9."""
    return (mode > 0 and RUNTIME is not None and isinstance(fn, RUNTIME.jit_type) and torch.version.hip is None and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def _int_kind(x: int) -> int:
    """0: i32, 1: i64, 2: u64 (the int types Triton gives a Python int by its value)."""
    return 0 if _I32[0] <= x <= _I32[1] else 1 if _I64[0] <= x <= _I64[1] else 2


def spec_key(x: Any, specialize: bool = True, align: bool = True) -> Any:
    """What Triton's specialization of one runtime argument depends on (equal key => same kernel).

    `specialize` / `align` are off for `do_not_specialize` / `do_not_specialize_on_alignment`
    parameters. Tensor: dtype and (both on) 16-byte alignment of data_ptr; int: its range
    and (specialize on) == 1 and (both on) % 16 == 0; bool, float, None: the type only.
    """
    if isinstance(x, torch.Tensor):
        return x.dtype, specialize and align and x.data_ptr() % 16 == 0
    if type(x) is int:
        return (_int_kind(x), x == 1, align and x % 16 == 0) if specialize else _int_kind(x)
    return type(x)


# The running Triton's view.
RUNTIME = triton_runtime()


class Launcher:
    """Binds one `@triton.jit` kernel (a `JITFunction`, or the interpreter's function)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.signature = inspect.signature(fn.fn)
        self.names = list(self.signature.parameters)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._defaults = {n: p.default for n, p in self.signature.parameters.items() if p.default is not p.empty}
        self._constexpr = {n for n, p in self.signature.parameters.items() if "constexpr" in str(p.annotation)}
        # (specialize ints, specialize alignment) per parameter: a JITFunction's (not the interpreter's)
        flags = RUNTIME.spec_flags(fn) if RUNTIME is not None and isinstance(fn, RUNTIME.jit_type) else {}
        self._spec_flags = {n: flags.get(n, (True, True)) for n in self.names}
        # per parameter: None for a constexpr (keyed by its repr), else its `spec_key` flags
        self._key_flags = tuple(None if n in self._constexpr else self._spec_flags[n] for n in self.names)

    def arguments(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list:
        """Every parameter's value in order, as `inspect.Signature.bind` and `apply_defaults`
        give them (kwargs: parameter names only); a missing, unknown or doubled argument raises
        TypeError naming it."""
        names, name = self.names, self.fn.__name__
        if len(args) > len(names):
            raise TypeError(f"{name}: {len(args)} positional arguments, the kernel takes {len(names)}")
        missing = object()
        values = [*args, *(missing,) * (len(names) - len(args))]
        for key, value in kwargs.items():
            i = self._index.get(key)
            if i is None:
                raise TypeError(f"{name}: no parameter {key!r}")
            if i < len(args):
                raise TypeError(f"{name}: multiple values for argument {key!r}")
            values[i] = value
        for i in range(len(args), len(names)):
            if values[i] is missing:
                if names[i] not in self._defaults:
                    raise TypeError(f"{name}: missing argument {names[i]!r}")
                values[i] = self._defaults[names[i]]
        return values

    def bind(self, grid: Sequence[int], *args: Any, free: Sequence[str] = (), checked: Sequence[str] = (),
             options: KernelOptions = DEFAULT, **kwargs: Any) -> "BoundLaunch":
        """Bind `kernel[grid](*args, **kwargs)`: the values given are the first call's; the
        `free` parameters (non-constexpr names) are passed again, in that order, on every call.
        `checked`: free tensor parameters whose dtype and device the caller guarantees equal
        to the first call's (it validated them); per call only their alignment is checked.
        kwargs: constexprs and launch options (num_warps, num_stages, ...); a kernel with a
        `PDL` constexpr not given gets the `options.pdl` mode and launch_pdl where `pdl_enabled`.
        options: the kernels' options (PDL mode, fast path). Compiles now."""
        if "PDL" in self._constexpr and "PDL" not in kwargs and pdl_enabled(self.fn, options.pdl):
            kwargs = {**kwargs, "PDL": options.pdl, "launch_pdl": True}
        launch_options = {k: v for k, v in kwargs.items() if k not in self._index}
        values = self.arguments(args, {k: v for k, v in kwargs.items() if k in self._index})
        for name in free:
            if name not in self._index or name in self._constexpr:
                raise ValueError(f"{self.fn.__name__}: free argument {name!r} must be a runtime parameter")
        for name in checked:
            if name not in free:
                raise ValueError(f"{self.fn.__name__}: checked argument {name!r} must be a free argument")
        if _DEFERRED:
            return _DEFERRED[-1].add(self, grid, values, launch_options)
        return BoundLaunch(self, tuple(grid), values, launch_options, tuple(free),
                           tuple(n in checked for n in free), fast_launch=options.fast_launch)

    def compiled(self, grid: Sequence[int], values: list, options: dict) -> Any:
        """The compiled kernel of these argument values (Triton's cache; compiles if needed)."""
        return RUNTIME.compile(self.fn, grid, values, options)

    def ordinary(self, grid: Sequence[int], values: list, options: dict) -> None:
        """The ordinary launch `kernel[grid](...)` (also the interpreter's)."""
        self.fn[grid](*values, **options)


class BoundLaunch:
    """One kernel bound to a grid and all arguments but the free ones; `bound(*free)` launches.

    On the fast path the call is a function generated at binding (`source`): it checks the
    free arguments' specialization key against the bound one inline (tensor dtype, device
    and alignment; int range, == 1, % 16) and calls the compiled kernel's run with every
    pointer as a raw int (fixed tensors resolved here, held alive by `values`), which also
    spares the launcher's per-pointer `data_ptr` call and driver query. Any other key, or a
    disabled / hooked launcher, goes to `_slow`: the variant of that key or the ordinary launch.
    """

    def __init__(self, launcher: Launcher, grid: tuple[int, ...], values: list, options: dict,
                 free: tuple[str, ...], checked: tuple[bool, ...] = (), *, fast_launch: bool = True) -> None:
        self.launcher = launcher
        self._can_fast = _fast if fast_launch else _off  # checked at every call
        self.checked = checked or (False,) * len(free)  # per free argument: dtype / device checked by the caller
        self.grid = grid
        self.values = values  # every parameter in order (constexprs included; free ones None), as Triton's binder
        self.options = options
        self.free_index = tuple(launcher.names.index(n) for n in free)
        self.free_flags = tuple(launcher._spec_flags[n] for n in free)
        # False for the interpreter's functions (and a Triton `triton_runtime` does not know)
        self.native = RUNTIME is not None and isinstance(launcher.fn, RUNTIME.jit_type)
        self._variants: dict[tuple, tuple] = {}
        self.source = ""
        # The generated fast call (native kernels) refers to nothing that refers back to this
        # binding: a binding its owner drops frees the caches and workspace it holds at once, not
        # when Python's cycle collector runs (a bound method stored here would make a cycle).
        self._fast: Callable[..., bool | None] | None = None
        if self.native:
            self.device = RUNTIME.device()
            self._stream: Callable[[int], int] = RUNTIME.stream_fn()
            free_values = [values[i] for i in self.free_index]
            key = self.key(free_values)
            self._fast = self._generate(self._variant(key, values), free_values)
        for i in self.free_index:  # every call passes its own: never keep the first call's tensors alive
            values[i] = None

    def __call__(self, *free: Any) -> None:
        fast = self._fast
        if fast is None or fast(*free) is False:
            self._slow(*free)

    def key(self, free: Sequence[Any]) -> tuple:
        """The specialization key of free argument values."""
        return tuple(spec_key(x, s, a) for x, (s, a) in zip(free, self.free_flags))

    def _variant(self, key: tuple, values: list) -> tuple:
        """(run, function, packed metadata) of the compiled kernel for `key`, fetched once."""
        entry = self._variants.get(key)
        if entry is None:
            kernel = self.launcher.compiled(self.grid, values, self.options)
            entry = RUNTIME.handles(kernel)
            self._variants[key] = entry
        return entry

    def _slow(self, *free: Any) -> None:
        """Any free arguments: the compiled variant of their key, or the ordinary launch."""
        values = self.values.copy()
        for i, x in zip(self.free_index, free):
            values[i] = x
        if not (self.native and self._can_fast()):
            self.launcher.ordinary(self.grid, values, self.options)
            return
        run, function, packed = self._variant(self.key(free), values)
        g = tuple(self.grid) + (1,) * (3 - len(self.grid))
        run(*g, self._stream(self.device), function, packed, None, None, None, *values)

    def _generate(self, entry: tuple, free_values: list) -> Callable[..., bool | None]:
        """The fast call for the bound key: inline key checks, then the compiled run; False
        (nothing launched) where the checks fail or the fast path is off."""
        names = {"RUN": entry[0], "FN": entry[1], "PACKED": entry[2], "STREAM": self._stream, "DEV": self.device,
                 "FAST": self._can_fast, "KIND": _int_kind}
        params = [f"f{j}" for j in range(len(self.free_index))]
        checks, prep, args, aligned = [], [], [], []
        for j, (x, (spec, align)) in enumerate(zip(free_values, self.free_flags)):
            f = f"f{j}"
            if isinstance(x, torch.Tensor):
                names[f"K{j}"] = x.dtype
                prep.append(f"p{j} = {f}.data_ptr()")
                if not self.checked[j]:
                    checks.append(f"{f}.dtype is K{j} and {f}.get_device() == DEV")
                if spec and align:
                    if x.data_ptr() % 16 == 0:
                        aligned.append(f"p{j}")  # one test for all of them, below
                    else:
                        checks.append(f"p{j} & 15 != 0")
            elif type(x) is int:
                # The bound value passes at once (usually a stride or size that never changes).
                kind = _int_kind(x)
                key = [f"{_I32[0]} <= {f} <= {_I32[1]}" if kind == 0 else f"KIND({f}) == {kind}"]
                if spec:
                    key.append(f"({f} == 1) is {x == 1}")
                    if align:
                        key.append(f"({f} & 15 == 0) is {x % 16 == 0}")
                checks.append(f"type({f}) is int and ({f} == {x} or ({' and '.join(key)}))")
            else:
                names[f"T{j}"] = type(x)
                checks.append(f"type({f}) is T{j}")
        if aligned:
            checks.append(f"({' | '.join(aligned)}) & 15 == 0")
        free_at = dict(zip(self.free_index, range(len(self.free_index))))
        for i, value in enumerate(self.values):
            if i in free_at:
                j = free_at[i]
                args.append(f"p{j}" if isinstance(free_values[j], torch.Tensor) else f"f{j}")
            else:
                names[f"V{i}"] = value.data_ptr() if isinstance(value, torch.Tensor) else value
                args.append(f"V{i}")
        g = tuple(self.grid) + (1,) * (3 - len(self.grid))
        sig = ", ".join(params)
        launch = f"RUN({g[0]}, {g[1]}, {g[2]}, STREAM(DEV), FN, PACKED, None, None, None, {', '.join(args)})"
        self.source = "\n".join([
            f"def fast({sig}):",
            *(f"    {line}" for line in prep),
            f"    if not ({' and '.join(checks) or 'True'}) or not FAST():",
            "        return False",
            f"    {launch}",
        ])
        exec(compile(self.source, f"<bound {self.launcher.fn.__name__}>", "exec"), names)
        return names["fast"]


# -- start-up warm-up: collect bindings, then compile their distinct variants at once --------------


def binding_key(launcher: Launcher, values: Sequence[Any], options: dict) -> tuple:
    """What a binding's compiled variant depends on (equal keys => one kernel; finer than
    Triton's own key): the kernel (its launcher, one per kernel: hashed by identity, unlike a
    JITFunction), its constexprs' values, `spec_key` of every runtime argument (as the kernel
    specializes it) and the launch options."""
    args = tuple(repr(v) if f is None else spec_key(v, *f) for f, v in zip(launcher._key_flags, values))
    return launcher, args, tuple(sorted((k, repr(v)) for k, v in options.items()))


class _Deferred:
    """What `Launcher.bind` returns under `deferred_binds`: never launched."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *free: Any) -> None:
        raise RuntimeError(f"{self.name}: bound under deferred_binds (warm-up), not launchable: bind it again")


class deferred_binds:
    """`with deferred_binds(found):` (one thread, start-up only) `Launcher.bind` compiles
    nothing and returns a launch that raises if called, and each binding's (launcher, grid,
    values, options) is added to the dict `found` once per `binding_key` (the first values seen
    kept alive there); `compile_bindings` then compiles them."""

    def __init__(self, found: dict[tuple, tuple]) -> None:
        self.found = found

    def add(self, launcher: Launcher, grid: Sequence[int], values: list, options: dict) -> _Deferred:
        """Record one binding (`Launcher.bind` under this context)."""
        self.found.setdefault(binding_key(launcher, values, options), (launcher, tuple(grid), values, options))
        return _Deferred(launcher.fn.__name__)

    def __enter__(self) -> dict[tuple, tuple]:
        _DEFERRED.append(self)
        return self.found

    def __exit__(self, *exc: Any) -> None:
        _DEFERRED.pop()


_DEFERRED: list[deferred_binds] = []


def compile_bindings(bindings: Sequence[tuple], workers: int) -> int:
    """Compile the variant of each (launcher, grid, values, options) of `deferred_binds` into
    Triton's cache, as `Launcher.bind` would on the current device, `workers` compiles at a time
    (Triton's `AsyncCompileMode`: its compiles run in a thread pool, the MLIR / LLVM passes
    outside the GIL, ptxas in a process; the Triton in use without it: one at a time). The
    interpreter's functions compile nothing. Returns how many were compiled or found cached."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import nullcontext

    from triton.runtime.jit import JITFunction

    native = [b for b in bindings if isinstance(b[0].fn, JITFunction)]
    if not native:
        return 0
    mode = getattr(triton, "AsyncCompileMode", None)
    with ThreadPoolExecutor(max(1, workers)) as pool, (nullcontext() if mode is None or workers <= 1 else mode(pool)):
        for launcher, grid, values, options in native:
            launcher.fn.run(*values, grid=grid, warmup=True, **options)  # leaving the mode waits for every compile
    return len(native)
