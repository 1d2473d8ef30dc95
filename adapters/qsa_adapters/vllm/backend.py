"""The vLLM attention backend of QSA layers: batch order, per-group step records, layouts.

QSA layers run `qsa_core` themselves, so the backend has no `AttentionImpl`. Its builder
asks vLLM to put decodes first (`reorder_batch_threshold` = 1 + speculative tokens) and
returns a `QSAStepMetadata` per KV-cache group. A QSA layer resolves its group's record
with the ring group's into one `QSAPlan`, planned once per step and shared by every layer
with the same cache geometry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from qsa_core import QSAConfig, QSAPlan

from .metadata import PagedGeometry, QSAMetadataMapper

BACKEND_NAME = "QSA_CORE"


@dataclass
class QSAStepMetadata(AttentionMetadata):
    """One KV-cache group's record of a step, as vLLM hands it to each layer of the group."""

    common: CommonAttentionMetadata
    builder: "QSAStepMetadataBuilder"
    _resolved: dict = field(default_factory=dict, repr=False)

    def resolve(
        self, ring: "QSAStepMetadata", geometry: PagedGeometry, rope_positions: torch.Tensor,
        config: QSAConfig, dtype: torch.dtype,
    ) -> QSAPlan:
        """The step's `QSAPlan` from this (main) group and the ring group.

        Planned on the first call and reused by every later layer of the step that shares
        the geometry. rope_positions: the model's positions, int64 [>= T] or [3, >= T];
        config, dtype: the layer's `QSAConfig` and model dtype.
        """
        key = (geometry, config, id(ring))
        if key not in self._resolved:
            self._resolved[key] = self.builder.mapper(geometry, config, dtype).map(
                self.common,
                ring.common.block_table_tensor,
                decode_threshold=self.builder.reorder_batch_threshold,
                rope_positions=rope_positions,
            )
        return self._resolved[key]


class QSAStepMetadataBuilder(AttentionMetadataBuilder[QSAStepMetadata]):
    """Records each group's `CommonAttentionMetadata`; asks vLLM for decodes first."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self._mappers: dict[tuple, QSAMetadataMapper] = {}

    def mapper(self, geometry: PagedGeometry, config: QSAConfig, dtype: torch.dtype) -> QSAMetadataMapper:
        key = (geometry, config, dtype)
        if key not in self._mappers:
            sched = self.vllm_config.scheduler_config
            model = self.vllm_config.model_config
            self._mappers[key] = QSAMetadataMapper(
                geometry, config, dtype, self.device,
                max_num_tokens=sched.max_num_batched_tokens if sched is not None else 256,
                max_model_len=model.max_model_len if model is not None else 4096,
            )
        return self._mappers[key]

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> QSAStepMetadata:
        return QSAStepMetadata(common=common_attn_metadata, builder=self)


class QSACoreBackend(AttentionBackend):
    """Backend of QSA attention layers and their side caches (no AttentionImpl)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("QSA layers run qsa_core themselves: QSA_CORE has no AttentionImpl")

    @staticmethod
    def get_builder_cls() -> type[QSAStepMetadataBuilder]:
        return QSAStepMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # The ring and compressed pages differ in size from the main page and sit in two
        # KV-cache groups: vLLM packs such pages side by side only block-outermost.
        return (KVCacheLayout.BLNHC, KVCacheLayout.BLHNC)
