"""`QSACoreBackend`: SGLang's attention-backend interface for the QSA layers, served by `qsa_core`.

SGLang builds it for `--attention-backend qsa_core` (through `plugin.create_backend`) and
the wrapper hook keeps it as the full-attention child of `HybridLinearAttnBackend`. The
layer hook (`hooks.py`) computes the projections with the layer's own linear modules and
calls `layer.attn(...)` with `qsa_inputs=QSALayerInputs(...)`; `forward_extend` /
`forward_decode` then run the core's layer halves `qsa_indexer` (prepare, selection,
expansion) and `qsa_attention` (sparse attention, gate) over views of SGLang's
`QSATokenToKVPool` and return `[rows, Hq * D]`.

Metadata: `init_forward_metadata` maps the batch eagerly (`batch_map`) and plans the step
(`QSAPlanner.plan`) on the eager planner, built and warmed at start-up for the largest eager
step (`eager.eager_max_tokens`); CUDA graphs use the static buffers of
`cuda_graph.GraphInputs` and a planner sized for the graphs, refreshed in place by
`init_forward_metadata_out_graph` (decode and target-verify graphs). After each plan a `GuardWatch` copies the device guards'
flags without a sync and logs, a step or more later, each request they made inert and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from qsa_core import QSAConfig, QSALayerCache, QSANormWeights, QSAPlan, QSAPlanner, qsa_attention, qsa_indexer
from qsa_core.guard import GuardWatch
from qsa_core.warmup import start_up_warm
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from .batch_map import DECODE_LIKE, step_inputs
from .caches import check_pool, checked_layer_cache, layer_cache
from .checks import model_qsa_config
from .cuda_graph import GraphInputs
from .eager import eager_max_tokens, schedule_bounds
from .ring import AdapterRing, ring_capacity, speculative_tokens
from .ring_guard import RingContinuity

logger = logging.getLogger(__name__)

# SGLang's ReqToTokenPool keeps request slot 0 for padding (its free slots start at 1).
PADDING_REQUEST_SLOT = 0


@dataclass(frozen=True)
class QSALayerInputs:
    """What the layer hook hands the backend beside q, k, v (rows as in `q`).

    q_gate [T, Hq*2D] (per head [q | gate]) and index_qk [T, (Hi+1)*Di] in the model dtype,
    the layer's GemmaRMSNorm weights.
    """

    q_gate: torch.Tensor
    index_qk: torch.Tensor
    norms: QSANormWeights


def attn_tp() -> tuple[int, int]:
    """SGLang's attention-TP (size, rank) in this scheduler process ((1, 0) before a parallel
    context is published, as in unit tests without one)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        parallel = get_parallel()
        return int(parallel.attn_tp_size), int(parallel.attn_tp_rank)
    except (AttributeError, LookupError, RuntimeError):
        return 1, 0


def rank_config(model: QSAConfig, tp_size: int, rank: int, pool_kv_heads: int) -> QSAConfig:
    """The model config with attention-TP rank `rank`'s heads (`QSAConfig.for_rank`: Hq / tp
    query heads; Hkv / tp KV heads, or one replicated KV head when tp > Hkv, as SGLang's
    QKVParallelLinear and its KV pool split them). The pool must hold that many KV heads."""
    config = model.for_rank(tp_size, rank)
    if config.num_kv_heads != pool_kv_heads:
        raise ValueError(
            f"QSATokenToKVPool.head_num is {pool_kv_heads}, but attention-TP rank {rank} of {tp_size} holds "
            f"{config.num_kv_heads} of the model's {model.num_kv_heads} KV heads (QSAConfig.head_shard)"
        )
    return config


