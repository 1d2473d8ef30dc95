"""A QSA layer as two launch-only halves on a step's `QSAPlan`, and `QSAAttention` on them.

`qsa_indexer` (prepare, then select writing packed selection rows) writes the step's K/V, ring rows and compressed keys
and returns the selection with the attention's q and gate; `qsa_attention` (sparse attention
and gate) writes the gated output. Engines with their own projection layers call the two
halves directly; `QSAAttention` is the whole layer with HF weight names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from . import ops
from .cache import QSALayerCache, validate_layer_cache
from .config import QSAConfig
from .planner import QSAPlan


class GemmaRMSNorm(nn.Module):
    """Weight holder of `x * rsqrt(mean(x^2) + eps) * (1 + w)`; the ops apply it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps


class QSAIndexerWeights(nn.Module):
    """The indexer's trainable weights: index_qk_proj, q_layernorm, k_layernorm."""

    def __init__(self, config: QSAConfig) -> None:
        super().__init__()
        Hi, Di = config.index_n_heads, config.index_head_dim
        self.index_qk_proj = nn.Linear(config.hidden_size, (Hi + 1) * Di, bias=False)
        self.q_layernorm = GemmaRMSNorm(Di, config.rms_norm_eps)
        self.k_layernorm = GemmaRMSNorm(Di, config.rms_norm_eps)


