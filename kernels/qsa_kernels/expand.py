"""Triton expansion: chosen groups plus the open tail -> packed selection rows.

Mirrors `qsa_core.reference.expand.qsa_expand`. One program per row: the valid groups
(0 <= g < visible) are compacted in their given order by a prefix sum, each is expanded to
its r tokens, then the tail visible*r .. p and the -1 padding follow, and the count column.
`ExpandLaunch` binds it (`qsa_kernels.launch`) to a plan's workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launcher

BLOCK_COLS = 1024


@triton.jit
def _expand_kernel(
    blocks_ptr, stride_b, pos_ptr, vis_ptr, out_ptr, stride_o,
    Kb: tl.constexpr, W: tl.constexpr,
    r: tl.constexpr, BLOCK_KB: tl.constexpr, R_POW2: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row_out = out_ptr + t * stride_o
    p = tl.load(pos_ptr + t)
    vis = tl.load(vis_ptr + t)
    k = tl.arange(0, BLOCK_KB)
    g = tl.load(blocks_ptr + t * stride_b + k, mask=k < Kb, other=-1)
    valid = (g >= 0) & (g < vis)
    rank = tl.cumsum(valid.to(tl.int32), 0) - 1
    n_groups = tl.sum(valid.to(tl.int32), 0)
    # Group tokens: the rank-th valid group fills columns rank*r .. rank*r + r - 1.
    j = tl.arange(0, R_POW2)
    cols = rank[:, None] * r + j[None, :]
    tokens = g[:, None] * r + j[None, :]
    tl.store(row_out + cols, tokens, mask=valid[:, None] & (j < r)[None, :] & (cols < W))
    # Tail and padding: every column from n_groups*r on.
    group_cols = n_groups * r
    tail_len = tl.maximum(tl.where(p >= 0, p + 1 - vis.to(tl.int64) * r, 0), 0).to(tl.int32)
    for c0 in range(0, W, BLOCK_W):
        c = c0 + tl.arange(0, BLOCK_W)
        tail = tl.where(c < group_cols + tail_len, vis * r + (c - group_cols), -1)
        tl.store(row_out + c, tail, mask=(c >= group_cols) & (c < W))
    tl.store(row_out + W, group_cols + tail_len)


_expand = Launcher(_expand_kernel)


class ExpandLaunch:
    """`qsa_expand` bound to fixed block_indices [T, Kb], positions and visible_blocks (a
    plan's workspace); `__call__(out)` writes out int32 [T, W + 1] (any row stride)."""

    def __init__(self, block_indices: torch.Tensor, positions: torch.Tensor, visible_blocks: torch.Tensor, *,
                 compress_ratio: int, out: torch.Tensor) -> None:
        T, Kb = block_indices.shape
        W = out.shape[1] - 1
        self.shape = (T, W + 1)
        self._launch = _expand.bind(
            (T,), block_indices, block_indices.stride(0), positions, visible_blocks, out, out.stride(0),
            free=("out_ptr", "stride_o"),
            Kb=Kb, W=W, r=compress_ratio,
            BLOCK_KB=triton.next_power_of_2(max(Kb, 1)),
            R_POW2=triton.next_power_of_2(compress_ratio),
            BLOCK_W=min(BLOCK_COLS, triton.next_power_of_2(W + 1)),
        )

    def __call__(self, out: torch.Tensor) -> torch.Tensor:
        if out.shape != self.shape:
            raise ValueError(f"expand out must be [{self.shape[0]}, {self.shape[1]}], got {tuple(out.shape)}")
        self._launch(out, out.stride(0))
        return out


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
    have any row stride (contiguous last dim). Binds on every call: a plan keeps an
    `ExpandLaunch` instead.
    """
    if block_indices.shape[0] == 0:
        return out
    return ExpandLaunch(block_indices, positions, visible_blocks, compress_ratio=compress_ratio, out=out)(out)
