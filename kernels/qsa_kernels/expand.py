"""Packed selection rows (expansion, `qsa_core.reference.expand.qsa_expand`) written by the
top-k kernels: each chosen group expanded to its r tokens, then the open tail visible*r .. p,
the -1 padding and the count column. There is no expand launch: the top-k kernels call these
helpers (tests/kernels/entry.py runs them alone against the reference).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _packed_groups(row_out, groups, cols, chosen, r: tl.constexpr):
    """Packed rows (unit column stride): the r tokens g*r .. g*r + r - 1 of each chosen group
    g at columns cols*r .. cols*r + r - 1 (any matching shapes)."""
    for j in tl.static_range(r):
        tl.store(row_out + cols * r + j, groups * r + j, mask=chosen)


@triton.jit
def _packed_tail(row_out, n_groups, vis, p, live, r: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """Packed rows after their n_groups groups: the open tail visible*r .. p, then -1 up to
    column W, and the count in column W, for rows where `live`. Row values are scalars (one
    row) or [ROWS, 1] columns; p is the row's position (-1: padding)."""
    group_cols = n_groups * r
    tail_len = tl.maximum(tl.where(p >= 0, p + 1 - vis.to(tl.int64) * r, 0), 0).to(tl.int32)
    for c0 in range(0, W, BLOCK_W):
        c = c0 + tl.arange(0, BLOCK_W)[None, :]
        tail = tl.where(c < group_cols + tail_len, vis * r + (c - group_cols), -1)
        tl.store(row_out + c, tail, mask=live & (c >= group_cols) & (c < W))
    tl.store(row_out + W, group_cols + tail_len, mask=live)
