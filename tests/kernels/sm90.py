"""Compiling kernels for the H200 (sm_90) on a machine without a GPU: the compile tests' common part.

The interpreter accepts code the compiler rejects, so each kernel module's tests compile its
production variants here, in a fresh process without TRITON_INTERPRET (`run`). `compile_sm90`
specializes a kernel as Triton's launcher does: pointers 16-byte aligned, runtime ints that a
served step passes as 1 turned into constants and those divisible by 16 marked so (this sets the
width of every vector load: without it each thread loads 2 bytes at a time, and the registers and
spills `usage` reads are not those of the kernel that runs).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run(script: str, timeout: int) -> subprocess.CompletedProcess:
    """Run `script` (a file path, or Python code) in a fresh interpreter without TRITON_INTERPRET,
    from the repository root, with this folder importable (`import sm90`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    args = [sys.executable, script] if os.path.isfile(script) else [sys.executable, "-c", script]
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run_many(commands: list[list[str]], workers: int, timeout: int,
             env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run each command ([script, *args]) as `run` does, `workers` at a time, with env added;
    the completed processes in the commands' order (one past the common timeout is killed)."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, base.get("PYTHONPATH", "")) if p)
    base.update(env or {})
    pending, running, done = list(enumerate(commands)), [], {}
    deadline = time.monotonic() + timeout
    while pending or running:
        while pending and len(running) < workers:
            i, cmd = pending.pop(0)
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            proc = subprocess.Popen([sys.executable, *cmd], env=base, cwd=ROOT, text=True, stdout=out, stderr=err)
            running.append((i, proc, out, err))
        time.sleep(0.2)
        for entry in [e for e in running if e[1].poll() is not None or time.monotonic() > deadline]:
            i, proc, out, err = entry
            killed = proc.poll() is None
            if killed:
                proc.kill()
                proc.wait()
            running.remove(entry)
            out.seek(0)
            err.seek(0)
            tail = f"\nrun_many: killed at the {timeout} s deadline\n" if killed else ""
            done[i] = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read() + tail)
            out.close()
            err.close()
    return [done[i] for i in range(len(commands))]


def compile_sm90(fn, consts: dict, types: dict[str, str] | None = None, values: dict[str, int] | None = None,
                 **options):
    """fn compiled for sm_90 with the constexprs consts (every one named, else AssertionError: the
    compiler would take a missing one as None) and launch options (num_warps, num_stages, maxnreg,
    launch_pdl, ...). types: runtime parameters' Triton types by name ("*bf16", "fp32", ...; others
    "*i32" when named *_ptr, else "i32"); values: runtime ints as a served step passes them (== 1:
    constants, % 16 == 0: the divisibility attribute; others unmarked, as for a value of 1 < v < 16
    or not a multiple of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types, values = types or {}, values or {}
    consts = dict(consts, **{n: 1 for n, v in values.items() if v == 1 and n in fn.arg_names})
    missing = {p.name for p in fn.params if p.is_constexpr} - set(consts)
    assert not missing, f"{fn.__name__}: constexprs without a value: {sorted(missing)}"
    sig = {n: "constexpr" if n in consts else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and values.get(n, 1) % 16 == 0)}
    return triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def usage(kernel) -> tuple[int, int] | None:
    """(registers, spill stack bytes) of a compiled kernel, read by the cuobjdump Triton ships;
    None where it does not ship one."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    return (int(found.group(1)), int(found.group(2))) if found else None


def int_divisions(kernel) -> int:
    """Integer divisions and remainders in a compiled kernel's PTX: each by a runtime divisor is a
    sequence of ~20 SASS instructions (a constant power of two compiles to a shift)."""
    return len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:div|rem)\.[su](?:32|64)\b", kernel.asm["ptx"], re.M))


def usage_text(kernel) -> str:
    """`usage` as printed by the compile tests."""
    u = usage(kernel)
    return f"{u[0]} registers, {u[1]} B stack" if u else "resource usage unavailable"


