"""The Triton backend: `qsa_kernels`' bound launches behind the backend protocol.

Its workspace (prepare outputs, select scratch, split-K partials, the shared-tile prefill
workspace, the shared-slot claim table) is allocated once per planner; a step shape's
select and attention schedules are planned once (the planner caches them); the launches of
a layer part are bound once per (schedule, layer cache), on first use or by `bind_all`
(the start-up warm-up), and later calls pass only what changes per call. The kernels'
routes, tiles and launch switches are the planner's `options.kernel` (`KernelOptions`),
passed to every plan, workspace size and launch; the metadata build's guard bits are the
reference's (`GUARD_BITS`: the kernels import nothing from the core).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from qsa_kernels.options import KernelOptions

from ..cache import QSALayerCache
from ..reference.metadata import GUARD_BITS
from .base import NO_BOUND, EmptyLaunches, KernelSchedule, LayerLaunches, QSABackend, check_binding

if TYPE_CHECKING:
    from ..inputs import QSAStepInputs
    from ..layer import QSANormWeights
    from ..planner import QSAPlan, QSAPlanner


class TritonBackend(QSABackend):
    """The Triton kernels (compiled on CUDA tensors, interpreted on CPU tensors)."""

    name = "triton"
    compiles = True

    def __init__(self, planner: "QSAPlanner") -> None:
        from qsa_kernels.attention import partials_size
        from qsa_kernels.metadata import GuardBits, MetadataBuild, StaticStage
        from qsa_kernels.select import select_workspace

        p, cfg, n, dev = planner, planner.config, planner.max_num_tokens, planner.device
        ko = planner.options.kernel
        self.device, self.config, self.options = dev, cfg, ko
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        slot_claims = None if p.num_slots is None else torch.zeros(p.num_slots + 1, **i64)
        self._q_idx = torch.empty(n, cfg.index_n_heads, cfg.index_head_dim, dtype=p.index_dtype, device=dev)
        self._q = torch.empty(n, cfg.num_heads, cfg.head_dim, dtype=p.dtype, device=dev)
        from ..planner import column_bucket

        max_cols = column_bucket(p.max_model_len // cfg.compress_ratio)
        self._select_ws = select_workspace(n, max_cols, cfg.block_topk, dev, ko)
        acc = partials_size(n, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.selection_width, dev, ko)
        self._partials = (torch.empty(acc * 2 // cfg.head_dim + 2, dtype=torch.float32, device=dev),
                          torch.empty(acc, dtype=torch.float32, device=dev))
        self._attn_prefill_ws = None
        if n >= ko.shared_prefill_min_rows and ko.shared_prefill:
            from qsa_kernels.attention_prefill import workspace_size

            self._attn_prefill_ws = torch.empty(workspace_size(
                n, cfg.num_heads, cfg.num_kv_heads, cfg.selection_width, cfg.compress_ratio), **i32)
        self._arrive = torch.zeros(2, **i32)  # the metadata build's arrival counter (left zero)
        self._build = MetadataBuild(
            **p.derived, request_flags=p.request_flags, arrive=self._arrive, guard=p.guard,
            compress_ratio=cfg.compress_ratio, ring_capacity=p.ring_capacity, page_size=p.page_size,
            num_slots=NO_BOUND if p.num_slots is None else p.num_slots,
            num_ring_rows=NO_BOUND if p.num_ring_rows is None else p.num_ring_rows,
            null_ring_row=-1 if p.null_ring_row is None else p.null_ring_row,
            slot_claims=slot_claims, inputs_checked=True,  # plan validates them first
            guards=GuardBits(**GUARD_BITS), options=ko,
        )
        self._stager = None if p.static is None else StaticStage(**p.static, options=ko)

    def schedule(self, num_tokens, num_decode_tokens, num_cols, decode_query_len, decode_only) -> KernelSchedule:
        from qsa_kernels.attention import plan_attention
        from qsa_kernels.select import plan_select

        cfg, T, nd, dev, ws, ko = (self.config, num_tokens, num_decode_tokens, self.device, self._select_ws,
                                   self.options)
        dec = pre = None
        if nd:
            dec = plan_select(nd, num_cols, cfg.block_topk, decode=True, device=dev, workspace=ws,
                              rows_per_request=decode_query_len, rows_aligned=decode_only, options=ko)
        if nd < T:
            pre = plan_select(T - nd, num_cols, cfg.block_topk, decode=False, device=dev, workspace=ws, options=ko)
        attn = plan_attention(T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.selection_width,
                              device=dev, partials=self._partials, compress_ratio=cfg.compress_ratio,
                              prefill_workspace=self._attn_prefill_ws, context=num_cols * cfg.compress_ratio,
                              options=ko)
        return KernelSchedule(self._q_idx[:T], self._q[:T], dec, pre, attn)

    def build_metadata(self, inputs: "QSAStepInputs", tensors: tuple[torch.Tensor, ...], num_live_rows: int,
                       derived: dict[str, torch.Tensor]) -> None:
        qsl, seq, slots, ring, table = tensors
        self._build(qsl, seq, slots, ring, table, inputs.max_seq_len, inputs.max_query_len, num_live_rows,
                    inputs.num_decodes, inputs.decode_query_len)

    def stage(self, inputs: "QSAStepInputs", static: dict[str, torch.Tensor]) -> tuple:
        return self._stager(inputs.query_start_loc, inputs.seq_lens, inputs.block_table, inputs.slot_mapping,
                            inputs.ring_index, inputs.rope_positions)  # one launch

    def bind(self, plan: "QSAPlan", cache: QSALayerCache) -> LayerLaunches:
        return EmptyLaunches(cache) if plan.schedule.num_tokens == 0 else TritonLaunches(cache, self.options)


class TritonLaunches(LayerLaunches):
    """The bound launches of one step shape on one layer cache, each bound on first use
    (or by `bind_all`) with that call's tensors' layout; options: the planner's kernel options
    (the prepare launch takes them; select and attention take their schedules')."""

    def __init__(self, cache: QSALayerCache, options: KernelOptions) -> None:
        self.cache, self.options = cache, options
        self._prepare: Any = None
        self._select: tuple = ()
        self._attention: Any = None

    @property
    def select_launches(self) -> tuple:
        """The select launches bound so far (decode, then prefill; empty before first use)."""
        return self._select

    def prepare(self, plan, norms, index_qk, q_gate, k, v):
        launch = self._prepare
        if launch is None:
            launch = self._bind_prepare(plan, norms, index_qk, q_gate, k, v)
        meta = plan.meta
        # index_qk as both index_q (its first Hi*Di columns) and raw_keys (from column Hi*Di).
        return launch(index_qk, index_qk, q_gate, k, v, meta.rope_positions, norms.index_q, norms.index_k, norms.q,
                      norms.k, meta.query_start_loc, meta.ring_index)

    def select(self, plan, q_idx, out):
        launches = self._select or self._bind_select(plan, q_idx, out)
        table = plan.meta.block_table
        for launch in launches:
            launch(q_idx, table, out)
        return out

    def attention(self, plan, q, gate, selection, out):
        launch = self._attention
        if launch is None:
            launch = self._bind_attention(plan, q, gate, selection, out)
        meta = plan.meta
        return launch(q, gate, meta.block_table, meta.token_to_req, meta.seq_lens, selection, out)

    def bind_all(self, plan, norms, index_qk, q_gate, k, v):
        s, cfg = plan.schedule, plan.config
        if self._prepare is None:
            self._bind_prepare(plan, norms, index_qk, q_gate, k, v)
        if not self._select:
            self._bind_select(plan, s.q_idx, s.selection)
        if self._attention is None:
            T, D = s.num_tokens, cfg.head_dim
            gate = q_gate.view(T, cfg.num_heads, 2 * D)[..., D:]  # prepare's gate view
            self._bind_attention(plan, s.q, gate, s.selection, s.attn_out)

    def _bind_prepare(self, plan: "QSAPlan", norms: "QSANormWeights", index_qk: torch.Tensor, q_gate: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> Any:
        from qsa_kernels.prepare import PrepareLaunch

        meta, s, cfg, cache = plan.meta, plan.schedule, plan.config, self.cache
        check_binding(plan, cache, index_qk, q_gate, k, v)
        self._prepare = PrepareLaunch(
            index_qk, index_qk, q_gate, k, v, meta.rope_positions, index_q_norm=norms.index_q,
            index_k_norm=norms.index_k, q_norm=norms.q, k_norm=norms.k, eps=cfg.rms_norm_eps,
            inv_freq=plan.inv_freq, rope_axes=plan.rope_axes, k_cache=cache.k, v_cache=cache.v,
            k_scale=cache.k_scale, v_scale=cache.v_scale, compressed=cache.compressed, ring=cache.ring,
            ring_positions=cache.ring_positions, slot_mapping=meta.slot_mapping, compressed_slot=meta.compressed_slot,
            token_to_req=meta.token_to_req, positions=meta.positions, ring_slot=meta.ring_slot,
            query_start_loc=meta.query_start_loc, ring_index=meta.ring_index, compress_ratio=meta.compress_ratio,
            ring_capacity=meta.ring_capacity, q_idx_out=s.q_idx, q_out=s.q,
            raw_offset=cfg.index_n_heads * cfg.index_head_dim, fuse_ring=s.fuse_ring, options=self.options,
        )
        return self._prepare

    def _bind_select(self, plan: "QSAPlan", q_idx: torch.Tensor, out: torch.Tensor) -> tuple:
        """The decode select launch (rows [0, num_decode_tokens)) and the prefill one (the
        rest), over the step's whole row tensors, writing packed selection rows (no expand
        launch); each takes (q_idx [T, Hi, Di], block_table, out int32 [T, W + 1])."""
        from qsa_kernels.select import SelectLaunch

        meta, s, cfg, cache = plan.meta, plan.schedule, plan.config, self.cache
        nd, T = s.num_decode_tokens, s.num_tokens
        kw = dict(page_size=meta.page_size, compress_ratio=cfg.compress_ratio, block_topk=cfg.block_topk)
        self._select = tuple(
            SelectLaunch(sched, q_idx, cache.compressed, meta.block_table, meta.token_to_req, meta.visible_blocks,
                         out, first_row=lo, positions=meta.positions, kv_cache=(cache.k, cache.v), **kw)
            for sched, lo, hi in ((s.select_decode, 0, nd), (s.select_prefill, nd, T)) if lo < hi
        )
        return self._select

    def _bind_attention(self, plan: "QSAPlan", q: torch.Tensor, gate: torch.Tensor, selection: torch.Tensor,
                        out: torch.Tensor) -> Any:
        from qsa_kernels.attention import AttentionLaunch

        meta, cfg, cache = plan.meta, plan.config, self.cache
        self._attention = AttentionLaunch(
            q, gate, cache.k, cache.v, meta.block_table, meta.token_to_req, meta.seq_lens, selection,
            softmax_scale=cfg.softmax_scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
            out=out, schedule=plan.schedule.attention,
        )
        return self._attention
