"""Triton exact top-k of scored rows without histograms, in one or two launches (design.md §2.7).

Contract: `qsa_core.reference.select.topk_groups` (and `select_radix.TopkLaunch`'s): input a
chunk's fp32 score scratch [chunk rows, num_cols] (scores >= 0, -0.0 folded into +0.0, so the
int32 bits order like the values; columns >= visible are garbage); output per row the Kb
largest groups, ties to the lowest group index, in ascending group order; rows with
visible <= Kb take groups 0..visible-1 unscored, -1 padded; or (PACKED) the packed selection
rows, as `select_radix` writes them (`select_common.packed_groups` / `packed_tail`).

The threshold (the Kb-th largest key) is found by counts, no histogram: the bracket search
(`kth_bound`: the keys >= each of 2^SBITS candidates counted at once, the bracket narrowed
until it isolates the threshold); `kth_key`, a radix search of 2^BITS prefixes a step over
31 key bits, serves `select_prefill`'s plans that ask for it, and `resolve_row` streams it
over a whole row. Then keys above it and the lowest-index keys equal to it are written at
their ascending positions (one scan).

- Short (`_topk_short_kernel`, grid: rows): num_cols <= CAP; the whole row in registers.
  Its threshold comes from a bracket search (`kth_bound`) that stops once the bracket
  isolates it (2^SBITS counts per step: ~4 steps on random scores, not 31 / BITS), and the
  emit skips its count of keys above it (H200, session 8: the top-k alone 12.8 -> 8.5 us
  at 8K B1, 13.6 -> 11.2 at 8K B64, 17.1 -> 14.2 at 16K B4, against `kth_key`'s 16 steps).
- Long (`_topk_seg_kernel`, grid: rows x segments of SEG columns): a lower bound L of the
  row's threshold from samples (the maxima of disjoint column subsets are real keys, so the
  row has at least Kb keys >= their Kb-th largest; `samples_bound`, the bracket search);
  each segment compacts its keys >= L (ascending column) into its candidate list; the program
  that completes the row (its only program, or the last to arrive at the row's counter)
  resolves the row over the lists in registers (the bracket search again). One segment:
  the program samples its row itself (one launch). Several: `_sample_kernel` (grid: rows x
  segments) writes each segment's subset maxima first (two launches). More than CAP
  candidates in a row or LCAP in one list (keys crowded near the threshold) send the row to
  an exact resolve that loops over the whole row (`resolve_row`): slower, same result. `select._topk_route` picks which decode chunks
  come here.

Deterministic and batch-invariant: every count and position is order-independent, lists
sit at fixed offsets, and no row reads another's state. `TopkLaunch` binds one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions
from .select_common import (compact_segment, emit_above, kth_bound, resolve_row, samples_bound, score_keys, write_short,
                            write_tail)
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


@triton.jit
def _subset_max(s_row, lo, hi, SAMP: tl.constexpr, SBLOCK: tl.constexpr):
    """Maxima [SAMP] of the keys of columns [lo, hi) by subset (c - lo) mod SAMP, -1 where a
    subset is empty; SBLOCK (a multiple of SAMP) columns per step."""
    ar = tl.arange(0, SBLOCK)
    m = tl.full((SAMP,), -1, tl.int32)
    start = lo
    while start < hi:  # (while: the interpreter cannot range over loaded values)
        cols = start + ar
        key = score_keys(s_row, cols, cols < hi)
        m = tl.maximum(m, tl.max(tl.reshape(key, (SBLOCK // SAMP, SAMP)), 0))
        start += SBLOCK
    return m


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr", "stride_pr"])
def _sample_kernel(
    s_ptr, vis_ptr, samp_ptr, row0, n_cols, stride_sr, stride_pr,
    KB: tl.constexpr, SEG: tl.constexpr, SAMP: tl.constexpr, SBLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Subset maxima of one segment -> samp int32 [chunk rows, segments * SAMP] (rows with
    visible > KB, segments holding visible columns)."""
    pdl_start(PDL)
    lr = tl.program_id(0)
    seg = tl.program_id(1)
    vis = tl.minimum(tl.load(vis_ptr + row0 + lr), n_cols)
    lo = seg * SEG
    if (vis > KB) & (lo < vis):
        m = _subset_max(s_ptr + lr.to(tl.int64) * stride_sr, lo, tl.minimum(vis, lo + SEG), SAMP, SBLOCK)
        tl.store(samp_ptr + lr.to(tl.int64) * stride_pr + seg * SAMP + tl.arange(0, SAMP), m)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr", "stride_pr", "stride_cr"])
