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


def int_divisions(kernel) -> int:
    """Integer divisions and remainders in a compiled kernel's PTX: each by a runtime divisor is a
    sequence of ~20 SASS instructions (a constant power of two compiles to a shift)."""
    return len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:div|rem)\.[su](?:32|64)\b", kernel.asm["ptx"], re.M))


def usage_text(kernel) -> str:
    """`usage` as printed by the compile tests."""
    u = usage(kernel)
    return f"{u[0]} registers, {u[1]} B stack" if u else "resource usage unavailable"


def compile_decode_topk(cols: int, rows: int, packed: bool, skip: int, warm_k: int = 0):
    """`select_prefill._topk_prefill_kernel` as the per-row-samples decode route binds it for a
    chunk of `rows` rows of `cols` columns (Kb 512, 128-column score tiles; packed rows of W
    2051 at r 4, or groups), with the tile skip `skip` and the K/V warm of warm_k bytes a group
    (bf16 caches, page 64; `warm.KV`); returns the compiled kernel."""
    import triton

    from qsa_kernels import select_prefill as sp

    t = dict(sp.decode_tiles(cols, 512, 128, small=False, rows=rows), skip=skip)
    const = dict(KB=512, KBP=512, BITS=t["bits"], LBITS=t["lbits"], S=128, SAMPP=1 << t["row_s"], SEG=t["seg"],
                 SEGP=triton.next_power_of_2(triton.cdiv(cols, t["seg"])), CAP=t["cap"], BLOCK=t["block"],
                 RBLOCK=t["rblock"], DEFER=0, PACKED=packed, R=4 if packed else 1, W=2051 if packed else 1,
                 BLOCK_W=1024 if packed else 1, RUNS=sp.seg_runs(cols, t, 128), ROW_SAMPLES=t["row_s"],
                 LOG_G=t["log_g"], BOUND_IN=t["bound"] & 1, SBITS=t["sbits"], RSBITS=t["rsbits"], WARM_K=warm_k,
                 WARM_V=0, PAGE=64, PDL=2)
    types = dict(s_ptr="*fp32", pos_ptr="*i64", kc_ptr="*bf16", vc_ptr="*bf16")
    return compile_sm90(sp._topk_prefill_kernel, const, types, num_warps=t["warps"], launch_pdl=True)
