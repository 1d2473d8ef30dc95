"""GPU: the tensor-parallel layers of `tp_ranks` on CUDA (Triton kernels, bf16) against the
unsharded layers on the GPU: NCCL across two GPUs, and gloo with both ranks on one GPU.
Run by `scripts/test_gpu_tp.sh` (NVLink multicast off, as the machines' README asks)."""

import os

import pytest
import torch

from tp_ranks import TPLayer, check_ranks, model, run_ranks, run_schedule

# NVLink multicast off (the ranks inherit it)
for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_name, _value)

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BF16 = dict(rtol=2e-2, atol=2e-2)  # bf16 outputs of a 2-layer chain, partial sums in another order


@pytest.fixture(scope="module")
def tp1():
    dev = torch.device("cuda:0")
    return run_schedule([TPLayer(layer.to(dev, torch.bfloat16)) for layer in model()], dev, torch.bfloat16)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
def test_two_gpus_nccl(tmp_path, tp1):
    check_ranks(run_ranks(2, tmp_path, backend="nccl", device="cuda:RANK", dtype="bfloat16"), tp1, **BF16)


def test_two_ranks_on_one_gpu_gloo(tmp_path, tp1):
    check_ranks(run_ranks(2, tmp_path, backend="gloo", device="cuda:0", dtype="bfloat16"), tp1, **BF16)
