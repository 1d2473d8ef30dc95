"""qsa_core: the engine-neutral definition of QSA (Qwen Sparse Attention).

Config and cache layouts are validated once; `QSAForwardMetadata` is built once per step;
`qsa_core.ops` holds the op API (reference in `qsa_core.reference`, Triton in
`qsa_kernels`); `QSAAttention` is a whole layer; `standalone.Runner` runs it with no engine.
"""

from .cache import QSACacheLayout, QSALayerCache, ring_capacity, validate_layer_cache
from .config import QSAConfig
from .layer import QSAAttention, QSANormWeights, qsa_attend, qsa_select
from .metadata import QSAForwardMetadata, QSAMetadataBuilder

__all__ = [
    "QSAAttention",
    "QSACacheLayout",
    "QSAConfig",
    "QSAForwardMetadata",
    "QSALayerCache",
    "QSAMetadataBuilder",
    "QSANormWeights",
    "qsa_attend",
    "qsa_select",
    "ring_capacity",
    "validate_layer_cache",
]
