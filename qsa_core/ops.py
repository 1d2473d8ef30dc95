"""The op API: one function per op of SPEC.md section 5, dispatched per call.

CUDA tensors run the Triton kernels of `qsa_kernels`; everything else runs the reference.
`QSA_BACKEND=reference` or `QSA_BACKEND=triton` overrides the choice (with
`TRITON_INTERPRET=1`, `triton` runs the kernels on CPU tensors).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from . import reference

BACKENDS = ("reference", "triton")


def backend_for(device: torch.device) -> str:
    """The backend an op on `device` runs with (env override first)."""
    choice = os.environ.get("QSA_BACKEND", "")
    if choice:
        if choice not in BACKENDS:
            raise ValueError(f"QSA_BACKEND must be one of {BACKENDS}, got {choice!r}")
        return choice
    return "triton" if device.type == "cuda" else "reference"


def _impl(name: str, device: torch.device) -> Callable[..., Any]:
    if backend_for(device) == "triton":
        import qsa_kernels

        return getattr(qsa_kernels, name)
    return getattr(reference, name)


def _op(name: str) -> Callable[..., Any]:
    """The op `name`, dispatched on the device of its first argument."""
    ref = getattr(reference, name)

    def op(*args: Any, **kwargs: Any) -> Any:
        return _impl(name, args[0].device)(*args, **kwargs)

    op.__name__ = name
    op.__doc__ = ref.__doc__
    return op


build_metadata = _op("qsa_build_metadata")
store_rows = _op("qsa_store_rows")
store_kv = _op("qsa_store_kv")
compress_groups = _op("qsa_compress_groups")
prepare = _op("qsa_prepare")
select_decode = _op("qsa_select_decode")
select_prefill = _op("qsa_select_prefill")
expand = _op("qsa_expand")
sparse_attention = _op("qsa_sparse_attention")
