"""Reference of expansion: chosen groups plus the open tail -> packed selection rows."""

from __future__ import annotations

import torch


def qsa_expand(
    block_indices: torch.Tensor,
    positions: torch.Tensor,
    visible_blocks: torch.Tensor,
    *,
    compress_ratio: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """block_indices int32 [T, Kb] -> out int32 [T, W + 1], W = Kb*r + r - 1.

    Row t: the tokens g*r .. g*r + r - 1 of each chosen group g (entries < 0 or >= visible
    are skipped), then the open tail visible*r .. p; -1 padded; last column = count.
    Padding rows (p < 0) become all -1 with count 0.
    """
    r = compress_ratio
    T, Kb = block_indices.shape
    W = out.shape[1] - 1
    g = block_indices.long()
    vis = visible_blocks.long()[:, None]
    valid = (g >= 0) & (g < vis)
    n_groups = valid.sum(1)
    # Stable compaction of valid groups to the front.
    rank = torch.cumsum(valid.long(), 1) - 1
    packed = torch.full((T, Kb + 1), -1, dtype=torch.long, device=g.device)
    packed.scatter_(1, torch.where(valid, rank, Kb), torch.where(valid, g, -1))
    packed = packed[:, :Kb]
    tokens = (packed[:, :, None] * r + torch.arange(r, device=g.device)).reshape(T, Kb * r)
    tokens = torch.where(packed.repeat_interleave(r, 1) >= 0, tokens, -1)
    p = positions.long()
    tail_len = torch.where(p >= 0, p + 1 - vis[:, 0] * r, 0).clamp(min=0)
    col = torch.arange(W, device=g.device)[None, :]
    group_cols = n_groups[:, None] * r
    tail = vis * r + (col - group_cols)
    in_tail = (col >= group_cols) & (col < group_cols + tail_len[:, None])
    from_groups = torch.cat((tokens, tokens.new_full((T, W - Kb * r), -1)), 1)
    row = torch.where(col < group_cols, from_groups, torch.where(in_tail, tail, -1))
    out[:, :W] = row.to(out.dtype)
    out[:, W] = (n_groups * r + tail_len).to(out.dtype)
    return out
