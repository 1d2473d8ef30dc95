"""Ops backends as objects: `reference` (pure PyTorch, the definition) and `triton`
(`qsa_kernels`), behind one protocol (`base.QSABackend`). A planner resolves its backend
once (`resolve_backend`) and makes one object of it (`create`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..options import QSAOptions
from .base import KernelSchedule, LayerLaunches, QSABackend
from .reference import ReferenceBackend
from .triton import TritonBackend

if TYPE_CHECKING:
    from ..planner import QSAPlanner

__all__ = ["KernelSchedule", "LayerLaunches", "QSABackend", "create", "resolve_backend"]


def resolve_backend(device: torch.device, options: QSAOptions) -> str:
    """The backend name for tensors on `device`: options.backend, else Triton on CUDA and
    the reference otherwise. Triton on CPU tensors needs the interpreter
    (options.kernel.interpreter, TRITON_INTERPRET=1): a compiled kernel would read CPU
    addresses on the GPU."""
    choice = options.backend
    if choice is None:
        return "triton" if device.type == "cuda" else "reference"
    if choice == "triton" and device.type == "cpu" and not options.kernel.interpreter:
        raise ValueError("the triton backend on CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter); "
                         "use the reference backend on the CPU or put the tensors on a GPU")
    return choice


def create(planner: "QSAPlanner") -> QSABackend:
    """The backend object of a planner (its options and device; its buffers exist)."""
    name = resolve_backend(planner.device, planner.options)
    return (TritonBackend if name == "triton" else ReferenceBackend)(planner)
