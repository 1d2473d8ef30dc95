"""qsa_kernels: Triton kernels behind `qsa_core.ops`, one per reference op, same names.

Modules load lazily (on first use of an op) so that importing qsa_core never compiles or
even imports Triton on the CPU path.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "qsa_build_metadata": "metadata",
    "qsa_store_rows": "prepare",
    "qsa_store_kv": "prepare",
    "qsa_compress_groups": "prepare",
    "qsa_prepare": "prepare",
    "qsa_expand": "expand",
    "qsa_select_decode": "select",
    "qsa_select_prefill": "select",
    "qsa_sparse_attention": "attention",
}

__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'qsa_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value
