"""The op API: one function per op of design.md §5, with the reference's contract.

Two backends implement every op under the same name: `reference` (`qsa_core.reference`,
pure PyTorch, the definition) and `triton` (`qsa_kernels`). A `QSAPlanner` resolves its
backend once and passes it to every call (`backend=`); called without one, an op resolves
it from its tensors' device and `QSA_BACKEND` (`reference` or `triton`; with
`TRITON_INTERPRET=1`, `triton` runs the kernels on CPU tensors). Kernel schedules
(`schedule=`) come from the plan; the reference needs none.

The ops are inference-only: they run under `torch.no_grad()` (cache writes never join an
autograd graph), so a layer works with grad mode on, under `no_grad` and in `inference_mode`.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from . import reference

if TYPE_CHECKING:
    from qsa_kernels.attention import AttentionSchedule
    from qsa_kernels.select import SelectSchedule

    from .cache import QSALayerCache
    from .metadata import QSAForwardMetadata

BACKENDS = ("reference", "triton")


def resolve_backend(device: torch.device, name: str | None = None) -> str:
    """The backend for tensors on `device`: `name`, else `QSA_BACKEND`, else triton on CUDA.
    Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1): a compiled kernel would
    read CPU addresses on the GPU."""
    choice = name or os.environ.get("QSA_BACKEND", "")
    if choice:
        if choice not in BACKENDS:
            raise ValueError(f"QSA_BACKEND must be one of {BACKENDS}, got {choice!r}")
        if choice == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError("the triton backend on CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter); "
                             "use the reference backend on the CPU or put the tensors on a GPU")
        return choice
    return "triton" if device.type == "cuda" else "reference"


def _impl(backend: str | None, device: torch.device) -> ModuleType:
    if (backend or resolve_backend(device)) == "triton":
        import qsa_kernels

        return qsa_kernels
    return reference


@torch.no_grad()
def build_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    ring_index: torch.Tensor,
    block_table: torch.Tensor,
    *,
    compress_ratio: int,
    ring_capacity: int,
    max_seq_len: int,
    max_query_len: int,
    page_size: int,
    num_live_rows: int,
    num_slots: int,
    num_ring_rows: int,
    token_to_req: torch.Tensor,
    positions: torch.Tensor,
    visible_blocks: torch.Tensor,
    ring_slot: torch.Tensor,
    compressed_slot: torch.Tensor,
    kv_slot: torch.Tensor,
    request_flags: torch.Tensor,
    guard: torch.Tensor,
    num_decodes: int = 0,
    decode_query_len: int = 1,
    slot_claims: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """design.md §3's derived per-row fields, in place (no host reads).

    query_start_loc int32 [R+1], seq_lens int32 [R], slot_mapping int64 [T], ring_index
    int32 [R], block_table int32 [>= R, P] -> token_to_req int32, positions int64 (-1 =
    padding), visible_blocks int32, ring_slot int64, compressed_slot int64 and kv_slot int64
    (-1 = no write), all [T]. Rows of a malformed request (see the reference's GUARD_* bits;
    num_decodes leading requests of decode_query_len or 0 rows each) are made inert and OR their
    reason into guard int32 [1]; request_flags int32 [>= R] gets each request's bits.
    slot_claims int64 [num_slots + 1], zero at first and kept between steps: turns on the
    guard against two live rows writing one slot (the Triton build's claim table).
    """
    _impl(backend, slot_mapping.device).qsa_build_metadata(
        query_start_loc, seq_lens, slot_mapping, ring_index, block_table,
        compress_ratio=compress_ratio, ring_capacity=ring_capacity, max_seq_len=max_seq_len,
        max_query_len=max_query_len, page_size=page_size, num_live_rows=num_live_rows, num_slots=num_slots, num_ring_rows=num_ring_rows,
        token_to_req=token_to_req, positions=positions, visible_blocks=visible_blocks,
        ring_slot=ring_slot, compressed_slot=compressed_slot, kv_slot=kv_slot,
        request_flags=request_flags, guard=guard, num_decodes=num_decodes, decode_query_len=decode_query_len,
        slot_claims=slot_claims,
    )


@torch.no_grad()
def store_rows(
    cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float = 1.0, *, backend: str | None = None
) -> None:
    """cache[slots[t]] = rows[t] / scale for 0 <= slots[t] < len(cache); other rows skip.

    cache [N, ...] (float, fp8 or integer), slots int64 [T], rows [T, ...].
    """
    _impl(backend, cache.device).qsa_store_rows(cache, slots, rows, scale)


@torch.no_grad()
def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0, *, backend: str | None = None,
) -> None:
    """Write K/V [T, Hkv, D] into paged caches [pages, page_size, Hkv, D] at main slots int64 [T]."""
    _impl(backend, k_cache.device).qsa_store_kv(k_cache, v_cache, slots, k, v, k_scale, v_scale)


@torch.no_grad()
def compress_groups(
    raw_keys: torch.Tensor,
    rope_positions: torch.Tensor,
    *,
    k_norm: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rope_axes: torch.Tensor,
    cache: "QSALayerCache",
    meta: "QSAForwardMetadata",
    backend: str | None = None,
) -> None:
    """Compress every group the step closes (raw_keys [T, Di] model dtype) into cache.compressed.

    Reads the ring for tokens of earlier steps: call before the step's ring store.
    """
    _impl(backend, raw_keys.device).qsa_compress_groups(
        raw_keys, rope_positions, k_norm=k_norm, eps=eps, inv_freq=inv_freq, rope_axes=rope_axes,
        cache=cache, meta=meta,
    )


@torch.no_grad()
def prepare(
    index_q: torch.Tensor,
    raw_keys: torch.Tensor,
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope_positions: torch.Tensor,
    *,
    index_q_norm: torch.Tensor,
    index_k_norm: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rope_axes: torch.Tensor,
    index_dtype: torch.dtype,
    cache: "QSALayerCache",
    meta: "QSAForwardMetadata",
    q_idx_out: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused write side of a layer: compressed keys, ring (+ MRoPE positions), main K/V.

    index_q [T, Hi*Di], raw_keys [T, Di], q_gate [T, Hq*2D] (per head [q | gate]), k, v
    [T, Hkv*D], model dtype; rope_positions int64 [T] or [3, T]; inv_freq fp32 [Rd/2],
    rope_axes int32 [Rd/2]. Returns q_idx [T, Hi, Di] (index_dtype), q [T, Hq, D] and
    gate [T, Hq, D] (a view of q_gate). The Triton kernels write q_idx / q into
    q_idx_out / q_out when given (the reference returns new tensors).
    """
    impl = _impl(backend, index_q.device)
    kw = dict(
        index_q_norm=index_q_norm, index_k_norm=index_k_norm, q_norm=q_norm, k_norm=k_norm, eps=eps,
        inv_freq=inv_freq, rope_axes=rope_axes, index_dtype=index_dtype, cache=cache, meta=meta,
    )
    if impl is reference:
        return impl.qsa_prepare(index_q, raw_keys, q_gate, k, v, rope_positions, **kw)
    return impl.qsa_prepare(index_q, raw_keys, q_gate, k, v, rope_positions, q_idx_out=q_idx_out, q_out=q_out, **kw)


def _select(name: str, q_idx, compressed, block_table, token_to_req, visible_blocks, page_size, compress_ratio,
            block_topk, out, schedule, backend) -> torch.Tensor:
    impl = _impl(backend, q_idx.device)
    kw = dict(page_size=page_size, compress_ratio=compress_ratio, block_topk=block_topk, out=out)
    if impl is not reference:
        if schedule is None:
            raise ValueError(f"the Triton {name} needs a schedule: qsa_kernels.select.plan_select(...) or a QSAPlan")
        kw["schedule"] = schedule
    return getattr(impl, name)(q_idx, compressed, block_table, token_to_req, visible_blocks, **kw)


@torch.no_grad()
def select_decode(
    q_idx: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    visible_blocks: torch.Tensor,
    *,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    out: torch.Tensor,
    schedule: "SelectSchedule | None" = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Top-k groups of decode rows: q_idx [Td, Hi, Di] over the paged compressed keys
    [pages, page_size / r, Di] through block_table -> out int32 [Td, Kb] (ascending, -1
    padded; design.md §2.6, §2.7).

    token_to_req int32 [Td], visible_blocks int32 [Td]. schedule: a `SelectSchedule`
    (Triton only).
    """
    return _select("qsa_select_decode", q_idx, compressed, block_table, token_to_req, visible_blocks,
                   page_size, compress_ratio, block_topk, out, schedule, backend)


@torch.no_grad()
def select_prefill(
    q_idx: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    visible_blocks: torch.Tensor,
    *,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    out: torch.Tensor,
    schedule: "SelectSchedule | None" = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Top-k groups of prefill rows (same contract as `select_decode`), scored in row chunks
    under a memory cap."""
    return _select("qsa_select_prefill", q_idx, compressed, block_table, token_to_req, visible_blocks,
                   page_size, compress_ratio, block_topk, out, schedule, backend)


@torch.no_grad()
def expand(
    block_indices: torch.Tensor,
    positions: torch.Tensor,
    visible_blocks: torch.Tensor,
    *,
    compress_ratio: int,
    out: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """block_indices int32 [T, Kb] -> out int32 [T, W + 1]: the chosen groups' tokens, the
    open tail, -1 padding and the count column (design.md §2.8; W >= Kb * r + r - 1, the
    layer's K + r - 1, so that the groups and an open tail of up to r - 1 tokens fit).
    positions int64 [T], visible_blocks int32 [T]."""
    T, Kb = block_indices.shape
    width = Kb * compress_ratio + compress_ratio - 1
    if out.dim() != 2 or out.shape[0] != T or out.shape[1] - 1 < width:
        raise ValueError(f"out must be [T = {T}, W + 1] with W >= Kb * r + r - 1 = {width}, got {tuple(out.shape)}")
    return _impl(backend, block_indices.device).qsa_expand(
        block_indices, positions, visible_blocks, compress_ratio=compress_ratio, out=out
    )


@torch.no_grad()
def sparse_attention(
    q: torch.Tensor,
    gate: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    selection: torch.Tensor,
    *,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    schedule: "AttentionSchedule | None" = None,
    backend: str | None = None,
) -> torch.Tensor:
    """out [T, Hq*D] (q.dtype) = dtype(softmax(q.k * scale) v) * sigmoid(gate) over each
    row's selection (design.md §2.9).

    q, gate [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D] (any strides, contiguous
    last dim; fp8 with per-tensor scales); selection int32 [T, W + 1]. Entries < 0 or >=
    the request's seq_len are ignored; rows with none left are exactly 0. schedule: an
    `AttentionSchedule` (Triton only); out: written in place when given.
    """
    impl = _impl(backend, q.device)
    args = (q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection)
    kw = dict(softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)
    if impl is reference:
        result = impl.qsa_sparse_attention(*args, **kw)
        return result if out is None else out.copy_(result)
    if schedule is None:
        raise ValueError("the Triton sparse_attention needs a schedule: qsa_kernels.attention.plan_attention(...)")
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    return impl.qsa_sparse_attention(*args, **kw, out=out, schedule=schedule)
