import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in the interpreter (set before any kernel module loads).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_oracle import DEVICE  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip without CUDA, `interpreter` tests without TRITON_INTERPRET=1."""
    gpu = torch.cuda.is_available()
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(pytest.mark.skip(reason="interpreter test (TRITON_INTERPRET=1, CPU tensors)"))


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    """Run a test with each ops backend (QSA_BACKEND, read when a planner is made)."""
    if request.param == "triton" and DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need CUDA tensors (QSA_TEST_DEVICE=cuda) or TRITON_INTERPRET=1")
    monkeypatch.setenv("QSA_BACKEND", request.param)
    return request.param
