"""Pure-PyTorch references: the definition of every QSA op (design.md §5).

Each op's Triton form is a bound launch in `qsa_kernels` (run by `qsa_core.backends.triton`)
that must match its reference here.
"""

from .attention import qsa_sparse_attention
from .expand import qsa_expand
from .metadata import qsa_build_metadata
from .prepare import qsa_compress_groups, qsa_prepare, qsa_store_kv, qsa_store_rows
from .select import qsa_select_decode, qsa_select_prefill

__all__ = [
    "qsa_build_metadata",
    "qsa_compress_groups",
    "qsa_expand",
    "qsa_prepare",
    "qsa_select_decode",
    "qsa_select_prefill",
    "qsa_sparse_attention",
    "qsa_store_kv",
    "qsa_store_rows",
]
