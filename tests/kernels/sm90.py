"""Compiling kernels for the H200 (sm_90) on a machine without a GPU: the compile tests' common part.

The interpreter accepts code the compiler rejects, so each kernel module's tests compile its
production variants here, in a fresh process without TRITON_INTERPRET (`run`). `compile_sm90`
specializes a kernel as Triton's launcher does: pointers 16-byte aligned, runtime ints that a
served step passes as 1 turned into constants and those divisible by 16 marked so (this sets the
width of every vector load: without it each thread loads 2 bytes at a time, and the registers and
spills `usage` reads are not those of the kernel that runs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run(script: str, timeout: int) -> subprocess.CompletedProcess:
    """Run `script` (a file path, or Python code) in a fresh interpreter without TRITON_INTERPRET,
    from the repository root, with this folder importable (`import sm90`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    args = [sys.executable, script] if os.path.isfile(script) else [sys.executable, "-c", script]
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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


def usage_text(kernel) -> str:
    """`usage` as printed by the compile tests."""
    u = usage(kernel)
    return f"{u[0]} registers, {u[1]} B stack" if u else "resource usage unavailable"
