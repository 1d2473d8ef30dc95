"""The decode top-k's L2 warm of the attention's K/V (`qsa_kernels.warm`).

Whether the warm changes any bit is a GPU question (`test_cuda_graph_step.test_l2_warm_changes_no_bits`);
here: QSA_L2_WARM's parsing (`KernelOptions.l2_warm`), the K/V layouts and the byte cap the warm takes, that nothing warms
without a GPU of sm_90, and (compiled for sm_90 on the CPU) that the top-k kernel bound with the
warm issues bulk L2 prefetches after the PDL wait, each guarded by its mask and a 16-byte
alignment test, and none when bound without it.
"""

from __future__ import annotations

import os

import pytest
import torch

from qsa_core import QSAOptions
from qsa_kernels import warm
from qsa_kernels.options import KernelOptions


def test_qsa_l2_warm_is_on_or_off():
    for raw, want in (("", True), ("0", False), ("1", True)):
        assert QSAOptions.from_env({"QSA_L2_WARM": raw}).kernel.l2_warm is want
    assert QSAOptions.from_env({}).kernel.l2_warm
    for raw in ("2", "-1", "all"):
        with pytest.raises(ValueError, match=f"QSA_L2_WARM must be one of 0, 1 \\(or unset\\), got '{raw}'"):
            QSAOptions.from_env({"QSA_L2_WARM": raw})


def test_nothing_warms_without_an_sm90_gpu_or_in_the_interpreter():
    k = torch.zeros(4, 64, 2, 256, dtype=torch.bfloat16)
    assert not warm.warm_enabled(torch.device("cpu"), KernelOptions())
    assert warm.kv_warm(k, k, torch.zeros(4, dtype=torch.int32), 4, rows=4, block_topk=512) is None
    if torch.cuda.is_available():
        assert not warm.warm_enabled(torch.device("cuda"), KernelOptions.for_interpreter())
        assert not warm.warm_enabled(torch.device("cuda"), KernelOptions(l2_warm=False))


def test_kv_warm_takes_contiguous_group_runs(monkeypatch):
    monkeypatch.setattr(warm, "warm_enabled", lambda device, options: True)
    to_req = torch.zeros(4, dtype=torch.int32)
    paired = torch.zeros(8, 64, 2, 512, dtype=torch.bfloat16)  # QSACacheLayout: [K | V] per head
    k, v = paired[..., :256], paired[..., 256:]
    got = warm.kv_warm(k, v, to_req, 4, rows=4, block_topk=512)
    assert (got.k_bytes, got.v_bytes) == (4 * 2 * 512 * 2, 0)  # a group's K and V rows: one run
    sep = torch.zeros(2, 8, 64, 2, 256, dtype=torch.bfloat16)
    got = warm.kv_warm(sep[0], sep[1], to_req, 4, rows=4, block_topk=512)
    assert (got.k_bytes, got.v_bytes) == (4 * 2 * 256 * 2, 4 * 2 * 256 * 2)
    heads_first = torch.zeros(8, 2, 64, 256, dtype=torch.bfloat16).transpose(1, 2)  # a group's rows apart
    assert warm.kv_warm(heads_first, heads_first, to_req, 4, rows=4, block_topk=512) is None
    assert warm.kv_warm(k, v, to_req, 4, rows=8, block_topk=512) is None  # 32 MiB of chosen K/V > 24 MiB


def compile_topk() -> list[str]:
    """PTX facts of the 1M-context decode top-k without and with the warm, one line each:
    `topk warm=<K bytes> prefetch=<count> guarded=<alignment tests> first=<first two of wait /
    prefetch / global load>` (the wait must come first)."""
    import re

    from sm90 import compile_decode_topk

    lines = []
    for k_bytes in (0, 8192):
        k = compile_decode_topk(1 << 18, 4, packed=True, skip=1, warm_k=k_bytes)
        ptx = k.asm["ptx"]
        order = re.findall(r"griddepcontrol\.wait|cp\.async\.bulk\.prefetch|ld\.global", ptx)
        lines.append(f"topk warm={k_bytes} prefetch={ptx.count('cp.async.bulk.prefetch.L2.global')} "
                     f"guarded={ptx.count('and.b64 a, ')} first={','.join(order[:2])}")
    return lines


@pytest.mark.sm90
def test_warm_issues_guarded_prefetches_after_the_wait():
    from sm90 import run

    done = run(os.path.abspath(__file__), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = [x.split() for x in done.stdout.splitlines() if x.startswith("topk ")]
    assert [x[1] for x in got] == ["warm=0", "warm=8192"], done.stdout
    for _, on, prefetch, guarded, first in got:
        n = int(prefetch.split("=")[1])
        assert (n > 0) == (on != "warm=0") and guarded == f"guarded={n}", done.stdout
        assert first.split("=")[1].startswith("griddepcontrol.wait"), done.stdout


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    print("\n".join(compile_topk()))
