"""`QSAOptions`: read from the environment in one place, held by the planner, which picks
its backend object from them once."""

import pytest
import torch

from qsa_core import QSAConfig, QSAOptions, QSAPlanner
from qsa_core.backends.reference import ReferenceBackend
from qsa_kernels.options import KernelOptions

CONFIG = QSAConfig(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=16, index_n_heads=2, index_head_dim=16,
                   token_topk=8, compress_ratio=4, rotary_dim=8, rope_theta=1e4)


def _planner(**kw) -> QSAPlanner:
    return QSAPlanner(CONFIG, dtype=torch.float32, page_size=8, ring_capacity=8, max_num_tokens=8,
                      max_model_len=64, **kw)


def test_from_env_reads_the_three_variables():
    assert QSAOptions.from_env({}) == QSAOptions()
    env = {"QSA_BACKEND": "triton", "QSA_DEBUG": "1", "TRITON_INTERPRET": "1"}
    assert QSAOptions.from_env(env) == QSAOptions(backend="triton", debug=True,
                                                  kernel=KernelOptions.for_interpreter())
    assert QSAOptions.from_env({"QSA_BACKEND": "", "QSA_DEBUG": "0", "TRITON_INTERPRET": "0"}) == QSAOptions()
    with pytest.raises(ValueError, match=r"QSA_BACKEND must be one of \('reference', 'triton'\), got 'cuda'"):
        QSAOptions.from_env({"QSA_BACKEND": "cuda"})
    with pytest.raises(ValueError, match=r"backend must be one of \('reference', 'triton'\) or None, got 'cuda'"):
        QSAOptions(backend="cuda")


def test_the_planner_holds_its_options_and_one_backend_object(monkeypatch):
    monkeypatch.setenv("QSA_DEBUG", "1")
    monkeypatch.setenv("QSA_BACKEND", "reference")
    p = _planner()  # from the environment, read now
    assert p.options.debug and p.options.backend == "reference" and p._read_values
    assert isinstance(p.backend, ReferenceBackend) and p.backend.name == str(p.backend) == "reference"
    monkeypatch.setenv("QSA_DEBUG", "0")
    assert p._read_values  # read once, when the planner was made
    pinned = _planner(options=QSAOptions(value_checks=False))  # explicit options: the environment is not read
    assert not pinned.options.debug and not pinned.value_checks and not pinned._read_values
    shorthand = _planner(options=QSAOptions(debug=True), value_checks=False, backend="reference")
    assert shorthand.options == QSAOptions(backend="reference", value_checks=False, debug=True)
