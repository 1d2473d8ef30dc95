"""qsa_core: the engine-neutral definition of QSA (Qwen Sparse Attention).

Config and cache layouts are validated once; an engine describes each step as
`QSAStepInputs`, a `QSAPlanner` (one per engine) turns it into a `QSAPlan` once per step,
and the layer halves `qsa_indexer` / `qsa_attention` only launch on it. `qsa_core.ops`
holds the op API (reference in `qsa_core.reference`, Triton in `qsa_kernels`);
`QSAAttention` is a whole layer; `standalone.Runner` runs it with no engine.
"""

from .cache import QSACacheLayout, QSALayerCache, check_page_size, ring_capacity, validate_layer_cache
from .config import QSAConfig, resolve_dtype
from .inputs import QSAStepInputs, debug_enabled
from .layer import GemmaRMSNorm, QSAAttention, QSAIndexed, QSANormWeights, qsa_attention, qsa_indexer, qsa_prepare, qsa_select
from .metadata import QSAForwardMetadata
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
