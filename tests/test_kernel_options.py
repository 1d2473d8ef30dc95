"""`KernelOptions`: checked fields, the interpreter's constructor, and the environment mapping
the planner reads once (`planner.kernel_options_from_env`)."""

from __future__ import annotations

import pytest

from qsa_core.planner import kernel_options_from_env
from qsa_kernels.options import KernelOptions

ENV = ("TRITON_INTERPRET", "QSA_FAST_LAUNCH", "QSA_PDL", "QSA_DECODE_SAMPLES", "QSA_SHARED_PREFILL", "QSA_L2_WARM")


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


def test_the_environment_maps_onto_the_fields(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    assert kernel_options_from_env() == KernelOptions()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_options_from_env() == KernelOptions.for_interpreter()
    for name, raw, field, want in (("QSA_FAST_LAUNCH", "0", "fast_launch", False), ("QSA_PDL", "1", "pdl", 1),
                                   ("QSA_PDL", "0", "pdl", 0), ("QSA_SHARED_PREFILL", "0", "shared_prefill", False),
                                   ("QSA_DECODE_SAMPLES", "0", "decode_samples", False),
                                   ("QSA_L2_WARM", "0", "l2_warm", False)):
        monkeypatch.setenv(name, raw)
        assert getattr(kernel_options_from_env(), field) == want, (name, raw)
        monkeypatch.delenv(name)
    monkeypatch.setenv("QSA_PDL", "3")
    with pytest.raises(ValueError, match="QSA_PDL must be 0, 1 or 2, got '3'"):
        kernel_options_from_env()
