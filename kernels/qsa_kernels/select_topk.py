"""Triton exact top-k of short scored rows without histograms, one launch (design.md §2.7).

Contract: `qsa_core.reference.select.topk_groups` (and `select_radix.TopkLaunch`'s): input a
chunk's fp32 score scratch [chunk rows, num_cols] (scores >= 0, -0.0 folded into +0.0, so the
int32 bits order like the values; columns >= visible are garbage); output per row the Kb
largest groups, ties to the lowest group index, in ascending group order; rows with
visible <= Kb take groups 0..visible-1 unscored, -1 padded; or (PACKED) the packed selection
rows, as `select_radix` writes them (`select_common.packed_groups` / `packed_tail`).

`_topk_short_kernel` (grid: rows) holds a row of num_cols <= CAP columns in registers. Its
threshold (the Kb-th largest key) comes from counts, no histogram: the bracket search
(`select_common.kth_bound`: the keys >= each of 2^SBITS candidates counted at once, the bracket
narrowed until it isolates the threshold: ~4 steps on random scores, not the 16 of a radix
search of 2 bits a step), and the emit writes the keys above it and the lowest-index keys equal
to it at their ascending positions (one scan, no count of the keys above). Deterministic and
batch-invariant: every count and position is order-independent and no row reads another's
state. `TopkLaunch` binds one chunk; `select.plan_select` picks the decode chunks that come here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions
from .select_common import emit_above, kth_bound, score_keys, write_short, write_tail
from .select_radix import ChunkLaunches, packed_write


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr"])
def _topk_short_kernel(
    s_ptr, vis_ptr, out_ptr, pos_ptr, row0, n_cols, stride_sr, stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, CAP: tl.constexpr, SBITS: tl.constexpr, EARLY: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Top-k of one row of at most CAP columns, all in registers (PACKED: the packed row).
    The threshold: `kth_bound` (2^SBITS counts a step, until isolated). EARLY: the row's scores load with its visible count (all n_cols
    columns, masked after), not after it."""
    pdl_start(PDL)
    lr = tl.program_id(0)
    row = row0 + lr
    if EARLY:
        s = tl.load(s_ptr + lr.to(tl.int64) * stride_sr + tl.arange(0, CAP), mask=tl.arange(0, CAP) < n_cols,
                    other=0.0)
    vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
    if vis <= KB:
        write_short(out_row, stride_oc, vis, KB, KBP, PACKED, R)
    else:
        cols = tl.arange(0, CAP)
        if EARLY:
            key = tl.where(cols < vis, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)
        else:
            key = score_keys(s_ptr + lr.to(tl.int64) * stride_sr, cols, cols < vis)
        thr, n_above = kth_bound(key, vis, KB, SBITS)
        emit_above(key, cols, thr, n_above, out_row, stride_oc, KB, PACKED, R)
    pdl_end(PDL)


_short = Launcher(_topk_short_kernel)


@dataclass(frozen=True)
class TopkTiles:
    """Launch shape of the short top-k (`topk_tiles`).

    short: the most columns a row may have (the whole row in registers); sbits: log2 of the
    counts per step of the bracket search (`kth_bound`); early: the row's scores load with its
    visible count (all columns, masked after), not after it; warps: per program."""

    short: int
    sbits: int
    early: int
    warps: int


def topk_tiles(num_cols: int, small: bool, rows: int = 1) -> TopkTiles:
    """The short top-k's launch shape for chunks of `rows` rows of num_cols columns. small
    (`KernelOptions.small_tiles`): rows of up to 32 columns, so that tests reach both sides of
    the bound with few columns.

    short: 8192 columns for chunks of fewer than 16 rows, else 4096: up to there one program per
    row beats the radix passes' launches on the H200 (NOTES.md (Kernels)); chunks of more rows or
    longer rows take the per-row-samples route or the radix passes (`select.plan_select`). Measure:
    `python benchmarks/bench_qsa.py --only decode-32768-4-1-bf16 decode-8192-1-1-bf16 --out DIR`.
    sbits: 3 (8 counts a step) up to 4096 columns, 2 at 8192: the search's compare [row, 2^sbits]
    then holds at most 64 keys a thread at 16 warps (no spill), and 3 measured fastest up to
    4096 columns on the H200 (8K B1 / B4 / B64, 16K B4); same command."""
    if small:
        return TopkTiles(short=32, sbits=2, early=0, warps=4)
    cap_bits = triton.next_power_of_2(max(num_cols, 1)).bit_length() - 1
    return TopkTiles(short=8192 if rows < 16 else 4096, sbits=min(3, max(2, 15 - cap_bits)), early=0, warps=16)


def short_route(num_cols: int, tiles: TopkTiles) -> bool:
    """Whether rows of num_cols columns fit the one-program, all-in-registers top-k."""
    return num_cols <= tiles.short


class TopkLaunch(ChunkLaunches):
    """The top-k launch of one chunk of `rows` rows (from a free first row `row0`) of at most
    tiles.short columns, bound to the score scratch fp32 [>= rows, num_cols] and visible_blocks
    int32 [T]; `__call__(row0, out, out_row_stride)` launches it into out: int32 [T, Kb] (any
    strides; `out` at binding fixes its column stride) or, with `positions` int64 [T] given, the
    packed selection int32 [T, W + 1] (contiguous rows; W = width - 1, r = compress_ratio)."""

    def __init__(self, scores: torch.Tensor, visible_blocks: torch.Tensor, out: torch.Tensor, *, row0: int, rows: int,
                 num_cols: int, block_topk: int, tiles: TopkTiles, positions: torch.Tensor | None = None,
                 compress_ratio: int = 1, options: KernelOptions = DEFAULT) -> None:
        if not short_route(num_cols, tiles):
            raise ValueError(f"the short top-k takes rows of at most {tiles.short} columns, got num_cols {num_cols}")
        Kb, t = block_topk, tiles
        write, pos = packed_write(out, positions, visible_blocks, compress_ratio)
        self._launches = [(_short.bind(
            (rows,), scores, visible_blocks, out, pos, row0, num_cols, scores.stride(0), out.stride(0), out.stride(1),
            free=("row0", "out_ptr", "stride_or"), options=options, KB=Kb, KBP=triton.next_power_of_2(Kb),
            CAP=triton.next_power_of_2(max(num_cols, 1)), SBITS=t.sbits, EARLY=t.early, **write, num_warps=t.warps,
        ), True)]
