"""qsa_core: the engine-neutral definition of QSA (Qwen Sparse Attention).

Config and cache layouts are validated once; an engine describes each step as
`QSAStepInputs`, a `QSAPlanner` (one per engine) turns it into a `QSAPlan` once per step,
and the layer halves `qsa_indexer` / `qsa_attention` only launch on it. Each op has one
definition, its reference in `qsa_core.reference`, and one production kernel, a bound Triton
launch in `qsa_kernels`; the planner's backend object (`qsa_core.backends`) runs one or the
other, and `QSAOptions` holds the core's switches. `QSAAttention` is a whole layer;
`standalone.Runner` runs it with no engine.
"""

from .cache import QSACacheLayout, QSALayerCache, check_page_size, ring_capacity, validate_layer_cache
from .config import QSAConfig, resolve_dtype
from .inputs import QSAStepInputs
from .layer import GemmaRMSNorm, QSAAttention, QSAIndexed, QSANormWeights, qsa_attention, qsa_indexer, qsa_prepare, qsa_select
from .metadata import QSAForwardMetadata
from .options import QSAOptions, debug_enabled
from .planner import QSAPlan, QSAPlanner

__all__ = [
    "GemmaRMSNorm",
    "QSAAttention",
    "QSACacheLayout",
    "QSAConfig",
    "QSAForwardMetadata",
    "QSAIndexed",
    "QSALayerCache",
    "QSANormWeights",
    "QSAOptions",
    "QSAPlan",
    "QSAPlanner",
    "QSAStepInputs",
    "check_page_size",
    "debug_enabled",
    "qsa_attention",
    "qsa_indexer",
    "qsa_prepare",
    "qsa_select",
    "resolve_dtype",
    "ring_capacity",
    "validate_layer_cache",
]
