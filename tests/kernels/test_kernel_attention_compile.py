"""Every attention kernel variant the schedules launch compiles for sm_90 on the CPU.

The interpreter accepts code the compiler rejects (non-constexpr globals, branch-shaped
variables), so the production variants are compiled here for the H200's
target, in a fresh process without TRITON_INTERPRET. Compiled with the launcher's specialization (16-byte
alignment, ints of value 1 as constants); prints each variant's registers and spill stack
(cuobjdump) for the record; asserts only that it compiles.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Runtime ints as a served step passes them (Hq 24, Hkv 2, D 256, page 64, 2048 pages a request, W
# 2051): the launcher specializes ints of value 1 as constants and the others by divisibility by 16,
# which sets the width of every K/V load (without it each thread loads 2 bytes at a time and spills).
VALUES = dict(stride_qt=6144, stride_qh=256, stride_gt=6144, stride_gh=256, stride_ot=6144, stride_kp=32768,
              stride_ks=512, stride_kh=256, stride_vp=32768, stride_vs=512, stride_vh=256, stride_btr=2048,
              stride_btp=1, stride_st=2052, stride_sc=1)


def _source(fn, pointers: dict[str, str], consts: dict):
    """ASTSource of a kernel as the launcher specializes it: the named pointer types (16-byte
    aligned), fp32 scales, i32 for the other runtime parameters (VALUES: == 1 as constants,
    divisible by 16 marked so), the constexprs from consts."""
    from triton.compiler import ASTSource

    consts = dict(consts, **{n: 1 for n, v in VALUES.items() if v == 1 and n in fn.arg_names})
    sig = {}
    for p in fn.params:
        name = p.name
        sig[name] = ("constexpr" if name in consts else pointers[name] if name.endswith("_ptr")
                     else "fp32" if name.endswith("_scale") else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and VALUES.get(n, 1) % 16 == 0)}
    return ASTSource(fn, sig, consts, attrs=attrs)


def compile_all() -> list[str]:
    """Compile the variants; one line per variant."""
    import re
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from qsa_kernels import attention as ker

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    target = GPUTarget("cuda", 90, 32)
    variants = []
    for name, dp, split, kv, context in [
            ("decode", 256, True, "*bf16", 0), ("decode fp8", 256, True, "*fp8e4nv", 0),
            ("decode D128", 128, True, "*bf16", 0), ("one pass", 256, False, "*bf16", 0),
            ("one pass fp8", 256, False, "*fp8e5", 0), ("one pass short", 256, False, "*bf16", 16384),
            ("one pass short fp8", 256, False, "*fp8e4nv", 16384)]:
        bn, warps, stages = ker._launch_config(dp, split, context)
        consts = dict(HQ=24, G=12, GP=16, D=dp, DP=dp, PAGE=64, BLOCK_N=bn, DOT_DTYPE=tl.bfloat16, SPLIT=split,
                      INTERPRET=False, PDL=2)
        ptrs = dict(q_ptr="*bf16", gate_ptr="*bf16", k_ptr=kv, v_ptr=kv, bt_ptr="*i32", req_ptr="*i32",
                    seq_ptr="*i32", sel_ptr="*i32", out_ptr="*bf16", part_ml_ptr="*fp32", part_acc_ptr="*fp32")
        variants.append((name, ker._attn_kernel, ptrs, consts, dict(num_warps=warps, num_stages=stages, launch_pdl=True)))
    consts = dict(HQ=24, D=256, DP=256, SP=64, PDL=2)
    ptrs = dict(gate_ptr="*bf16", out_ptr="*bf16", part_ml_ptr="*fp32", part_acc_ptr="*fp32")
    variants.append(("combine", ker._combine_kernel, ptrs, consts, dict(launch_pdl=True)))
    lines = []
    for name, fn, ptrs, consts, options in variants:
        # ASTSource compiles a constexpr left out of consts as None, silently: name every one.
        missing = {p.name for p in fn.params if p.is_constexpr} - set(consts)
        assert not missing, f"{name}: constexprs without a value: {sorted(missing)}"
        kernel = triton.compile(_source(fn, ptrs, consts), target=target, options=options)
        usage = "resource usage unavailable"
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                dump = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True)
            found = re.search(r"REG:(\d+) STACK:(\d+)", dump.stdout)
            usage = f"{found.group(1)} registers, {found.group(2)} B stack" if found else usage
        lines.append(f"compiled {name} ({options or 'default'}): {usage}")
    return lines


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("compiled ")]
    print("\n".join(lines))
    assert len(lines) == 8, done.stdout


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    print("\n".join(compile_all()))
