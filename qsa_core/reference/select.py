"""Reference of selection: group scores over compressed keys and top-k in a total order."""

from __future__ import annotations

import math

import torch

# Cap on the fp32 score scratch of one chunk of rows (bytes); never [rows, all columns].
SCORE_SCRATCH_BYTES = 64 << 20


def compressed_rows(
    block_table: torch.Tensor, req: int, num_groups: int, page_size: int, compress_ratio: int
) -> torch.Tensor:
    """Flat compressed rows of groups 0..num_groups-1 of request `req`: int64 [G].

    row(g) = block_table[req, g*r // page_size] * (page_size / r) + (g*r % page_size) / r,
    i.e. page row // (page_size / r), row in page row % (page_size / r) (`paged_rows`).
    """
    r = compress_ratio
    tok = torch.arange(num_groups, device=block_table.device, dtype=torch.int64) * r
    pages = block_table[req, tok // page_size].long()
    return pages * (page_size // r) + (tok % page_size) // r


def paged_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a paged view cache [pages, rows_per_page, ...] at flat row indices rows [N]."""
    per_page = cache.shape[1]
    return cache[rows // per_page, rows % per_page]


def group_scores(q_idx: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """s[t, g] = sum_h relu(q[t, h] . k[g]) / sqrt(Di) in fp32; q [T, Hi, Di], keys [G, Di].

    `+ 0.0` folds -0.0 into +0.0 so that ReLU zeros tie exactly.
    """
    s = torch.einsum("thd,gd->thg", q_idx.float(), keys.float())
    return s.relu().sum(1) / math.sqrt(q_idx.shape[-1]) + 0.0


def topk_groups(scores: torch.Tensor, visible: torch.Tensor, block_topk: int) -> torch.Tensor:
    """Choose min(Kb, visible) groups per row; int32 [T, Kb], ascending group index, -1 padded.

    Order: higher score first, then lower group index. Columns >= visible never count.
    """
    T, G = scores.shape
    cols = torch.arange(G, device=scores.device)
    masked = torch.where(cols[None, :] < visible[:, None], scores, -torch.inf)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices
    k = min(block_topk, G)
    chosen = order[:, :k]
    take = torch.arange(k, device=scores.device)[None, :] < visible[:, None]
    chosen = torch.where(take, chosen, G).sort(dim=1).values
    out = torch.full((T, block_topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = torch.where(chosen < G, chosen, -1).to(torch.int32)
    return out


def _select(
    q_idx: torch.Tensor,
    compressed: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    visible_blocks: torch.Tensor,
    page_size: int,
    compress_ratio: int,
    block_topk: int,
    out: torch.Tensor,
) -> torch.Tensor:
    out.fill_(-1)
    if q_idx.shape[0] == 0:
        return out
    reqs = token_to_req.long()
    vis = visible_blocks.long()
    for req in torch.unique(reqs).tolist():
        rows = (reqs == req).nonzero().flatten()
        G = int(vis[rows].max())
        if G == 0:
            continue
        keys = paged_rows(compressed, compressed_rows(block_table, req, G, page_size, compress_ratio))
        chunk = max(1, SCORE_SCRATCH_BYTES // (4 * G * q_idx.shape[1]))
        for i in range(0, rows.numel(), chunk):
            part = rows[i : i + chunk]
            scores = group_scores(q_idx[part], keys)
            out[part] = topk_groups(scores, vis[part], block_topk)
    return out


def qsa_select_decode(
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
) -> torch.Tensor:
    """Decode rows: q_idx [Td, Hi, Di], compressed [pages, page_size / r, Di] -> out int32 [Td, Kb]."""
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size, compress_ratio, block_topk, out)


def qsa_select_prefill(
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
) -> torch.Tensor:
    """Prefill rows (same contract as decode); scores in row chunks under a memory cap."""
    return _select(q_idx, compressed, block_table, token_to_req, visible_blocks, page_size, compress_ratio, block_topk, out)
