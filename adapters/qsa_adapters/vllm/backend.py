"""The vLLM attention backend of QSA layers: batch order, the step record, layouts.

QSA layers run `qsa_core` themselves, so the backend has no `AttentionImpl`. vLLM calls one
builder per KV-cache group and step: the main group's (main K/V + compressed keys: block
table, slot mapping, positions) and the ring group's (one ring block per request). The two
halves meet in one `QSAStep` per step; the builder call that completes it maps the step onto
the core's `QSAStepInputs` and plans it (`QSAPlanner.plan`), once, before any layer runs.
Every layer then launches on that plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
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
from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from qsa_core import QSAConfig, QSAPlan
from qsa_core.guard import GuardWatch
from qsa_core.warmup import start_up_warm

from .metadata import NULL_BLOCK, PagedGeometry, QSAMetadataMapper

BACKEND_NAME = "QSA_CORE"
logger = logging.getLogger(__name__)


@dataclass
class QSAStep:
    """One scheduler step's two halves and, once both are in, its plan per geometry."""

    main: CommonAttentionMetadata | None = None
    ring_block_table: torch.Tensor | None = None  # int32 [>= R, 1]
    records: dict[PagedGeometry, QSAPlan] = field(default_factory=dict)
    # the plans with the model's 3-axis MRoPE positions, made by the step's first layer
    mrope_records: dict[PagedGeometry, QSAPlan] = field(default_factory=dict)

    def record(self, geometry: PagedGeometry, mrope_positions: torch.Tensor | None = None) -> QSAPlan:
        """The step's plan for `geometry`; with mrope_positions (int64 [3, >= T], the positions
        vLLM hands the model under MRoPE) the plan with those as its rope positions."""
        if geometry not in self.records:
            raise RuntimeError(
                "QSA step record missing: vLLM built the main and ring KV-cache groups' metadata "
                f"for different steps (or not both); geometry {geometry}"
            )
        plan = self.records[geometry]
        if mrope_positions is None:
            return plan
        found = self.mrope_records.get(geometry)
        if found is None:
            found = self.mrope_records[geometry] = with_mrope_positions(plan, mrope_positions)
        return found