def compile_decode_topk(cols: int, rows: int, packed: bool, skip: int, warm_k: int = 0, **tile_changes):
    """`select_prefill._topk_prefill_kernel` as the per-row-samples decode route binds it for a
    chunk of `rows` rows of `cols` columns (Kb 512, 128-column score tiles; packed rows of W
    2051 at r 4, or groups), with the tile skip `skip`, the K/V warm of warm_k bytes a group
    (bf16 caches, page 64; `warm.KV`) and tile_changes (`SampleTiles` fields: cap2=0 drops the
    second resolve tier, warps=4 ...); returns the compiled kernel."""
    import triton

    from qsa_kernels import select_prefill as sp

    t = replace(sp.decode_tiles(cols, 512, 128, small=False, rows=rows), skip=skip, **tile_changes)
    const = dict(KB=512, KBP=512, BITS=t.bits, LBITS=t.lbits, S=128, SAMPP=1 << t.row_s, SEG=t.seg,
                 SEGP=triton.next_power_of_2(triton.cdiv(cols, t.seg)), CAP=t.cap, CAP2=t.cap2, LIST=t.list_cap, BLOCK=t.block,
                 RBLOCK=t.rblock, DEFER=0, PACKED=packed, R=4 if packed else 1, W=2051 if packed else 1,
                 BLOCK_W=1024 if packed else 1, RUNS=sp.seg_runs(cols, t, 128), ROW_SAMPLES=t.row_s,
                 LOG_G=t.log_g, BOUND_IN=t.bound & 1, SBITS=t.sbits, RSBITS=t.rsbits, WARM_K=warm_k,
                 WARM_V=0, PAGE=64, BSLACK=t.bslack, PDL=2)
    types = dict(s_ptr="*fp32", pos_ptr="*i64", kc_ptr="*bf16", vc_ptr="*bf16")
    return compile_sm90(sp._topk_prefill_kernel, const, types, num_warps=t.warps, launch_pdl=True)


class Binding(NamedTuple):
    """One `Launcher.bind` as recorded: the kernel, every parameter's value in order
    (constexprs included) and the launch options."""

    fn: object
    values: tuple
    options: dict


class Recording:
    """What `recording` yields: `bindings`, the distinct `Binding`s by `quick_key` in the order
    first seen, each tensor replaced by a stand-in (`stand_in`: the same dtype and 16-byte
    alignment, all a compiled variant depends on, so no recorded step's tensors stay alive);
    `count`, every binding made."""

    def __init__(self) -> None:
        self.bindings: dict[tuple, Binding] = {}
        self.count = 0

    def add(self, b: Binding) -> None:
        self.count += 1
        key = quick_key(b)
        if key not in self.bindings:
            self.bindings[key] = Binding(b.fn, tuple(stand_in(v) for v in b.values), b.options)


_STAND_INS: dict = {}


def stand_in(value):
    """A tensor's stand-in (`_stand_in_of` its dtype and 16-byte alignment); anything else unchanged."""
    import torch

    return _stand_in_of(value.dtype, value.data_ptr() % 16 == 0) if isinstance(value, torch.Tensor) else value


def _stand_in_of(dtype, aligned: bool):
    """A two-element tensor of dtype, 16-byte aligned or not (shared)."""
    import torch

    key = (dtype, aligned)
    if key not in _STAND_INS:
        base = torch.zeros(64, dtype=torch.uint8).view(dtype)
        _STAND_INS[key] = base[:2] if aligned else base[1:3]
    return _STAND_INS[key]


