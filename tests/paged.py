"""Shared test data: request page tables over a shuffled page pool."""

from __future__ import annotations

import math

import torch


def shuffled_block_table(
    seq_lens: list[int], page: int, g: torch.Generator, *, spare_cols: int, spare_pages: int
) -> tuple[torch.Tensor, int]:
    """int32 [R, max pages + spare_cols] table (-1 past each request's pages) drawn from a
    random permutation of a pool of sum(pages) + spare_pages pages; returns (table, pool size)."""
    pages_per_req = [math.ceil(s / page) for s in seq_lens]
    num_pages = sum(pages_per_req) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((len(seq_lens), max(pages_per_req) + spare_cols), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages_per_req):
        table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return table, num_pages
