"""`KernelOptions`: checked fields, the interpreter's constructor, and the environment mapping
that `QSAOptions.from_env` (the one reader of the environment) fills `options.kernel` by."""

from __future__ import annotations

import pytest

from qsa_core import QSAOptions
from qsa_kernels.options import KernelOptions

KERNEL_ENV = ("QSA_FAST_LAUNCH", "QSA_PDL", "QSA_DECODE_SAMPLES", "QSA_SHARED_PREFILL", "QSA_L2_WARM")


def test_fields_are_checked_and_frozen():
    with pytest.raises(ValueError, match=r"KernelOptions.pdl must be one of \(0, 1, 2\), got 3"):
        KernelOptions(pdl=3)
    with pytest.raises(ValueError, match="KernelOptions.select_prefill_min_rows must be >= 1, got 0"):
        KernelOptions(select_prefill_min_rows=0)
    with pytest.raises(AttributeError):
        KernelOptions().pdl = 1  # type: ignore[misc]


def test_the_interpreter_constructor():
    got = KernelOptions.for_interpreter(pdl=0)
    assert got.interpreter and got.small_tiles and got.select_prefill_min_rows == 1 and got.pdl == 0
    default = KernelOptions()
    assert not default.interpreter and not default.small_tiles and default.select_prefill_min_rows == 64


def test_the_environment_maps_onto_the_fields():
    kernel = lambda env: QSAOptions.from_env(env).kernel  # noqa: E731
    assert kernel({}) == KernelOptions() == kernel({name: "" for name in KERNEL_ENV})
    assert kernel({"TRITON_INTERPRET": "0"}) == KernelOptions()
    assert kernel({"TRITON_INTERPRET": "1"}) == KernelOptions.for_interpreter()
    for name, raw, field, want in (("QSA_FAST_LAUNCH", "0", "fast_launch", False), ("QSA_FAST_LAUNCH", "1", "fast_launch", True),
                                   ("QSA_PDL", "1", "pdl", 1), ("QSA_PDL", "0", "pdl", 0), ("QSA_PDL", "2", "pdl", 2),
                                   ("QSA_SHARED_PREFILL", "0", "shared_prefill", False),
                                   ("QSA_DECODE_SAMPLES", "0", "decode_samples", False),
                                   ("QSA_DECODE_SAMPLES", "auto", "decode_samples", True),
                                   ("QSA_L2_WARM", "0", "l2_warm", False)):
        got = kernel({name: raw})
        assert getattr(got, field) == want, (name, raw)
        assert got == KernelOptions(**{field: want}), (name, raw)  # no other field moves
        interpreted = kernel({name: raw, "TRITON_INTERPRET": "1"})
        assert interpreted == KernelOptions.for_interpreter(**{field: want}), (name, raw)


@pytest.mark.parametrize("name,raw,allowed", [
    ("QSA_PDL", "3", "0, 1, 2"), ("QSA_FAST_LAUNCH", "off", "0, 1"), ("QSA_SHARED_PREFILL", "2", "0, 1"),
    ("QSA_DECODE_SAMPLES", "yes", "auto, 0, 1"), ("QSA_L2_WARM", "3", "0, 1"), ("TRITON_INTERPRET", "true", "0, 1"),
])
def test_an_invalid_value_names_the_variable_and_the_allowed_ones(name, raw, allowed):
    with pytest.raises(ValueError, match=rf"^{name} must be one of {allowed} \(or unset\), got '{raw}'$"):
        QSAOptions.from_env({name: raw})


def test_the_planner_takes_its_kernel_options_from_its_options():
    import torch

    from qsa_core import QSAConfig, QSAPlanner

    cfg = QSAConfig(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=16, index_n_heads=2, index_head_dim=16,
                    token_topk=8, compress_ratio=4, rotary_dim=8, rope_theta=1e4)
    opts = QSAOptions(backend="triton", kernel=KernelOptions.for_interpreter(decode_samples=False, pdl=0))
    p = QSAPlanner(cfg, dtype=torch.float32, page_size=8, ring_capacity=8, max_num_tokens=8, max_model_len=64,
                   options=opts)
    assert p.backend.options is opts.kernel
    sched = p.backend.schedule(4, 4, 16, 1, True)
    assert sched.select_decode.options is opts.kernel and sched.attention.options is opts.kernel
    with pytest.raises(TypeError, match="kernel must be a qsa_kernels.options.KernelOptions, got dict"):
        QSAOptions(kernel={"pdl": 0})  # type: ignore[arg-type]
