"""`QSAOptions`: every switch of the core, typed, held by the planner.

`QSAOptions.from_env()` is the one place the core reads the environment:

- `QSA_BACKEND=reference|triton`: the ops backend (unset: Triton for CUDA tensors, the
  reference otherwise).
- `QSA_DEBUG=1`: read every step's values in `plan` and raise on malformed ones (a device
  sync on a GPU).
- `TRITON_INTERPRET=1`: Triton runs in its interpreter (CPU tensors); the triton backend on
  CPU tensors needs it, and the start-up warm-up skips binding (nothing compiles).

A planner made without options takes `from_env()` when it is made; pass options to pin them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

BACKEND_NAMES = ("reference", "triton")
BackendName = Literal["reference", "triton"]


@dataclass(frozen=True)
class QSAOptions:
    """backend: "reference", "triton" or None (by device: Triton for CUDA tensors);
    value_checks: read each step's values in `plan` (None: on for CPU tensors, where it costs
    no sync); debug: value checks everywhere (`QSA_DEBUG`), whatever value_checks says;
    interpret: Triton runs in its interpreter (`TRITON_INTERPRET`); kernel: the kernels'
    options (passed through to qsa_kernels, None: their defaults)."""

    backend: BackendName | None = None
    value_checks: bool | None = None
    debug: bool = False
    interpret: bool = False
    kernel: Any = None

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES} or None, got {self.backend!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "QSAOptions":
        """The options the environment asks for: QSA_BACKEND, QSA_DEBUG, TRITON_INTERPRET."""
        backend = environ.get("QSA_BACKEND", "") or None
        if backend is not None and backend not in BACKEND_NAMES:
            raise ValueError(f"QSA_BACKEND must be one of {BACKEND_NAMES}, got {backend!r}")
        return cls(backend=backend, debug=environ.get("QSA_DEBUG", "0") not in ("", "0"),
                   interpret=environ.get("TRITON_INTERPRET", "0") == "1")


def debug_enabled() -> bool:
    """`QSA_DEBUG=1` in the environment now (`QSAOptions.from_env().debug`)."""
    return QSAOptions.from_env().debug
