"""The reference backend: the pure-PyTorch definitions (`qsa_core.reference`) behind the
backend protocol. Nothing compiles, nothing is bound: its layer parts are closures over the
reference functions, run under `torch.no_grad()` (cache writes never join an autograd graph).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import reference
from ..cache import QSALayerCache
from .base import NO_BOUND, EmptyLaunches, KernelSchedule, LayerLaunches, QSABackend, check_binding

if TYPE_CHECKING:
    from ..inputs import QSAStepInputs
    from ..planner import QSAPlan, QSAPlanner


class ReferenceBackend(QSABackend):
    """The reference ops; the shared-slot guard needs only a one-element switch."""

    name = "reference"
    compiles = False

    def __init__(self, planner: "QSAPlanner") -> None:
        p = planner
        self._geometry = dict(compress_ratio=p.config.compress_ratio, ring_capacity=p.ring_capacity,
                              page_size=p.page_size,
                              num_slots=NO_BOUND if p.num_slots is None else p.num_slots,
                              num_ring_rows=NO_BOUND if p.num_ring_rows is None else p.num_ring_rows,
                              null_ring_row=-1 if p.null_ring_row is None else p.null_ring_row)
        self._request_flags, self._guard = p.request_flags, p.guard
        self._slot_claims = None if p.num_slots is None else torch.zeros(1, dtype=torch.int64, device=p.device)

    def schedule(self, num_tokens, num_decode_tokens, num_cols, decode_query_len, decode_only) -> KernelSchedule:
        return KernelSchedule()

    @torch.no_grad()
    def build_metadata(self, inputs: "QSAStepInputs", tensors: tuple[torch.Tensor, ...], num_live_rows: int,
                       derived: dict[str, torch.Tensor]) -> None:
        reference.qsa_build_metadata(
            *tensors, max_seq_len=inputs.max_seq_len, max_query_len=inputs.max_query_len,
            num_live_rows=num_live_rows, request_flags=self._request_flags, guard=self._guard,
            num_decodes=inputs.num_decodes, decode_query_len=inputs.decode_query_len, slot_claims=self._slot_claims,
            **self._geometry, **derived,
        )

    def stage(self, inputs: "QSAStepInputs", static: dict[str, torch.Tensor]) -> tuple:
        s, R, T = static, inputs.num_reqs, inputs.num_tokens
        P = inputs.block_table.shape[1]
        rp, rope = inputs.rope_positions, None
        if rp is not None:
            buf = s["rope_positions"]
            rope = (buf[0] if rp.dim() == 1 else buf)[..., :T].copy_(rp)
        return (
            s["query_start_loc"][: R + 1].copy_(inputs.query_start_loc),
            s["seq_lens"][:R].copy_(inputs.seq_lens),
            s["block_table"][:R, :P].copy_(inputs.block_table[:R]),
            s["slot_mapping"][:T].copy_(inputs.slot_mapping),
            s["ring_index"][:R].copy_(inputs.ring_index),
            rope,
        )

    def bind(self, plan: "QSAPlan", cache: QSALayerCache) -> LayerLaunches:
        return EmptyLaunches(cache) if plan.schedule.num_tokens == 0 else ReferenceLaunches(cache)


class ReferenceLaunches(LayerLaunches):
    """The reference functions on one layer cache; the write side is checked on first use."""

    def __init__(self, cache: QSALayerCache) -> None:
        self.cache = cache
        self.checked = False

    @torch.no_grad()
    def prepare(self, plan, norms, index_qk, q_gate, k, v):
        cache, cfg = self.cache, plan.config
        if not self.checked:
            check_binding(plan, cache, index_qk, q_gate, k, v)
            self.checked = True
        split = cfg.index_n_heads * cfg.index_head_dim
        return reference.qsa_prepare(
            index_qk[:, :split], index_qk[:, split:], q_gate, k, v, plan.meta.rope_positions,
            index_q_norm=norms.index_q, index_k_norm=norms.index_k, q_norm=norms.q, k_norm=norms.k,
            eps=cfg.rms_norm_eps, inv_freq=plan.inv_freq, rope_axes=plan.rope_axes, index_dtype=plan.index_dtype,
            cache=cache, meta=plan.meta,
        )

    @torch.no_grad()
    def select(self, plan, q_idx, out):
        meta, s, cfg = plan.meta, plan.schedule, plan.config
        nd, T = s.num_decode_tokens, s.num_tokens
        kw = dict(page_size=meta.page_size, compress_ratio=cfg.compress_ratio, block_topk=cfg.block_topk)
        comp, table = self.cache.compressed, meta.block_table
        if nd:
            to_req, vis, blocks = s.decode_rows
            reference.qsa_select_decode(q_idx[:nd], comp, table, to_req, vis, out=blocks, **kw)
        if nd < T:
            to_req, vis, blocks = s.prefill_rows
            reference.qsa_select_prefill(q_idx[nd:], comp, table, to_req, vis, out=blocks, **kw)
        return reference.qsa_expand(s.blocks, meta.positions, meta.visible_blocks, compress_ratio=cfg.compress_ratio,
                                    out=out)

    @torch.no_grad()
    def attention(self, plan, q, gate, selection, out):
        meta, cache = plan.meta, self.cache
        result = reference.qsa_sparse_attention(
            q, gate, cache.k, cache.v, meta.block_table, meta.token_to_req, meta.seq_lens, selection,
            softmax_scale=plan.config.softmax_scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
        )
        return out.copy_(result)