@contextlib.contextmanager
def recording(sms: int = 132):
    """Within: every `Launcher.bind` is added to the yielded `Recording` and returns a launch
    that does nothing, and so is every binding the warm-up compiles (`launch.compile_bindings`),
    instead of compiling for this machine; and the binding code sees an
    sm_90 GPU of `sms` SMs (the H100 / H200's 132): PDL on, the decode top-k's L2 warm on,
    the attention's split count planned for that many SMs, the triton backend on CPU tensors. Run without TRITON_INTERPRET, so
    every tile choice is the production one."""
    from qsa_core import backends
    from qsa_kernels import attention, launch, warm

    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "recording needs the compiled kernels' tile choices"
    found = Recording()

    class Recorded:
        def __init__(self, launcher, grid, values, options, free, checked=(), *, fast_launch=True):
            found.add(Binding(launcher.fn, tuple(values), dict(options)))

        def __call__(self, *free):
            return None

    def compile_bindings(bindings, workers):
        for launcher, _, values, options in bindings:
            found.add(Binding(launcher.fn, tuple(values), dict(options)))
        return len(bindings)

    saved = (launch.BoundLaunch, launch.compile_bindings, launch.pdl_enabled, warm.warm_enabled, attention._num_sms,
             backends.resolve_backend)
    real_backend = backends.resolve_backend
    launch.BoundLaunch, launch.compile_bindings = Recorded, compile_bindings
    # the CPU tensors stand for the GPU's: nothing launches, so the triton backend may take them
    backends.resolve_backend = lambda device, options: (
        "triton" if options.backend == "triton" else real_backend(device, options))
    launch.pdl_enabled = lambda fn, mode: mode > 0
    warm.warm_enabled = lambda device, options: options.l2_warm
    attention._num_sms = lambda device: sms
    try:
        yield found
    finally:
        (launch.BoundLaunch, launch.compile_bindings, launch.pdl_enabled, warm.warm_enabled, attention._num_sms,
         backends.resolve_backend) = saved


def portable(b: Binding) -> tuple:
    """A binding as plain data another process can load (`restore`): the kernel by module and
    name, tensors by dtype and 16-byte alignment."""
    import torch

    values = tuple(("tensor", str(v.dtype).removeprefix("torch."), v.data_ptr() % 16 == 0)
                   if isinstance(v, torch.Tensor) else v for v in b.values)
    return b.fn.__module__, b.fn.__name__, values, b.options


def restore(data: tuple) -> Binding:
    """The `Binding` `portable` wrote (tensors as `stand_in`s)."""
    import importlib

    import torch

    module, name, values, options = data
    fn = getattr(importlib.import_module(module), name)
    values = tuple(_stand_in_of(getattr(torch, v[1]), v[2]) if isinstance(v, tuple) and v[:1] == ("tensor",)
                   else v for v in values)
    return Binding(fn, values, options)


def _binder_args(b: Binding) -> tuple:
    """(backend, kwargs, bound_args, specialization, options) as Triton's `JITFunction.run`
    computes them for sm_90 from a binding's values."""
    from triton import knobs
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target())
    kwargs = dict(b.options, debug=b.options.get("debug", b.fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton >= 3.9 passes it too
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(b.fn.signature, b.fn.params, backend)
    bound_args, specialization, options = binder(*b.values, **kwargs)
    return backend, kwargs, bound_args, specialization, options


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def quick_key(b: Binding) -> tuple:
    """A finer key than `spec_key`, cheap to compute (constexprs' values, `launch.spec_key` of
    the runtime arguments, the options): bindings of one quick key share their variant."""
    from qsa_kernels.launch import spec_key as arg_key

    parts = tuple(repr(v) if p.is_constexpr else arg_key(v, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                  for p, v in zip(b.fn.params, b.values))
    return b.fn, parts, repr(sorted(b.options.items()))


def spec_key(b: Binding) -> tuple:
    """What Triton's kernel cache keys a binding's compiled variant by (kernel, argument
    specialization, options): equal keys compile the same kernel."""
    _, kwargs, _, specialization, options = _binder_args(b)
    return (b.fn.__module__, b.fn.__name__, repr(specialization), repr(sorted(options.items()) if isinstance(
        options, dict) else options), repr(sorted((k, v) for k, v in kwargs.items() if k in b.options)))


def compile_binding(b: Binding):
    """A recorded binding compiled for sm_90 exactly as Triton's launcher would compile it there."""
    import triton
    from triton.compiler import ASTSource

    backend, kwargs, bound_args, specialization, options = _binder_args(b)
    options, signature, constexprs, attrs = b.fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(b.fn, signature, constexprs, attrs), target=_target(), options=options.__dict__)
