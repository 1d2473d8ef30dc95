"""Every attention kernel variant the schedules launch compiles for sm_90 on the CPU.

The interpreter accepts code the compiler rejects (non-constexpr globals, branch-shaped
variables), so the production variants are compiled here for the H200's target, in a fresh
process without TRITON_INTERPRET, as the launcher specializes them (`sm90`); prints each
variant's registers and spill stack (cuobjdump) for the record; asserts only that it compiles.
"""

from __future__ import annotations

import os

import pytest

# Runtime ints as a served step passes them (Hq 24, Hkv 2, D 256, page 64, 2048 pages a request, W
# 2051): `sm90.compile_sm90` turns those of 1 into constants and marks those divisible by 16.
VALUES = dict(stride_qt=6144, stride_qh=256, stride_gt=6144, stride_gh=256, stride_ot=6144, stride_kp=32768,
              stride_ks=512, stride_kh=256, stride_vp=32768, stride_vs=512, stride_vh=256, stride_btr=2048,
              stride_btp=1, stride_st=2052, stride_sc=1)


def compile_all() -> list[str]:
    """Compile the variants; one line per variant."""
    import triton.language as tl

    from qsa_kernels import attention as ker
    from qsa_kernels.attention_common import launch_config
    from sm90 import compile_sm90, usage_text

    variants = []
    for name, dp, split, kv, context in [
            ("decode", 256, True, "*bf16", 0), ("decode fp8", 256, True, "*fp8e4nv", 0),
            ("decode D128", 128, True, "*bf16", 0), ("one pass", 256, False, "*bf16", 0),
            ("one pass fp8", 256, False, "*fp8e5", 0), ("one pass short", 256, False, "*bf16", 16384),
            ("one pass short fp8", 256, False, "*fp8e4nv", 16384)]:
        bn, warps, stages = launch_config(dp, split, context)
        consts = dict(HQ=24, G=12, GP=16, D=dp, DP=dp, PAGE=64, BLOCK_N=bn, DOT_DTYPE=tl.bfloat16, SPLIT=split,
                      INTERPRET=False, PDL=2)
        types = dict(q_ptr="*bf16", gate_ptr="*bf16", k_ptr=kv, v_ptr=kv, out_ptr="*bf16", part_ml_ptr="*fp32",
                     part_acc_ptr="*fp32", qk_scale="fp32", v_scale="fp32")
        variants.append((name, ker._attn_kernel, types, consts, dict(num_warps=warps, num_stages=stages,
                                                                     launch_pdl=True)))
    types = dict(gate_ptr="*bf16", out_ptr="*bf16", part_ml_ptr="*fp32", part_acc_ptr="*fp32", v_scale="fp32")
    variants.append(("combine", ker._combine_kernel, types, dict(HQ=24, D=256, DP=256, SP=64, PDL=2),
                     dict(launch_pdl=True)))
    return [f"compiled {name} ({options}): {usage_text(compile_sm90(fn, consts, types, VALUES, **options))}"
            for name, fn, types, consts, options in variants]


@pytest.mark.sm90
def test_kernels_compile_for_sm90():
    from sm90 import run

    done = run(os.path.abspath(__file__), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("compiled ")]
    print("\n".join(lines))
    assert len(lines) == 8, done.stdout


if __name__ == "__main__":
    print("\n".join(compile_all()))
