"""Triton expansion: chosen groups plus the open tail -> packed selection rows.

Mirrors `qsa_core.reference.expand.qsa_expand`. One program per row: the valid groups
(0 <= g < visible) are compacted in their given order by a prefix sum, each is expanded to
its r tokens, then the tail visible*r .. p and the -1 padding follow, and the count column.
The layer's top-k kernels write packed rows with the same helpers (`packed_groups`,
`packed_tail`), so a planned step never launches it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .select_common import packed_groups, packed_tail

BLOCK_COLS = 1024


@triton.jit
def _expand_kernel(
    blocks_ptr, stride_b, pos_ptr, vis_ptr, out_ptr, stride_o,
    Kb: tl.constexpr, W: tl.constexpr,
    r: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row_out = out_ptr + t * stride_o
    p = tl.load(pos_ptr + t)
    vis = tl.load(vis_ptr + t)
    k = tl.arange(0, BLOCK_KB)
    g = tl.load(blocks_ptr + t * stride_b + k, mask=k < Kb, other=-1)
    valid = (g >= 0) & (g < vis)
    # The rank-th valid group fills columns rank*r .. rank*r + r - 1.
    rank = tl.cumsum(valid.to(tl.int32), 0) - 1
    packed_groups(row_out, g, rank, valid, r)
    packed_tail(row_out, tl.sum(valid.to(tl.int32), 0), vis, p, True, r, W, BLOCK_W)


def qsa_expand(
    block_indices: torch.Tensor,
    positions: torch.Tensor,
    visible_blocks: torch.Tensor,
    *,
    compress_ratio: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """block_indices int32 [T, Kb] -> out int32 [T, W + 1] (W >= Kb*r); same as the reference.

    positions int64 [T] and visible_blocks int32 [T] contiguous; block_indices and out may
    have any row stride (contiguous last dim). The layer never launches it: its top-k
    writes packed rows itself (`select_radix`, the same `packed_groups` / `packed_tail`).
    """
    T, Kb = block_indices.shape
    if T == 0:
        return out
    W = out.shape[1] - 1
    _expand_kernel[(T,)](
        block_indices, block_indices.stride(0), positions, visible_blocks, out, out.stride(0),
        Kb=Kb, W=W, r=compress_ratio, BLOCK_KB=triton.next_power_of_2(max(Kb, 1)),
        BLOCK_W=min(BLOCK_COLS, triton.next_power_of_2(W + 1)),
    )
    return out
