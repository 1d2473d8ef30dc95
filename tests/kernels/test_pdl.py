"""Programmatic dependent launch (`launch.pdl_start` / `pdl_end`): for sm_90 a kernel compiles
with the wait before any global access and the signal right after it (mode 1) or after its
last store (mode 2), and with neither instruction without PDL (mode 0). The GPU's kernel
suites run every kernel in the default mode; `test_cuda_graph_step` compares steps in all three."""

from __future__ import annotations

import os

import pytest


def compile_combine() -> str:
    """PTX of the attention combine kernel for sm_90 in each PDL mode, one line each:
    `PDL=<mode> wait=<count> launch=<count> order=<griddepcontrol and global accesses, first, second, last>`."""
    import re

    from qsa_kernels import attention as ker
    from sm90 import compile_sm90

    types = dict(gate_ptr="*bf16", out_ptr="*bf16", part_ml_ptr="*fp32", part_acc_ptr="*fp32", v_scale="fp32")
    lines = []
    for pdl in (1, 2, 0):
        k = compile_sm90(ker._combine_kernel, dict(HQ=24, D=256, DP=256, SP=64, PDL=pdl), types,
                         launch_pdl=pdl > 0)
        ptx = k.asm["ptx"]
        seen = re.findall(r"griddepcontrol\.\w+|ld\.global|st\.global", ptx)
        lines.append(f"PDL={pdl} wait={ptx.count('griddepcontrol.wait')} "
                     f"launch={ptx.count('griddepcontrol.launch_dependents')} order={','.join(seen[:2] + seen[-1:])}")
    return "\n".join(lines)


@pytest.mark.sm90
def test_pdl_instructions_wait_first_and_signal_in_their_mode():
    from sm90 import run

    done = run(os.path.abspath(__file__), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == [
        "PDL=1", "wait=1", "launch=1", "order=griddepcontrol.wait,griddepcontrol.launch_dependents,st.global",
        "PDL=2", "wait=1", "launch=1", "order=griddepcontrol.wait,ld.global,griddepcontrol.launch_dependents",
        "PDL=0", "wait=0", "launch=0", "order=ld.global,ld.global,st.global"], done.stdout


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    print(compile_combine())
