"""Test entry points of single Triton ops, over the production launch classes.

Each function takes the arguments of its reference in `qsa_core.reference` (plus the kernel
schedule where one is planned) and binds the production launch for this one call:
`MetadataBuild`, `PrepareLaunch`, `SelectLaunch`, `AttentionLaunch`,
`PrefillAttentionLaunch`. A planner binds those once per step shape and layer cache
instead (`qsa_core.backends.triton`). The kernels' options are the tests' (`OPTS`,
tests/kernel_options.py) unless given; the select and attention launches take theirs from
the schedule. `expand` launches a test kernel over the packed-row writers the top-k kernels
use (`qsa_kernels.select_common`): the product has no expand launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_options import OPTS
from qsa_core.cache import ring_store_fuses
from qsa_core.reference.expand import check_expand_out
from qsa_core.reference.metadata import GUARD_BITS
from qsa_kernels.attention import AttentionLaunch, AttentionSchedule
from qsa_kernels.attention_prefill import PrefillAttentionLaunch, PrefillSchedule
from qsa_kernels.metadata import GuardBits, MetadataBuild
from qsa_kernels.options import KernelOptions
from qsa_kernels.prepare import PrepareLaunch
from qsa_kernels.select import SelectLaunch, SelectSchedule
from qsa_kernels.select_common import packed_groups, packed_tail


def build_metadata(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor, ring_index: torch.Tensor,
    block_table: torch.Tensor, *, compress_ratio: int, ring_capacity: int, max_seq_len: int, max_query_len: int,
    page_size: int, num_live_rows: int, num_slots: int, num_ring_rows: int, token_to_req: torch.Tensor,
    positions: torch.Tensor, visible_blocks: torch.Tensor, ring_slot: torch.Tensor, compressed_slot: torch.Tensor,
    kv_slot: torch.Tensor, request_flags: torch.Tensor, guard: torch.Tensor, num_decodes: int = 0,
    decode_query_len: int = 1, slot_claims: torch.Tensor | None = None, null_ring_row: int = -1,
    options: KernelOptions = OPTS,
) -> None:
    """`reference.qsa_build_metadata` by a `MetadataBuild` (its own arrival counter; the
    reference's guard bits)."""
    MetadataBuild(
        token_to_req=token_to_req, positions=positions, visible_blocks=visible_blocks, ring_slot=ring_slot,
        compressed_slot=compressed_slot, kv_slot=kv_slot, request_flags=request_flags,
        arrive=torch.zeros(2, dtype=torch.int32, device=slot_mapping.device), guard=guard,
        compress_ratio=compress_ratio, ring_capacity=ring_capacity, page_size=page_size, num_slots=num_slots,
        num_ring_rows=num_ring_rows, guards=GuardBits(**GUARD_BITS), slot_claims=slot_claims,
        null_ring_row=null_ring_row, options=options,
    )(query_start_loc, seq_lens, slot_mapping, ring_index, block_table, max_seq_len, max_query_len, num_live_rows,
      num_decodes, decode_query_len)


def prepare(
    index_q: torch.Tensor, raw_keys: torch.Tensor, q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    rope_positions: torch.Tensor, *, index_q_norm: torch.Tensor, index_k_norm: torch.Tensor, q_norm: torch.Tensor,
    k_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor, rope_axes: torch.Tensor, index_dtype: torch.dtype,
    cache, meta, q_idx_out: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
    options: KernelOptions = OPTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.qsa_prepare` by a `PrepareLaunch` (fused ring store where the step allows);
    q_idx / q go into q_idx_out / q_out when given, else new tensors."""
    T, Di = raw_keys.shape
    D = k_norm.shape[0]
    Hi, Hq = index_q.shape[1] // Di, q_gate.shape[1] // (2 * D)
    q_idx = torch.empty(T, Hi, Di, dtype=index_dtype, device=index_q.device) if q_idx_out is None else q_idx_out
    q = torch.empty(T, Hq, D, dtype=q_gate.dtype, device=q_gate.device) if q_out is None else q_out
    if T == 0:
        return q_idx, q, q_gate.view(T, Hq, 2 * D)[..., D:]
    norms = (index_q_norm, index_k_norm, q_norm, k_norm)
    launch = PrepareLaunch(index_q, raw_keys, q_gate, k, v, rope_positions, index_q_norm=index_q_norm,
                           index_k_norm=index_k_norm, q_norm=q_norm, k_norm=k_norm, eps=eps, inv_freq=inv_freq,
                           rope_axes=rope_axes, k_cache=cache.k, v_cache=cache.v, k_scale=cache.k_scale,
                           v_scale=cache.v_scale, compressed=cache.compressed, ring=cache.ring,
                           ring_positions=cache.ring_positions, slot_mapping=meta.slot_mapping,
                           compressed_slot=meta.compressed_slot, token_to_req=meta.token_to_req,
                           positions=meta.positions, ring_slot=meta.ring_slot, query_start_loc=meta.query_start_loc,
                           ring_index=meta.ring_index, compress_ratio=meta.compress_ratio,
                           ring_capacity=meta.ring_capacity, q_idx_out=q_idx, q_out=q,
                           fuse_ring=ring_store_fuses(meta.max_query_len, meta.ring_capacity, meta.compress_ratio),
                           options=options)
    return launch(index_q, raw_keys, q_gate, k, v, rope_positions, *norms, meta.query_start_loc, meta.ring_index)


def _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size, compress_ratio, block_topk,
            out, schedule: SelectSchedule) -> torch.Tensor:
    if q_idx.shape[0] == 0:
        return out
    if q_idx.shape[0] != schedule.num_rows:
        raise ValueError(f"the select schedule was planned for {schedule.num_rows} rows, got {q_idx.shape[0]}")
    return SelectLaunch(schedule, q_idx, compressed, block_table, token_to_req, visible_blocks, out,
                        page_size=page_size, compress_ratio=compress_ratio,
                        block_topk=block_topk)(q_idx, block_table, out)


def select_decode(q_idx: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                  token_to_req: torch.Tensor, visible_blocks: torch.Tensor, *, page_size: int, compress_ratio: int,
                  block_topk: int, out: torch.Tensor, schedule: SelectSchedule) -> torch.Tensor:
    """`reference.qsa_select_decode` by a `SelectLaunch` of `plan_select(..., decode=True)`:
    q_idx [Td, Hi, Di] -> out int32 [Td, Kb]."""
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size, compress_ratio,
                   block_topk, out, schedule)


def select_prefill(q_idx: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor,
                   token_to_req: torch.Tensor, visible_blocks: torch.Tensor, *, page_size: int, compress_ratio: int,
                   block_topk: int, out: torch.Tensor, schedule: SelectSchedule) -> torch.Tensor:
    """`reference.qsa_select_prefill` by a `SelectLaunch` of `plan_select(..., decode=False)`."""
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size, compress_ratio,
                   block_topk, out, schedule)


def sparse_attention(q: torch.Tensor, gate: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, token_to_req: torch.Tensor, seq_lens: torch.Tensor,
                     selection: torch.Tensor, *, softmax_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                     out: torch.Tensor, schedule: AttentionSchedule) -> torch.Tensor:
    """`reference.qsa_sparse_attention` into out [T, Hq*D] by an `AttentionLaunch` of
    `plan_attention(T, Hq, Hkv, D, W, ...)`."""
    if q.shape[0] == 0:
        return out
    launch = AttentionLaunch(q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection,
                             softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale, out=out, schedule=schedule)
    return launch(q, gate, block_table, token_to_req, seq_lens, selection, out)


def prefill_attention(q: torch.Tensor, gate: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, token_to_req: torch.Tensor, seq_lens: torch.Tensor,
                      selection: torch.Tensor, *, softmax_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                      out: torch.Tensor, schedule: PrefillSchedule) -> torch.Tensor:
    """`sparse_attention` by the shared-tile kernels (`PrefillAttentionLaunch` of
    `plan_prefill_attention(T, Hq, Hkv, D, W, r, ...)`)."""
    if q.shape[0] == 0:
        return out
    launch = PrefillAttentionLaunch(q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection,
                                    softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                                    schedule=schedule)
    return launch(q, gate, block_table, token_to_req, seq_lens, selection, out)


@triton.jit
def _expand_kernel(blocks_ptr, stride_b, pos_ptr, vis_ptr, out_ptr, stride_o, Kb: tl.constexpr, W: tl.constexpr,
                   r: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_W: tl.constexpr):
    """One row: its valid groups (0 <= g < visible) compacted in their given order, then the
    packed-row writers of the top-k kernels."""
    t = tl.program_id(0).to(tl.int64)
    row_out = out_ptr + t * stride_o
    p = tl.load(pos_ptr + t)
    vis = tl.load(vis_ptr + t)
    k = tl.arange(0, BLOCK_KB)
    g = tl.load(blocks_ptr + t * stride_b + k, mask=k < Kb, other=-1)
    valid = (g >= 0) & (g < vis)
    rank = tl.cumsum(valid.to(tl.int32), 0) - 1  # the rank-th valid group fills columns rank*r ..
    packed_groups(row_out, g, rank, valid, r)
    packed_tail(row_out, tl.sum(valid.to(tl.int32), 0), vis, p, True, r, W, BLOCK_W)


def expand(block_indices: torch.Tensor, positions: torch.Tensor, visible_blocks: torch.Tensor, *,
           compress_ratio: int, out: torch.Tensor) -> torch.Tensor:
    """`reference.qsa_expand` (out's width checked alike): block_indices int32 [T, Kb] (any row
    stride) -> out int32 [T, W + 1]; positions int64 [T], visible_blocks int32 [T]."""
    T, Kb = block_indices.shape
    check_expand_out(out, T, Kb, compress_ratio)
    if T == 0:
        return out
    W = out.shape[1] - 1
    _expand_kernel[(T,)](
        block_indices, block_indices.stride(0), positions, visible_blocks, out, out.stride(0),
        Kb=Kb, W=W, r=compress_ratio, BLOCK_KB=triton.next_power_of_2(max(Kb, 1)),
        BLOCK_W=min(1024, triton.next_power_of_2(W + 1)),
    )
    return out
