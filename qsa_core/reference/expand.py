"""Reference of expansion: chosen groups plus the open tail -> packed selection rows."""

from __future__ import annotations

import torch


def check_expand_out(out: torch.Tensor, num_rows: int, block_topk: int, compress_ratio: int) -> None:
    """out must be [T, W + 1] with W >= Kb * r + r - 1: room for Kb groups of r tokens and
    an open tail of up to r - 1 (a narrower row would take group tokens past its end, or
    count a tail it has no room for)."""
    width = block_topk * compress_ratio + compress_ratio - 1
    if out.dim() != 2 or out.shape[0] != num_rows or out.shape[1] - 1 < width:
        raise ValueError(f"out must be [T = {num_rows}, W + 1] with W >= Kb * r + r - 1 = {width}, "
                         f"got {tuple(out.shape)}")


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
    check_expand_out(out, T, Kb, r)
    W = out.shape[1] - 1
    g = block_indices.long()
    vis = visible_blocks.long()
    valid = (g >= 0) & (g < vis[:, None])
    n_groups = valid.sum(1)
    # Stable compaction of valid groups to the front.
    rank = torch.cumsum(valid.long(), 1) - 1
    packed = torch.full((T, Kb + 1), -1, dtype=torch.long, device=g.device)
    packed.scatter_(1, torch.where(valid, rank, Kb), torch.where(valid, g, -1))
    packed = packed[:, :Kb, None]
    groups = out[:, : Kb * r].view(T, Kb, r)
    groups.copy_(packed * r + torch.arange(r, device=g.device))
    groups.masked_fill_(packed < 0, -1)
    out[:, Kb * r :].fill_(-1)
    # The open tail right after the chosen groups' tokens (r - 1 tokens at most when
    # visible_blocks comes from the metadata; any length up to column W otherwise).
    p = positions.long()
    tail_len = torch.where(p >= 0, p + 1 - vis * r, 0).clamp(min=0)
    j = torch.arange(min(W, int(tail_len.max())) if T else 0, device=g.device)[None, :]
    in_tail = (j < tail_len[:, None]) & (n_groups[:, None] * r + j < W)
    cols = torch.where(in_tail, n_groups[:, None] * r + j, W)  # W: a dump column, rewritten below
    out.scatter_(1, cols, torch.where(in_tail, vis[:, None] * r + j, -1).to(out.dtype))
    out[:, W] = (n_groups * r + tail_len).to(out.dtype)
    return out
