"""The ops backend protocol: what a planner and the layer halves ask of a backend.

A planner picks one backend object when it is made (`qsa_core.backends.create`) and keeps
it. The backend sizes and allocates its part of the workspace (`__init__`), schedules a
step shape (`schedule`), builds a step's derived metadata (`build_metadata`), copies a static
step into the planner's buffers (`stage`) and binds a schedule to a layer cache (`bind`):
the `LayerLaunches` it returns run the three layer parts (prepare, select, attention) and
only launch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..cache import QSALayerCache, validate_layer_cache

if TYPE_CHECKING:
    from ..inputs import QSAStepInputs
    from ..layer import QSANormWeights
    from ..planner import QSAPlan, QSAPlanner

NO_BOUND = 1 << 62  # num_slots / num_ring_rows of a planner made without them


class KernelSchedule(NamedTuple):
    """A backend's part of a step schedule: the prepare outputs q_idx [T, Hi, Di] (index
    dtype) and q [T, Hq, D] (workspace views; None where prepare returns new tensors), the
    decode and prefill select schedules and the attention schedule (None where unused)."""

    q_idx: torch.Tensor | None = None
    q: torch.Tensor | None = None
    select_decode: Any = None
    select_prefill: Any = None
    attention: Any = None


class LayerLaunches(ABC):
    """The three layer parts of one step shape on one layer cache; launches only.

    Inputs have exactly the plan's T rows (the layer trims engines' padded buffers).
    """

    @abstractmethod
    def prepare(self, plan: "QSAPlan", norms: "QSANormWeights", index_qk: torch.Tensor, q_gate: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused write side: compressed keys, ring rows, K/V. index_qk [T, (Hi+1)*Di],
        q_gate [T, Hq*2D], k, v [T, Hkv*D] (model dtype) -> q_idx [T, Hi, Di] (index dtype),
        q and gate [T, Hq, D]."""

    @abstractmethod
    def select(self, plan: "QSAPlan", q_idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode and prefill top-k, then expansion: q_idx [T, Hi, Di] -> out int32 [T, W + 1]."""

    @abstractmethod
    def attention(self, plan: "QSAPlan", q: torch.Tensor, gate: torch.Tensor, selection: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
        """Gated sparse attention: q, gate [T, Hq, D], selection int32 [T, W + 1] -> out
        [T, Hq*D] (model dtype)."""

    def bind_all(self, plan: "QSAPlan", norms: "QSANormWeights", index_qk: torch.Tensor, q_gate: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        """Bind every launch of the three parts now, launching none (compiles on a GPU);
        nothing to do where nothing binds."""


class QSABackend(ABC):
    """An ops backend, one object per planner (module docstring). `name`: "reference" or
    "triton"; `compiles`: whether binding compiles kernels (the warm-up's work)."""

    name: str
    compiles: bool

    @abstractmethod
    def __init__(self, planner: "QSAPlanner") -> None:
        """Allocate this backend's workspace for the planner's sizes (once: CUDA graphs keep
        its addresses); the planner's own buffers (derived fields, flags) exist already."""

    @abstractmethod
    def schedule(self, num_tokens: int, num_decode_tokens: int, num_cols: int, decode_query_len: int,
                 decode_only: bool) -> KernelSchedule:
        """The schedule of one step shape (cached by the planner)."""

    @abstractmethod
    def build_metadata(self, inputs: "QSAStepInputs", tensors: tuple[torch.Tensor, ...], num_live_rows: int,
                       derived: dict[str, torch.Tensor]) -> None:
        """The step's derived per-row fields into `derived` (views [T] of the workspace), with
        the guards; no host read. tensors: (query_start_loc, seq_lens, slot_mapping,
        ring_index, block_table) as the plan uses them (the static copies or the engine's)."""

    @abstractmethod
    def stage(self, inputs: "QSAStepInputs", static: dict[str, torch.Tensor]) -> tuple:
        """Copy the step's tensors into the planner's static buffers; returns
        (query_start_loc, seq_lens, block_table, slot_mapping, ring_index, rope_positions or
        None) as views of them."""

    @abstractmethod
    def bind(self, plan: "QSAPlan", cache: QSALayerCache) -> LayerLaunches:
        """The layer parts of the plan's step shape on `cache` (the planner caches them per
        schedule and cache)."""

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def check_binding(plan: "QSAPlan", cache: QSALayerCache, index_qk: torch.Tensor, q_gate: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> None:
    """The write side's cache and projections against the plan, once per (schedule, cache):
    the stores are bounded by these shapes (K's slots for V, the plan's C for the ring, the
    projections' head counts for the caches') and cast to the caches' dtypes; the projections
    must be in the model dtype (the kernels compute in their inputs' precision)."""
    meta, cfg = plan.meta, plan.config
    validate_layer_cache(cache, cfg, meta.page_size, meta.ring_capacity, dtype=plan.dtype)
    split = cfg.index_n_heads * cfg.index_head_dim
    widths = (("index_qk", index_qk, split + cfg.index_head_dim), ("q_gate", q_gate, 2 * cfg.num_heads * cfg.head_dim),
              ("k", k, cfg.num_kv_heads * cfg.head_dim), ("v", v, cfg.num_kv_heads * cfg.head_dim))
    for name, x, width in widths:
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"{name} must be [T, {width}] for this layer's heads, got {tuple(x.shape)}")
        if x.dtype != plan.dtype:
            raise ValueError(f"{name} must be {plan.dtype} (the model dtype the plan was made for), got {x.dtype}")


class EmptyLaunches(LayerLaunches):
    """A step of no rows: the write side is checked, nothing runs."""

    def __init__(self, cache: QSALayerCache) -> None:
        self.cache = cache
        self.checked = False

    def prepare(self, plan, norms, index_qk, q_gate, k, v):
        if not self.checked:
            check_binding(plan, self.cache, index_qk, q_gate, k, v)
            self.checked = True
        cfg = plan.config
        q_idx = torch.empty(0, cfg.index_n_heads, cfg.index_head_dim, dtype=plan.index_dtype, device=q_gate.device)
        q = torch.empty(0, cfg.num_heads, cfg.head_dim, dtype=q_gate.dtype, device=q_gate.device)
        return q_idx, q, q_gate.view(0, cfg.num_heads, 2 * cfg.head_dim)[..., cfg.head_dim:]

    def select(self, plan, q_idx, out):
        return out

    def attention(self, plan, q, gate, selection, out):
        return out