def _topk_seg_kernel(
    s_ptr, vis_ptr, samp_ptr, cidx_ptr, ckey_ptr, cnt_ptr, arrive_ptr, out_ptr, pos_ptr,
    row0, n_cols, stride_sr, stride_pr, stride_cr, stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, BITS: tl.constexpr, SBITS: tl.constexpr, SEG: tl.constexpr,
    SEGP: tl.constexpr, SAMP: tl.constexpr, SBLOCK: tl.constexpr, CAP: tl.constexpr, LCAP: tl.constexpr, BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """One segment of a row (grid: rows x segments). Candidate lists: cidx / ckey int32
    [chunk rows, SEGP * CAP] (list s at s * CAP), their lengths cnt int32 [chunk rows, SEGP];
    arrive int32 [chunk rows] zero between calls (the last arriver resets it). SEGP == 1:
    the program samples its row itself (SAMP subset maxima), else it reads samp int32
    [chunk rows, SEGP * SAMP] from `_sample_kernel`. The resolving program packs the lists
    behind list 0 in one step (at most CAP candidates in all and LCAP per list, else the
    whole-row resolve)."""
    pdl_start(PDL)
    lr = tl.program_id(0)
    seg = tl.program_id(1)
    row = row0 + lr
    vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    s_row = s_ptr + lr.to(tl.int64) * stride_sr
    n_seg = tl.cdiv(vis, SEG)
    if vis <= KB:
        if seg == 0:
            write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
            write_short(out_row, stride_oc, vis, KB, KBP, PACKED, R)
    elif seg < n_seg:
        lo = seg * SEG
        hi = tl.minimum(vis, lo + SEG)
        if SEGP == 1:
            samples = _subset_max(s_row, lo, hi, SAMP, SBLOCK)
        else:
            p = tl.arange(0, SEGP * SAMP)
            samples = tl.load(samp_ptr + lr.to(tl.int64) * stride_pr + p, mask=p < n_seg * SAMP, other=-1)
        bound = samples_bound(samples, KB, SBITS)  # <= the row's KB-th largest key
        c_idx = cidx_ptr + lr.to(tl.int64) * stride_cr
        c_key = ckey_ptr + lr.to(tl.int64) * stride_cr
        n = compact_segment(s_row, lo, hi, bound, c_idx + seg * CAP, c_key + seg * CAP, CAP, BLOCK)
        tl.store(cnt_ptr + lr.to(tl.int64) * SEGP + seg, n)
        last = n_seg == 1
        if SEGP > 1:
            tl.debug_barrier()  # this program's lists and count before its arrival
            last = tl.atomic_add(arrive_ptr + lr, 1, sem="acq_rel", scope="gpu") == n_seg - 1
        if last:
            write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
            packed = n <= CAP
            j = tl.arange(0, CAP)
            if SEGP > 1:
                tl.store(arrive_ptr + lr, 0)  # clean for the next call
                segs = tl.arange(0, SEGP)
                cnt = tl.load(cnt_ptr + lr.to(tl.int64) * SEGP + segs, mask=segs < n_seg, other=0,
                              cache_modifier=".cg")
                packed = (tl.sum(cnt, 0) <= CAP) & (tl.max(cnt, 0) <= LCAP)
                if packed:  # lists 1.. behind list 0, ascending columns throughout
                    jj = tl.arange(0, LCAP)[None, :]
                    m = (jj < cnt[:, None]) & (segs[:, None] > 0)
                    src = segs[:, None] * CAP + jj
                    dst = (tl.cumsum(cnt, 0) - cnt)[:, None] + jj
                    idx_s = tl.load(c_idx + src, mask=m, cache_modifier=".cg")
                    key_s = tl.load(c_key + src, mask=m, cache_modifier=".cg")
                    tl.store(c_idx + dst, idx_s, mask=m)
                    tl.store(c_key + dst, key_s, mask=m)
                    tl.debug_barrier()
                    n = tl.sum(cnt, 0)
            if packed:
                m = j < n
                key = tl.load(c_key + j, mask=m, other=-1, cache_modifier=".cg")
                idx = tl.load(c_idx + j, mask=m, other=0, cache_modifier=".cg")
                thr, n_above = kth_bound(key, n, KB, SBITS)
                emit_above(key, idx, thr, n_above, out_row, stride_oc, KB, PACKED, R)
            else:
                resolve_row(s_row, vis, out_row, stride_oc, KB, BITS, RBLOCK, PACKED, R)
    pdl_end(PDL)


_short = Launcher(_topk_short_kernel)
_sample = Launcher(_sample_kernel)
_seg = Launcher(_topk_seg_kernel)


def topk_tiles(num_cols: int, small: bool, rows: int = 1) -> dict[str, int]:
    """Launch shapes for chunks of `rows` rows of num_cols columns. short: columns of the
    short route (whole row in registers): 4096, or 8192 for chunks of fewer than 16 rows
    (H200, session 8: 32K B4 select 40.6 us on the radix route, 26.0 short; chunks of 16-64
    such rows keep the segment route, unmeasured against it); seg: columns per segment program; samp: subset maxima per segment (the
    row's samples number samp x segments, >= 4 Kb keeps the bound tight); cap: candidates of
    a row (and of a segment's list); lcap: candidates per list the resolve packs in one
    step; block / rblock: columns per sweep step (compaction / the whole-row resolve); bits:
    key bits per step of the whole-row resolve (`kth_key`); sbits: log2 of the short route's
    counts per step (`kth_bound`); ssbits: the same for the segment route's bound and resolve
    (H200, session 14, select us, `kth_key` at 2 bits a step -> ssbits 3: 1M B4 x 4 141.8 ->
    136.5, 128K B16 x 4 94.6 -> 87.5); early: the short route loads scores with the visible
    count; warps per program. small: the interpreter's tiles (tests cross every border and
    route with few columns)."""
    if small:
        return dict(short=32, seg=64, samp=16, cap=32, lcap=16, block=16, rblock=16, bits=4, sbits=2, ssbits=2, early=0,
                    warps=4)
    # sbits: the search's compare [row, 2^sbits] holds at most 64 keys a thread (16 warps): no
    # spill; 3 (8 counts a step) measured best or even up to 4096 columns (H200, session 8:
    # 8K B1 / B4 / B64, 16K B4, on the step's scores and on mixed rows), 2 at 8192.
    cap_bits = triton.next_power_of_2(max(num_cols, 1)).bit_length() - 1
    t = dict(short=8192 if rows < 16 else 4096, seg=32768, samp=2048, cap=2048, lcap=2048, block=4096, rblock=1024,
             bits=2, sbits=min(3, max(2, 15 - cap_bits)), ssbits=3, early=0, warps=16)
    segs = triton.cdiv(max(num_cols, 1), t["seg"])
    if segs > 1:
        segp = triton.next_power_of_2(segs)
        t.update(samp=max(t["samp"] // segp, 64), lcap=min(t["cap"], max(8192 // segp, 64)))
    return t


def short_route(num_cols: int, tiles: dict) -> bool:
    """Whether rows of num_cols columns take the one-program, all-in-registers route."""
    return num_cols <= tiles["short"]


@dataclass(frozen=True)
class TopkScratch:
    """Scratch of the long route for a chunk of rows (views): samples, candidate indices and
    keys, list lengths, arrival counters (zero between calls)."""

    samples: torch.Tensor
    cand_idx: torch.Tensor
    cand_key: torch.Tensor
    counts: torch.Tensor
    arrive: torch.Tensor


def topk_scratch_elems(rows: int, num_cols: int, tiles: dict) -> dict[str, int]:
    """int32 elements of each `TopkScratch` field for `rows` rows of num_cols columns."""
    if short_route(num_cols, tiles):
        return dict(samples=1, cand_idx=1, cand_key=1, counts=1, arrive=1)
    segp = triton.next_power_of_2(triton.cdiv(num_cols, tiles["seg"]))
    return dict(samples=rows * segp * tiles["samp"] if segp > 1 else 1, cand_idx=rows * segp * tiles["cap"],
                cand_key=rows * segp * tiles["cap"], counts=rows * segp, arrive=rows)


def topk_scratch(rows: int, num_cols: int, tiles: dict, device: torch.device | str) -> TopkScratch:
    """Allocate the scratch of `topk_scratch_elems` (arrival counters zeroed)."""
    n = topk_scratch_elems(rows, num_cols, tiles)
    return TopkScratch(**{k: (torch.zeros if k == "arrive" else torch.empty)(v, dtype=torch.int32, device=device)
                          for k, v in n.items()})


class TopkLaunch(ChunkLaunches):
    """The top-k launches of one chunk of `rows` rows (from a free first row `row0`) bound to
    the score scratch fp32 [>= rows, num_cols], visible_blocks int32 [T] and `scratch`
    (`topk_scratch(rows, num_cols, tiles)`); `__call__(row0, out, out_row_stride)` launches
    them into out: int32 [T, Kb] (any strides; `out` at binding fixes its column stride) or,
    with `positions` int64 [T] given, the packed selection int32 [T, W + 1] (contiguous rows;
    W = width - 1, r = compress_ratio). One launch for short rows or one segment, two for
    several segments."""

    def __init__(self, scores: torch.Tensor, visible_blocks: torch.Tensor, out: torch.Tensor, scratch: TopkScratch,
                 *, row0: int, rows: int, num_cols: int, block_topk: int, tiles: dict,
                 positions: torch.Tensor | None = None, compress_ratio: int = 1,
                 options: KernelOptions = DEFAULT) -> None:
        Kb, KBP, sr, t = block_topk, triton.next_power_of_2(block_topk), scores.stride(0), tiles
        write, pos = packed_write(out, positions, visible_blocks, compress_ratio)
        free, out_free = ("row0",), ("row0", "out_ptr", "stride_or")
        outs = (out.stride(0), out.stride(1))
        self._launches: list[tuple[BoundLaunch, bool]] = []
        if short_route(num_cols, t):
            self._launches.append((_short.bind(
                (rows,), scores, visible_blocks, out, pos, row0, num_cols, sr, *outs, free=out_free, options=options,
                KB=Kb, KBP=KBP, CAP=triton.next_power_of_2(max(num_cols, 1)), SBITS=t["sbits"], EARLY=t["early"], **write, num_warps=t["warps"],
            ), True))
            return
        segs = triton.cdiv(num_cols, t["seg"])
        segp = triton.next_power_of_2(segs)
        c = scratch
        n = topk_scratch_elems(rows, num_cols, t)
        samp = c.samples[: n["samples"]].view(rows, -1) if segp > 1 else c.samples
        cidx, ckey = (x[: n["cand_idx"]].view(rows, -1) for x in (c.cand_idx, c.cand_key))
        if segp > 1:
            self._launches.append((_sample.bind(
                (rows, segs), scores, visible_blocks, samp, row0, num_cols, sr, samp.stride(0), free=free, options=options,
                KB=Kb, SEG=t["seg"], SAMP=t["samp"], SBLOCK=max(t["samp"], t["block"]), num_warps=t["warps"],
            ), False))
        self._launches.append((_seg.bind(
            (rows, segs), scores, visible_blocks, samp, cidx, ckey, c.counts, c.arrive, out, pos,
            row0, num_cols, sr, samp.stride(0) if segp > 1 else 0, cidx.stride(0), *outs, free=out_free, options=options,
            KB=Kb, KBP=KBP, BITS=t["bits"], SBITS=t["ssbits"], SEG=t["seg"], SEGP=segp, SAMP=t["samp"],
            SBLOCK=max(t["samp"], t["block"]), CAP=t["cap"], LCAP=t["lcap"], BLOCK=t["block"], RBLOCK=t["rblock"],
            **write, num_warps=t["warps"],
        ), True))