def with_mrope_positions(plan: QSAPlan, positions: torch.Tensor) -> QSAPlan:
    """`plan` with rope positions [3, T] from vLLM's MRoPE positions int64 [3, >= T] (once per step).

    vLLM computes MRoPE positions in its model runner and hands them to the model only; the
    step metadata carries the logical positions. The core rotates queries, keys and group keys
    (and stores ring positions) at the plan's rope positions, so every layer of the step must
    see these."""
    T = plan.num_tokens
    if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] < T or positions.dtype != torch.int64:
        raise ValueError(
            f"MRoPE positions must be int64 [3, >= {T}] (vLLM's mrope_positions), got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    return replace(plan, meta=replace(plan.meta, rope_positions=positions[:, :T]))


@dataclass
class QSAStepMetadata(AttentionMetadata):
    """What vLLM hands each layer of a group: the step both groups' builders share."""

    step: QSAStep


@dataclass(frozen=True)
class BoundLayers:
    """What the engine's QSA layers of one geometry share: their config and model dtype, and
    the bounds every step's metadata must stay within (the smallest bound layer's main K/V
    slots and ring rows)."""

    config: QSAConfig
    dtype: torch.dtype
    num_slots: int
    num_ring_rows: int


class QSAStepPairing:
    """Joins the main and ring groups' builds of a step into one `QSAStep` (one per engine)."""

    _by_engine: ClassVar[dict[int, "QSAStepPairing"]] = {}

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.decode_threshold = 1
        self.mappers: dict[PagedGeometry, QSAMetadataMapper] = {}
        # planner sizes (the mapper plans larger if a step exceeds them)
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        model = vllm_config.model_config
        self.max_model_len = model.max_model_len if model is not None else self.max_num_tokens
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.device = device
        self.current = QSAStep()
        self.last_ring_block_table: torch.Tensor | None = None  # the last target step's
        self._draft_ring: torch.Tensor | None = None  # `_draft_rings`' table
        self._geometries: dict[PagedGeometry, BoundLayers] = {}
        self._layers: list | None = None  # the engine's QSA layers, found at the first step
        self._key_caches: tuple | None = None  # `_bound_key` of the caches the geometries were derived from
        self._key: torch.Tensor | None = None
        # Logs the requests the device guards made inert (by batch index), a step or more late.
        self.guard_watch = GuardWatch()

    @classmethod
    def of(cls, vllm_config: VllmConfig, device: torch.device) -> "QSAStepPairing":
        key = id(vllm_config.compilation_config.static_forward_context)
        if key not in cls._by_engine:
            cls._by_engine[key] = cls(vllm_config, device)
        return cls._by_engine[key]

    def _bound_key(self) -> tuple[tuple[int, int], ...]:
        """(data_ptr, numel) of the cache bound to each of the engine's QSA layers: changes when
        vLLM binds new caches (it captures CUDA graphs against a throw-away minimal cache, then
        allocates the real one)."""
        if self._layers is None:
            context = self.vllm_config.compilation_config.static_forward_context
            self._layers = [layer for layer in context.values() if getattr(layer, "indexer", None) is not None]
        caches = (getattr(layer, "kv_cache", None) for layer in self._layers)
        return tuple((c.data_ptr(), c.numel()) if isinstance(c, torch.Tensor) else (0, 0) for c in caches)

    def geometries(self) -> dict[PagedGeometry, BoundLayers]:
        """The paged geometries of the engine's bound QSA layers (one in practice), each with
        what its layers share and the bounds of the caches bound now. Derived again, with new
        planners, whenever vLLM binds other caches (`_bound_key`): bounds kept from a first,
        smaller allocation would make every request of the real one inert."""
        key = self._bound_key()
        if key != self._key_caches:
            self._geometries, self.mappers, self._key_caches = {}, {}, key
            for layer in self._layers:
                if getattr(layer, "kv_cache", None) is not None and layer.kv_cache.numel():
                    cache, geometry = layer.indexer.layer_cache(layer.kv_cache, layer._k_scale_float,
                                                                layer._v_scale_float)
                    slots, rows = cache.k.shape[0] * geometry.page_size, cache.ring.shape[0]
                    if geometry in self._geometries:
                        seen = self._geometries[geometry]
                        slots, rows = min(slots, seen.num_slots), min(rows, seen.num_ring_rows)
                    self._geometries[geometry] = BoundLayers(layer.indexer.qsa_config, layer.indexer.dtype, slots, rows)
        return self._geometries

    def _warm(self, geometry: PagedGeometry, mapper: QSAMetadataMapper) -> None:
        """Compile every kernel variant the new mapper's steps can choose, on its geometry's
        bound layer caches (`warmup.start_up_warm`: static steps of 1 and decode_threshold
        rows per decode request; Triton's cache makes a rebuild's warm-up cheap)."""
        bound = (layer.indexer.layer_cache(layer.kv_cache, layer._k_scale_float, layer._v_scale_float)
                 for layer in self._layers if getattr(layer, "kv_cache", None) is not None and layer.kv_cache.numel())
        caches = [cache for cache, g in bound if g == geometry]
        line = start_up_warm(mapper.planner, caches, decode_query_lens=(1, self.decode_threshold))
        if line is not None:
            logger.info(line)

    def add(self, common: CommonAttentionMetadata, *, is_ring: bool) -> QSAStep:
        """Record one group's half; the half that completes the step plans it (once per geometry).

        Both halves of a step carry the same `query_start_loc` tensor (vLLM copies one base
        record per group), which identifies the step.
        """
        if self._key is not common.query_start_loc:
            self.current, self._key = QSAStep(), common.query_start_loc
        step = self.current
        if is_ring:
            step.ring_block_table = self.last_ring_block_table = common.block_table_tensor
        else:
            step.main = common
        if step.main is not None and step.ring_block_table is not None:
            self._plan(step)
        return step

    def add_draft(self, common: CommonAttentionMetadata) -> QSAStep:
        """Plan a draft step of speculative decoding (vLLM's proposer builds only the draft
        layers' main group): its requests are the last target step's, in the same order, so
        their rings are that step's ring blocks. Rope positions are the logical ones: the
        proposer advances `seq_lens` and the slots between draft steps, not `positions`.

        A draft step of more requests than that step (vLLM 0.33's GPU runner pads each draft
        step to a CUDA-graph size of its own, and captures its draft graphs after the target's
        smallest) has padding requests past them: they take vLLM's null block (`NULL_BLOCK`), as
        its dummy requests do, from a persistent table (`_draft_rings`, no allocation a step)."""
        ring = self.last_ring_block_table
        if ring is None:
            raise RuntimeError("QSA draft step before any target step: no ring blocks to draft on")
        if ring.shape[0] < common.num_reqs:
            ring = self._draft_rings(ring, common.num_reqs)
        step = QSAStep(main=replace(common, positions=None), ring_block_table=ring)
        self._plan(step)
        return step

    def _draft_rings(self, ring: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """int32 [num_reqs, blocks]: ring's rows, then NULL_BLOCK for the padding requests past them."""
        if num_reqs > self.max_num_reqs:
            raise RuntimeError(f"QSA draft step of {num_reqs} requests: expected at most max_num_seqs = "
                               f"{self.max_num_reqs}")
        if self._draft_ring is None or self._draft_ring.shape[1] != ring.shape[1]:
            self._draft_ring = torch.full((self.max_num_reqs, ring.shape[1]), NULL_BLOCK, dtype=ring.dtype,
                                          device=ring.device)
        table = self._draft_ring[:num_reqs]
        table[: ring.shape[0]].copy_(ring, non_blocking=True)
        table[ring.shape[0]:].fill_(NULL_BLOCK)
        return table

    def _plan(self, step: QSAStep) -> None:
        """Plan a step whose two halves are in, once per geometry."""
        for geometry, bound in self.geometries().items():
            if geometry not in self.mappers:
                self.mappers[geometry] = QSAMetadataMapper(
                    geometry, bound.config, bound.dtype, self.device,
                    max_num_tokens=self.max_num_tokens, max_model_len=self.max_model_len,
                    max_num_reqs=self.max_num_reqs, num_slots=bound.num_slots, num_ring_rows=bound.num_ring_rows,
                )
                self._warm(geometry, self.mappers[geometry])
            step.records[geometry] = self.mappers[geometry].map(
                step.main, step.ring_block_table, decode_threshold=self.decode_threshold
            )
            self.guard_watch.poll(self.mappers[geometry].planner, step.main.num_reqs)


class QSAStepMetadataBuilder(AttentionMetadataBuilder[QSAStepMetadata]):
    """Plans the step in `build()`; asks vLLM for decodes first.

    CUDA graphs: every step is planned static (the plan's tensors live in the planner's
    persistent buffers, refreshed in place by each build), and a uniform batch (decodes of
    one query length; padding requests of length 0 and rows with slot -1 are inert) maps onto
    a fixed schedule (run under vLLM 0.33's graphs on the H200: `scripts/gpu_vllm.py`).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        specs = getattr(kv_cache_spec, "kv_cache_specs", {"": kv_cache_spec})  # UniformTypeKVCacheSpecs
        self.is_ring = all(isinstance(spec, CircularBufferSpec) for spec in specs.values())
        # A builder of draft layers only (vLLM marks them `is_draft_layer` before it makes the
        # speculator's builders): vLLM 0.33's GPU runner builds its draft steps with `build`.
        context = vllm_config.compilation_config.static_forward_context
        self.is_draft = bool(layer_names) and all(
            getattr(context.get(name), "is_draft_layer", False) for name in layer_names
        )
        self.pairing = QSAStepPairing.of(vllm_config, device)
        self.pairing.decode_threshold = self.reorder_batch_threshold

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> QSAStepMetadata:
        if self.is_draft:
            return self.build_for_drafting(common_attn_metadata, 0)
        return QSAStepMetadata(step=self.pairing.add(common_attn_metadata, is_ring=self.is_ring))

    def build_for_drafting(self, common_attn_metadata: CommonAttentionMetadata, draft_index: int) -> QSAStepMetadata:
        """A draft step (MTP): only the draft layers' main group is built (`QSAStepPairing.add_draft`)."""
        if self.is_ring:
            raise RuntimeError("QSA: vLLM's proposer built a ring group: a draft layer's ring must be a target layer's")
        return QSAStepMetadata(step=self.pairing.add_draft(common_attn_metadata))


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
