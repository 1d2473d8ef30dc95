"""Programmatic dependent launch (`launch.pdl_start`): with PDL the kernels compile for sm_90
with the two grid-dependency instructions first, and without it with neither (the GPU's
kernel suites run every kernel with it; `test_cuda_graph_step` compares steps with it and
without)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_combine() -> str:
    """PTX of the attention combine kernel for sm_90, with PDL and without, one line each:
    `PDL=<flag> wait=<count> launch=<count> first=<the first griddepcontrol or global access>`."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qsa_kernels import attention as ker

    sig = {p.name: "constexpr" if p.is_constexpr else "*fp32" if p.name.startswith("part") else
           "*bf16" if p.name.endswith("_ptr") else "fp32" if p.name.endswith("_scale") else "i32"
           for p in ker._combine_kernel.params}
    lines = []
    for pdl in (True, False):
        consts = dict(HQ=24, D=256, DP=256, SP=64, PDL=pdl)
        k = triton.compile(ASTSource(ker._combine_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(launch_pdl=pdl))
        ptx = k.asm["ptx"]
        first = re.search(r"griddepcontrol\.\w+|ld\.global|st\.global", ptx)
        lines.append(f"PDL={pdl} wait={ptx.count('griddepcontrol.wait')} "
                     f"launch={ptx.count('griddepcontrol.launch_dependents')} first={first.group(0) if first else None}")
    return "\n".join(lines)


def test_pdl_instructions_come_first():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["PDL=True", "wait=1", "launch=1", "first=griddepcontrol.wait",
                                   "PDL=False", "wait=0", "launch=0", "first=ld.global"], done.stdout


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    print(compile_combine())