class QSACoreBackend(AttentionBackend):
    """Serves the QSA layers of one model runner with `qsa_core` over SGLang's own pools."""

    def __init__(self, runner: Any) -> None:
        super().__init__()
        self.runner = runner
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.req_to_token_pool = runner.req_to_token_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.device = self.req_to_token.device
        self.model_config: QSAConfig = model_qsa_config(runner)
        self.dtype = getattr(runner.model_config, "dtype", None) or self.token_to_kv_pool.dtype
        check_pool(self.token_to_kv_pool, self.model_config, self.dtype)
        # This rank's heads: its planner, workspace and cache checks are sized for them.
        tp_size, tp_rank = attn_tp()
        self.config = rank_config(self.model_config, tp_size, tp_rank, self.token_to_kv_pool.head_num)
        pool, r = self.token_to_kv_pool, self.config.compress_ratio
        self.page_size = pool.page_size
        self.mrope = self.config.uses_mrope
        # Every position of a request lives in req_to_token: its width bounds seq_len.
        self.max_seq_len = self.req_to_token.shape[1]
        # The raw-key ring is the adapter's: C rows per request hold the open group and a draft window.
        drafts = speculative_tokens(runner)
        self.ring = AdapterRing.for_pool(pool, ring_capacity(r, drafts), self.mrope)
        chunk, max_prefill = schedule_bounds()
        self.planner = self._planner(eager_max_tokens(
            chunked_prefill_size=chunk, max_prefill_tokens=max_prefill,
            num_request_slots=self.req_to_token_pool.size, speculative_tokens=drafts,
        ))
        self.plan: QSAPlan | None = None
        self.ring_guard = RingContinuity(r, capacity=4 * pool.qsa_num_request_slots)
        self.graph: GraphInputs | None = None
        self.guard_watch = GuardWatch()  # logs requests the device guards made inert, a step late
        self.forward_metadata = None
        self._checked_layers: set[int] = set()
        logger.info(
            "qsa_core: QSA layers run on qsa_core (ratio %d, budget %d, page %d, raw-key ring %d rows per "
            "request, index dtype %s, ops backend %s; attention-TP rank %d of %d: %d query / %d KV heads)",
            r, self.config.token_topk, self.page_size, self.ring.capacity, self.config.index_dtype,
            self.planner.backend, tp_rank, tp_size, self.config.num_heads, self.config.num_kv_heads,
        )
        self._warm_eager(drafts, chunk, max_prefill)

    # -- per-step metadata ------------------------------------------------------------

    def _planner(self, max_num_tokens: int, max_num_reqs: int | None = None) -> QSAPlanner:
        """Main slots: the pool's `size` plus the reserved page 0; the ring: the adapter's C rows
        per request slot. The null ring row is request slot 0, which SGLang's `ReqToTokenPool`
        never allocates: its CUDA-graph capture batches and padding requests sit there (writing
        the padding slot 0), inert and unflagged. A planner for CUDA graphs (max_num_reqs: the
        graphs' batch bound, which the start-up warm-up's static steps need) never reads values
        back at a replay refresh (the device guards stand in for the host value checks, as on a
        GPU)."""
        graphs = max_num_reqs is not None
        pool = self.token_to_kv_pool
        return QSAPlanner(
            self.config, dtype=self.dtype, page_size=self.page_size, ring_capacity=self.ring.capacity,
            max_num_tokens=max_num_tokens, max_model_len=self.max_seq_len, max_num_reqs=max_num_reqs,
            device=self.device,
            num_slots=pool.size + self.page_size, num_ring_rows=pool.qsa_num_request_slots,
            null_ring_row=PADDING_REQUEST_SLOT, value_checks=False if graphs else None,
        )

    def _caches(self) -> list[QSALayerCache]:
        """Every QSA layer's cache views of the pool (the warm-ups bind on them)."""
        return [layer_cache(self.token_to_kv_pool, self.ring, i, page_size=self.page_size)
                for i in self.token_to_kv_pool.full_attention_layer_id_mapping]

    def _warm_eager(self, drafts: int, chunk: int | None, max_prefill: int) -> None:
        """Compile the eager planner's kernel variants at start-up: decode steps of 1 row (and
        1 + drafts with speculation), prefills, on block tables of a row stride of a multiple of
        16 (`batch_map`: eager tables are ceil(step max_seq_len / page) pages wide, rounded up
        to a multiple of 16, so one stride class covers them); no mixed decode + prefill
        shapes (`mixed=False`): an eager step is decode-only (DECODE, TARGET_VERIFY) or
        prefill-only (EXTEND, and MIXED, whose running decodes run as 1-row prefills:
        `batch_map`)."""
        logger.info(
            "qsa_core: eager planner for %d rows a step (chunked_prefill_size %s, max_prefill_tokens %d, "
            "%d request slots, %d draft tokens)",
            self.planner.max_num_tokens, chunk, max_prefill, self.req_to_token_pool.size, drafts,
        )
        lens = (1, 1 + drafts) if drafts else (1,)
        line = start_up_warm(self.planner, self._caches(), decode_query_lens=lens, static=False,
                             block_table_strides=(16,), mixed=False)
        if line is not None:
            logger.info("%s (eager planner)", line)

    def _set_plan(self, plan: QSAPlan | None) -> None:
        self.plan = plan
        self.forward_metadata = None if plan is None else plan.meta

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager steps: map the batch and build this step's `QSAForwardMetadata`."""
        mode = forward_batch.forward_mode
        if mode == ForwardMode.IDLE or forward_batch.batch_size == 0:
            self._set_plan(None)
            return
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            self.ring_guard.check(forward_batch)
        step = step_inputs(
            forward_batch, self.req_to_token, page_size=self.page_size, mrope=self.mrope,
            max_seq_len_bound=self.max_seq_len,
        )
        if step.num_tokens > self.planner.max_num_tokens:  # above the start-up bound (eager.py): grow, unwarmed
            size = max(step.num_tokens, 2 * self.planner.max_num_tokens)
            logger.warning("qsa_core: an eager step of %d rows exceeds the eager planner's %d: rebuilt for %d rows, "
                           "unwarmed (its kernels compile as steps need them)", step.num_tokens,
                           self.planner.max_num_tokens, size)
            self.planner = self._planner(size)
        self._set_plan(self.planner.plan(step))
        self.guard_watch.poll(self.planner, step.num_reqs, getattr(forward_batch, "rids", None))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph = GraphInputs(
            max_bs=max_bs,
            max_num_tokens=max_num_tokens,
            max_seq_len=self.max_seq_len,
            page_size=self.page_size,
            planner=self._planner(max_num_tokens, max_num_reqs=max_bs),
            device=self.device,
        )
        # Compile the graphs' kernel variants before capture: decode steps of 1 row per
        # request, or max_num_tokens / max_bs with speculative verification; decode-only (the
        # graphs capture DECODE and TARGET_VERIFY only), so no mixed shapes.
        line = start_up_warm(self.graph.planner, self._caches(),
                             decode_query_lens=(1, max(1, max_num_tokens // max_bs)), mixed=False)
        if line is not None:
            logger.info(line)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Capture (in_capture) or replay: refresh the static metadata buffers in place."""
        mode = forward_batch.forward_mode
        if mode not in DECODE_LIKE:
            raise NotImplementedError(
                f"qsa_core captures decode CUDA graphs only, got ForwardMode.{mode.name}: run prefill "
                "eagerly (--disable-prefill-cuda-graph) or with --cuda-graph-backend-prefill breakable"
            )
        if self.graph is None:
            raise RuntimeError("init_cuda_graph_state must run before init_forward_metadata_out_graph")
        step = step_inputs(
            forward_batch, self.req_to_token, page_size=self.page_size, mrope=self.mrope,
            max_seq_len_bound=self.max_seq_len, fixed_max_seq_len=True,
        )
        self._set_plan(self.graph.refresh(
            step, mode=mode, num_padding_reqs=int(getattr(forward_batch, "num_padding", 0) or 0),
            in_capture=in_capture,
        ))
        if not in_capture:
            self.guard_watch.poll(self.graph.planner, step.num_reqs, getattr(forward_batch, "rids", None))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # -- attention ----------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache, kwargs.get("qsa_inputs"))

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache, kwargs.get("qsa_inputs"))

    def _attend(self, q, k, v, layer, save_kv_cache: bool, inputs: QSALayerInputs | None) -> torch.Tensor:
        """out [rows, Hq*D] (model dtype); rows past the step metadata are 0."""
        if inputs is None:
            raise RuntimeError(
                f"layer {layer.layer_id} reached qsa_core without qsa_inputs: QSA layers run through "
                "qsa_core's Qwen4-Exp layer hook (installed when the backend is built)"
            )
        if not save_kv_cache:
            raise NotImplementedError("qsa_core writes the layer's K/V itself; save_kv_cache=False is not supported")
        plan = self.plan
        if plan is None:
            raise RuntimeError("qsa_core has no metadata for this step: init_forward_metadata was not called")
        n, rows = plan.num_tokens, q.shape[0]
        if rows < n:
            raise ValueError(f"layer {layer.layer_id}: q has {rows} rows, the step metadata {n}")
        config = self.config
        if (layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim) != (config.num_heads, config.num_kv_heads, config.head_dim):
            raise ValueError(
                f"layer {layer.layer_id}: this rank serves {config.num_heads} query / {config.num_kv_heads} KV heads of "
                f"dim {config.head_dim}, the layer has {layer.tp_q_head_num} / {layer.tp_k_head_num} of dim {layer.head_dim}"
            )
        cache = self._cache(layer, config)
        indexed = qsa_indexer(
            plan, inputs.norms, inputs.index_qk, inputs.q_gate, k.reshape(rows, -1), v.reshape(rows, -1), cache
        )
        # Rows past the plan (SGLang's padding) are 0.
        out = None if rows == n else q.new_zeros(rows, config.num_heads * config.head_dim)
        gated = qsa_attention(plan, indexed, cache, out=out)
        return gated if out is None else out

    def _cache(self, layer, config: QSAConfig):
        kw = dict(
            page_size=self.page_size,
            k_scale=float(layer.k_scale_float or 1.0),
            v_scale=float(layer.v_scale_float or 1.0),
        )
        if layer.layer_id in self._checked_layers:
            return layer_cache(self.token_to_kv_pool, self.ring, layer.layer_id, **kw)
        cache = checked_layer_cache(self.token_to_kv_pool, self.ring, layer.layer_id, config, self.dtype, **kw)
        self._checked_layers.add(layer.layer_id)
        return cache