class QSAAttention(nn.Module):
    """One QSA layer: projections, indexer, selection, sparse attention, output gate, o_proj.

    `forward(hidden [T, hidden_size], plan, cache) -> [T, hidden_size]`. The step's K/V,
    ring rows and compressed keys are written to `cache` first; padding rows write nothing
    and give o_proj(0). The RoPE table is the plan's (the planner's config).
    """

    def __init__(self, config: QSAConfig) -> None:
        super().__init__()
        self.config = config
        H, Hq, Hkv, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, Hq * D * 2, bias=bias)
        self.k_proj = nn.Linear(H, Hkv * D, bias=bias)
        self.v_proj = nn.Linear(H, Hkv * D, bias=bias)
        self.o_proj = nn.Linear(Hq * D, H, bias=bias)
        self.q_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.indexer = QSAIndexerWeights(config)
        # MTP draft steps may keep the step-0 selection while the caches still update.
        self.skip_topk = False

    @classmethod
    def from_hf(cls, hf_attention: nn.Module, **overrides: Any) -> "QSAAttention":
        """Copy a transformers `Qwen4ExpTextAttention` (weights and rotary settings)."""
        layer = cls(QSAConfig.from_hf(hf_attention.config, **overrides))
        missing, unexpected = layer.load_state_dict(hf_attention.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(f"HF attention weights do not match: missing {missing}, unexpected {unexpected}")
        p = next(hf_attention.parameters())
        return layer.to(device=p.device, dtype=p.dtype)

    def norm_weights(self) -> "QSANormWeights":
        return QSANormWeights(
            index_q=self.indexer.q_layernorm.weight,
            index_k=self.indexer.k_layernorm.weight,
            q=self.q_norm.weight,
            k=self.k_norm.weight,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        plan: QSAPlan,
        cache: QSALayerCache,
        selection_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if hidden_states.shape[0] != plan.num_tokens:
            raise ValueError(
                f"hidden_states has {hidden_states.shape[0]} rows, expected the plan's num_tokens = {plan.num_tokens}"
            )
        indexed = qsa_indexer(
            plan,
            self.norm_weights(),
            self.indexer.index_qk_proj(hidden_states),
            self.q_proj(hidden_states),
            self.k_proj(hidden_states),
            self.v_proj(hidden_states),
            cache,
            selection_out=selection_out,
            skip_topk=self.skip_topk,
        )
        return self.o_proj(qsa_attention(plan, indexed, cache))


@dataclass(frozen=True)
class QSANormWeights:
    """GemmaRMSNorm weights (the `w` of `1 + w`) of a QSA layer, each [head dim]."""

    index_q: torch.Tensor
    index_k: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor


class QSAIndexed(NamedTuple):
    """The indexer half's result: selection int32 [T, W + 1] (request-relative positions,
    -1 padded, count last), the attention's normed and rotated q [T, Hq, D] and gate
    [T, Hq, D] (model dtype)."""

    selection: torch.Tensor
    q: torch.Tensor
    gate: torch.Tensor


def _rows(x: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """x's first n rows (engines may pass padded buffers); fewer than n is refused."""
    if x.shape[0] < n:
        raise ValueError(f"{name} has {x.shape[0]} rows, expected >= the plan's num_tokens = {n}")
    return x if x.shape[0] == n else x[:n]


def qsa_indexer(
    plan: QSAPlan,
    norms: QSANormWeights,
    index_qk: torch.Tensor,
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: QSALayerCache,
    *,
    selection_out: torch.Tensor | None = None,
    skip_topk: bool = False,
) -> QSAIndexed:
    """The indexer half of a layer: `qsa_prepare` (all cache writes), then `qsa_select`
    (select, expand). Launches only.

    index_qk [>= T, (Hi+1)*Di] (index_qk_proj output: Hi query heads, then the raw key),
    q_gate [>= T, Hq*2D] (per head [q | gate]), k, v [>= T, Hkv*D], model dtype, rows of any
    stride with contiguous rows; rows past plan.num_tokens are ignored. selection_out int32
    [T, W + 1]: where the selection goes (default: the plan's workspace); with skip_topk it
    is the step-0 selection to reuse (MTP draft steps: the caches still update).
    """
    q_idx, q, gate = qsa_prepare(plan, norms, index_qk, q_gate, k, v, cache)
    if skip_topk:
        if selection_out is None:
            raise ValueError("skip_topk reuses a selection: pass the step-0 selection as selection_out")
        return QSAIndexed(selection_out, q, gate)
    return QSAIndexed(qsa_select(plan, q_idx, cache, out=selection_out), q, gate)


def qsa_prepare(
    plan: QSAPlan,
    norms: QSANormWeights,
    index_qk: torch.Tensor,
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: QSALayerCache,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused write side on a plan (inputs as `qsa_indexer`): stores the step's compressed
    keys, ring rows and K/V; returns q_idx [T, Hi, Di] (index dtype), q and gate [T, Hq, D].

    On Triton the launches are bound once per (schedule, cache) and relaunched with this
    call's tensors only."""
    meta, s, cfg = plan.meta, plan.schedule, plan.config
    T = s.num_tokens
    if index_qk.shape[0] != T or q_gate.shape[0] != T or k.shape[0] != T or v.shape[0] != T:
        index_qk, q_gate, k, v = (_rows(x, T, n) for x, n in
                                  ((index_qk, "index_qk"), (q_gate, "q_gate"), (k, "k"), (v, "v")))
    split = cfg.index_n_heads * cfg.index_head_dim
    if plan.backend != "triton" or T == 0:  # the reference (or nothing to do)
        launches = s.layer_launches(cache)
        if "checked" not in launches:  # once per (schedule, cache), as Triton's binding
            _check_binding(plan, index_qk, q_gate, k, v, cache, split)
            launches["checked"] = True
        return ops.prepare(
            index_qk[:, :split], index_qk[:, split:], q_gate, k, v, meta.rope_positions,
            index_q_norm=norms.index_q, index_k_norm=norms.index_k, q_norm=norms.q, k_norm=norms.k,
            eps=cfg.rms_norm_eps, inv_freq=plan.inv_freq, rope_axes=plan.rope_axes, index_dtype=plan.index_dtype,
            cache=cache, meta=meta, q_idx_out=s.q_idx, q_out=s.q, backend=plan.backend,
        )
    prepare = _bound(s.layer_launches(cache), "prepare", lambda: _prepare_launch(
        plan, norms, index_qk, q_gate, k, v, cache, split))
    return prepare(index_qk, index_qk, q_gate, k, v, meta.rope_positions, norms.index_q, norms.index_k, norms.q,
                   norms.k, meta.query_start_loc, meta.ring_index)


def _bound(launches: dict, name: str, make: Callable[[], Any]) -> Any:
    """The Triton launch `name` bound to a schedule (and layer cache), made on first use."""
    found = launches.get(name)
    if found is None:
        found = launches[name] = make()
    return found


def _check_binding(plan: QSAPlan, index_qk: torch.Tensor, q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache: QSALayerCache, split: int) -> None:
    """The write side's cache and projections against the plan, once per (schedule, cache):
    the stores are bounded by these shapes (K's slots for V, the plan's C for the ring, the
    projections' head counts for the caches') and cast to the caches' dtypes; the projections
    must be in the model dtype (the kernels compute in their inputs' precision)."""
    meta, cfg = plan.meta, plan.config
    validate_layer_cache(cache, cfg, meta.page_size, meta.ring_capacity, dtype=plan.dtype)
    widths = (("index_qk", index_qk, split + cfg.index_head_dim), ("q_gate", q_gate, 2 * cfg.num_heads * cfg.head_dim),
              ("k", k, cfg.num_kv_heads * cfg.head_dim), ("v", v, cfg.num_kv_heads * cfg.head_dim))
    for name, x, width in widths:
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"{name} must be [T, {width}] for this layer's heads, got {tuple(x.shape)}")
        if x.dtype != plan.dtype:
            raise ValueError(f"{name} must be {plan.dtype} (the model dtype the plan was made for), got {x.dtype}")


def _prepare_launch(plan: QSAPlan, norms: "QSANormWeights", index_qk: torch.Tensor, q_gate: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, cache: QSALayerCache, split: int) -> Any:
    from qsa_kernels.prepare import PrepareLaunch

    meta, s, cfg = plan.meta, plan.schedule, plan.config
    _check_binding(plan, index_qk, q_gate, k, v, cache, split)
    # index_qk as both index_q (its first Hi*Di columns) and raw_keys (from column Hi*Di).
    return PrepareLaunch(
        index_qk, index_qk, q_gate, k, v, meta.rope_positions, index_q_norm=norms.index_q,
        index_k_norm=norms.index_k, q_norm=norms.q, k_norm=norms.k, eps=cfg.rms_norm_eps,
        inv_freq=plan.inv_freq, rope_axes=plan.rope_axes, k_cache=cache.k, v_cache=cache.v, k_scale=cache.k_scale,
        v_scale=cache.v_scale, compressed=cache.compressed, ring=cache.ring, ring_positions=cache.ring_positions,
        slot_mapping=meta.slot_mapping, compressed_slot=meta.compressed_slot, token_to_req=meta.token_to_req,
        positions=meta.positions, ring_slot=meta.ring_slot, query_start_loc=meta.query_start_loc,
        ring_index=meta.ring_index, compress_ratio=meta.compress_ratio, ring_capacity=meta.ring_capacity,
        q_idx_out=s.q_idx, q_out=s.q, raw_offset=split, fuse_ring=s.fuse_ring, options=plan.kernel_options,
    )


def qsa_select(
    plan: QSAPlan, q_idx: torch.Tensor, cache: QSALayerCache, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Selection rows int32 [T, W + 1]: decode and prefill top-k, then expansion (launches only).

    q_idx [T, Hi, Di] in the index dtype (prepare's output); out: int32 [T, W + 1], default
    the plan's workspace.
    """
    meta, s, cfg = plan.meta, plan.schedule, plan.config
    T = s.num_tokens
    if out is None:
        out = s.selection
    elif out.shape != s.selection.shape or out.dtype != torch.int32:
        raise ValueError(f"selection out must be int32 [{T}, {cfg.packed_width}], got {out.dtype} {tuple(out.shape)}")
    if q_idx.shape[0] != T:
        q_idx = _rows(q_idx, T, "q_idx")
    nd = s.num_decode_tokens
    if plan.backend != "triton" or T == 0:  # the reference (or nothing to do)
        kw = dict(page_size=meta.page_size, compress_ratio=cfg.compress_ratio, block_topk=cfg.block_topk,
                  backend=plan.backend)
        comp, table = cache.compressed, meta.block_table
        if nd:
            to_req, vis, blocks = s.decode_rows
            ops.select_decode(q_idx[:nd], comp, table, to_req, vis, out=blocks, schedule=s.select_decode, **kw)
        if nd < T:
            to_req, vis, blocks = s.prefill_rows
            ops.select_prefill(q_idx[nd:], comp, table, to_req, vis, out=blocks, schedule=s.select_prefill, **kw)
        return ops.expand(s.blocks, meta.positions, meta.visible_blocks, compress_ratio=cfg.compress_ratio, out=out,
                          backend=plan.backend)
    for launch in _bound(s.layer_launches(cache), "select", lambda: _select_launches(plan, q_idx, cache, out)):
        launch(q_idx, meta.block_table, out)
    return out


def _select_launches(plan: QSAPlan, q_idx: torch.Tensor, cache: QSALayerCache, out: torch.Tensor) -> tuple:
    """The decode select launch (rows [0, num_decode_tokens)) and the prefill one (the rest)
    of a step shape and layer cache, over the step's whole row tensors, writing packed
    selection rows (no expand launch); each takes (q_idx [T, Hi, Di], block_table, out
    int32 [T, W + 1])."""
    from qsa_kernels.select import SelectLaunch

    meta, s, cfg = plan.meta, plan.schedule, plan.config
    nd, T = s.num_decode_tokens, s.num_tokens
    kw = dict(page_size=meta.page_size, compress_ratio=cfg.compress_ratio, block_topk=cfg.block_topk)
    return tuple(
        SelectLaunch(sched, q_idx, cache.compressed, meta.block_table, meta.token_to_req, meta.visible_blocks,
                     out, first_row=lo, positions=meta.positions, kv_cache=(cache.k, cache.v), **kw)
        for sched, lo, hi in ((s.select_decode, 0, nd), (s.select_prefill, nd, T)) if lo < hi
    )


def qsa_attention(
    plan: QSAPlan, indexed: QSAIndexed, cache: QSALayerCache, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The attention half: sparse attention over each row's selection, gate applied.

    Returns the gated output [T, Hq*D] (model dtype; o_proj not applied): `out[:T]` when out
    [>= T, Hq*D] is given (rows past T untouched), else the plan's workspace buffer. Padding
    rows and rows with an empty selection are exactly 0.
    """
    meta, s, cfg = plan.meta, plan.schedule, plan.config
    dst = s.attn_out if out is None else _rows(out, meta.num_tokens, "out")
    if s.q is None or s.num_tokens == 0:  # the reference backend (or nothing to do)
        return ops.sparse_attention(
            indexed.q, indexed.gate, cache.k, cache.v, meta.block_table, meta.token_to_req, meta.seq_lens,
            indexed.selection, softmax_scale=cfg.softmax_scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
            out=dst, schedule=s.attention, backend=plan.backend,
        )
    attend = _bound(s.layer_launches(cache), "attention", lambda: _attention_launch(plan, indexed, cache, dst))
    return attend(indexed.q, indexed.gate, meta.block_table, meta.token_to_req, meta.seq_lens, indexed.selection, dst)


def _attention_launch(plan: QSAPlan, indexed: QSAIndexed, cache: QSALayerCache, dst: torch.Tensor) -> Any:
    from qsa_kernels.attention import AttentionLaunch

    meta, cfg = plan.meta, plan.config
    return AttentionLaunch(
        indexed.q, indexed.gate, cache.k, cache.v, meta.block_table, meta.token_to_req, meta.seq_lens,
        indexed.selection, softmax_scale=cfg.softmax_scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
        out=dst, schedule=plan.schedule.attention,
    )


def bind_layer(plan: QSAPlan, norms: QSANormWeights, index_qk: torch.Tensor, q_gate: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, cache: QSALayerCache) -> None:
    """Bind the launches `qsa_indexer` and `qsa_attention` make on this plan and cache (inputs
    as `qsa_indexer`), launching nothing: on a GPU this compiles them (start-up warm-up,
    `warmup.warm`). The halves reuse these bindings. Nothing to bind on the reference backend."""
    s, cfg = plan.schedule, plan.config
    T = s.num_tokens
    if plan.backend != "triton" or T == 0:
        return
    index_qk, q_gate, k, v = (_rows(x, T, n) for x, n in
                              ((index_qk, "index_qk"), (q_gate, "q_gate"), (k, "k"), (v, "v")))
    split = cfg.index_n_heads * cfg.index_head_dim
    launches = s.layer_launches(cache)
    _bound(launches, "prepare", lambda: _prepare_launch(plan, norms, index_qk, q_gate, k, v, cache, split))
    _bound(launches, "select", lambda: _select_launches(plan, s.q_idx, cache, s.selection))
    D = cfg.head_dim
    gate = q_gate.view(T, cfg.num_heads, 2 * D)[..., D:]  # prepare's gate view
    indexed = QSAIndexed(s.selection, s.q, gate)
    _bound(launches, "attention", lambda: _attention_launch(plan, indexed, cache, s.attn_out))
