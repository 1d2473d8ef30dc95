"""`QSAOptions`: every switch of the core and of the kernels, typed, held by the planner.

`QSAOptions.from_env()` is the one place QSA reads the environment (`qsa_kernels` reads none;
an empty value counts as unset; any other value not listed raises, naming the variable):

- `QSA_BACKEND=reference|triton`: the ops backend (unset: Triton for CUDA tensors, the
  reference otherwise).
- `QSA_DEBUG=1`: read every step's values in `plan` and raise on malformed ones (a device
  sync on a GPU).
- `TRITON_INTERPRET=0|1`: 1: Triton runs in its interpreter (CPU tensors): the kernels take
  `KernelOptions.for_interpreter()`, the triton backend may take CPU tensors and the start-up
  warm-up skips binding (nothing compiles).
- The kernels' switches (`qsa_kernels.options.KernelOptions`, whose fields say why each is
  flipped): `QSA_FAST_LAUNCH=0|1` -> fast_launch; `QSA_PDL=0|1|2` -> pdl;
  `QSA_DECODE_SAMPLES=auto|0|1` -> decode_samples (0: off); `QSA_SHARED_PREFILL=0|1` ->
  shared_prefill; `QSA_L2_WARM=0|1` -> l2_warm. Unset: the defaults (production on a GPU).

A planner made without options takes `from_env()` when it is made; pass options to pin them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from qsa_kernels.options import KernelOptions

BACKEND_NAMES = ("reference", "triton")
BackendName = Literal["reference", "triton"]
# Kernel switch variable -> (KernelOptions field, its value for each allowed setting).
_KERNEL_ENV: dict[str, tuple[str, dict[str, object]]] = {
    "QSA_FAST_LAUNCH": ("fast_launch", {"0": False, "1": True}),
    "QSA_PDL": ("pdl", {"0": 0, "1": 1, "2": 2}),
    "QSA_DECODE_SAMPLES": ("decode_samples", {"auto": True, "0": False, "1": True}),
    "QSA_SHARED_PREFILL": ("shared_prefill", {"0": False, "1": True}),
    "QSA_L2_WARM": ("l2_warm", {"0": False, "1": True}),
}


@dataclass(frozen=True)
class QSAOptions:
    """backend: "reference", "triton" or None (by device: Triton for CUDA tensors);
    value_checks: read each step's values in `plan` (None: on for CPU tensors, where it costs
    no sync); debug: value checks everywhere (`QSA_DEBUG`), whatever value_checks says;
    kernel: the Triton kernels' routes, tiles and launch switches (`KernelOptions`; its
    `interpreter` field says Triton runs in its interpreter); the reference backend ignores
    them."""

    backend: BackendName | None = None
    value_checks: bool | None = None
    debug: bool = False
    kernel: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES} or None, got {self.backend!r}")
        if not isinstance(self.kernel, KernelOptions):
            raise TypeError(f"kernel must be a qsa_kernels.options.KernelOptions, got {type(self.kernel).__name__}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "QSAOptions":
        """The options the environment asks for (the variables of this module's docstring)."""
        backend = environ.get("QSA_BACKEND", "") or None
        if backend is not None and backend not in BACKEND_NAMES:
            raise ValueError(f"QSA_BACKEND must be one of {BACKEND_NAMES}, got {backend!r}")
        kernel = {name: _setting(environ, var, values) for var, (name, values) in _KERNEL_ENV.items()
                  if environ.get(var, "")}
        interpret = _setting(environ, "TRITON_INTERPRET", {"0": False, "1": True}) \
            if environ.get("TRITON_INTERPRET", "") else False
        return cls(backend=backend, debug=environ.get("QSA_DEBUG", "0") not in ("", "0"),
                   kernel=KernelOptions.for_interpreter(**kernel) if interpret else KernelOptions(**kernel))


def _setting(environ: Mapping[str, str], var: str, values: dict[str, object]) -> object:
    """The value the (set, non-empty) variable `var` maps to in `values`, else a ValueError
    naming it and the allowed settings."""
    raw = environ[var]
    if raw not in values:
        raise ValueError(f"{var} must be one of {', '.join(values)} (or unset), got {raw!r}")
    return values[raw]


def debug_enabled() -> bool:
    """`QSA_DEBUG=1` in the environment now (`QSAOptions.from_env().debug`)."""
    return QSAOptions.from_env().debug
