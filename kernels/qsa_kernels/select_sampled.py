"""Triton exact top-k of few long decode rows from the score launch's samples: one launch.

Contract: `qsa_core.reference.select.topk_groups` (and `select_radix.TopkLaunch`'s): input a
chunk's fp32 score scratch [chunk rows, num_cols] (scores >= 0, -0.0 folded into +0.0, so the
int32 bits order like the values; columns >= visible are garbage) and the samples the score
launch wrote with it (`select_score`, SAMPLE: per row, the largest key of every run of S
columns below visible); output per row the Kb largest groups, ties to the lowest group index,
in ascending group order (or, PACKED, the packed selection rows); rows with visible <= Kb take
groups 0..visible-1 unscored.

`_topk_sampled_kernel` (grid: rows x segments of SEG columns): every program of a row derives
the same lower bound L of the row's Kb-th largest key from the row's samples (the Kb-th largest
sample: the maxima of disjoint runs are real keys, so at least Kb keys are >= it; `_kth_key`
to LBITS high bits, lower bits 0, is <= that), compacts its segment's keys >= L (ascending
column) into its candidate list (LCAP entries), and arrives at the row's counter; the last to
arrive packs the lists (ascending, CAP entries) and resolves the row exactly in registers. A
row with more than CAP candidates, or a list with more than LCAP, takes an exact whole-row
resolve (`select_topk._resolve_row`): slower, same result.

Deterministic and batch-invariant: the bound is a function of the row's scores only, every
count and position is order-independent, lists sit at fixed offsets, and no row reads
another's state. `SampledTopkLaunch` binds one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, Launcher
from .select_radix import ChunkLaunches, packed_write
from .select_topk import _emit, _keys, _kth_key, _resolve_row, _write_short, _write_tail


@triton.jit
def _row_bound(samp_ptr, lr, vis, stride_pr, KB: tl.constexpr, S: tl.constexpr, NSP: tl.constexpr,
               BITS: tl.constexpr, LBITS: tl.constexpr):
    """The lower bound of row lr's KB-th largest key from its cdiv(vis, S) samples."""
    p = tl.arange(0, NSP)
    samples = tl.load(samp_ptr + lr.to(tl.int64) * stride_pr + p, mask=p < tl.cdiv(vis, S), other=-1)
    return _kth_key(samples, KB, BITS, LBITS)


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_pr"])
def _bound_kernel(vis_ptr, samp_ptr, bound_ptr, row0, n_cols, stride_pr, KB: tl.constexpr, S: tl.constexpr,
                  NSP: tl.constexpr, BITS: tl.constexpr, LBITS: tl.constexpr):
    """bound int32 [chunk rows]: each row's lower bound (`_row_bound`), rows with visible > KB."""
    lr = tl.program_id(0)
    vis = tl.minimum(tl.load(vis_ptr + row0 + lr), n_cols)
    if vis > KB:
        tl.store(bound_ptr + lr, _row_bound(samp_ptr, lr, vis, stride_pr, KB, S, NSP, BITS, LBITS))


@triton.jit
def _resolve_lists(c_idx, c_key, total, out_row, stride_oc, KB: tl.constexpr, BITS: tl.constexpr,
                   CAP: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr):
    """The exact top-k of a row's packed candidates (total <= CAP, ascending columns)."""
    j = tl.arange(0, CAP)
    key = tl.load(c_key + j, mask=j < total, other=-1, cache_modifier=".cg")
    idx = tl.load(c_idx + j, mask=j < total, other=0, cache_modifier=".cg")
    _emit(key, idx, _kth_key(key, KB, BITS, 31), out_row, stride_oc, KB, PACKED, R)


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr", "stride_pr", "stride_cr"])
def _topk_sampled_kernel(
    s_ptr, vis_ptr, samp_ptr, cidx_ptr, ckey_ptr, cnt_ptr, arrive_ptr, out_ptr, pos_ptr,
    row0, n_cols, stride_sr, stride_pr, stride_cr, stride_or, stride_oc,
    KB: tl.constexpr, KBP: tl.constexpr, S: tl.constexpr, NSP: tl.constexpr, BITS: tl.constexpr,
    LBITS: tl.constexpr, SEG: tl.constexpr, SEGP: tl.constexpr, LCAP: tl.constexpr, CAP: tl.constexpr,
    BLOCK: tl.constexpr, RBLOCK: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
    BLOCK_W: tl.constexpr, BOUND: tl.constexpr,
):
    """One segment [pid1 * SEG, +SEG) of row pid0. samp int32 [chunk rows, >= NSP] (the first
    cdiv(visible, S) read); candidate lists cidx / ckey int32 [chunk rows, SEGP * LCAP + CAP]
    (list s at s * LCAP, the packed lists at SEGP * LCAP), their lengths cnt int32 [chunk rows,
    SEGP]; arrive int32 [chunk rows], zero between calls (the last arriver resets it). BOUND:
    the rows' bounds are read from samp instead (int32 [chunk rows] at stride_pr, `_bound_kernel`);
    else each program derives its row's. Rows of at most CAP / 2 candidates resolve at that width."""
    lr = tl.program_id(0)
    seg = tl.program_id(1)
    row = row0 + lr
    vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    s_row = s_ptr + lr.to(tl.int64) * stride_sr
    n_seg = tl.cdiv(vis, SEG)
    if vis <= KB:
        if seg == 0:
            _write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
            _write_short(out_row, stride_oc, vis, KB, KBP, PACKED, R)
    elif seg < n_seg:
        if BOUND:
            bound = tl.load(samp_ptr + lr.to(tl.int64) * stride_pr)
        else:
            bound = _row_bound(samp_ptr, lr, vis, stride_pr, KB, S, NSP, BITS, LBITS)  # <= the KB-th largest key
        c_idx = cidx_ptr + lr.to(tl.int64) * stride_cr
        c_key = ckey_ptr + lr.to(tl.int64) * stride_cr
        lo = seg * SEG
        hi = tl.minimum(vis, lo + SEG)
        ar = tl.arange(0, BLOCK)
        n = lo * 0
        start = lo
        while start < hi:  # (while: the interpreter cannot range over loaded values)
            cols = start + ar
            key = _keys(s_row, cols, cols < hi)
            keep = (key >= bound).to(tl.int32)
            pos = n + tl.cumsum(keep, 0) - keep
            ok = (keep > 0) & (pos < LCAP)
            tl.store(c_idx + seg * LCAP + pos, cols, mask=ok)
            tl.store(c_key + seg * LCAP + pos, key, mask=ok)
            n += tl.sum(keep, 0)
            start += BLOCK
        tl.store(cnt_ptr + lr.to(tl.int64) * SEGP + seg, n)
        tl.debug_barrier()  # this program's lists and count before its arrival
        if tl.atomic_add(arrive_ptr + lr, 1, sem="acq_rel", scope="gpu") == n_seg - 1:
            tl.store(arrive_ptr + lr, 0)  # clean for the next call
            _write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
            segs = tl.arange(0, SEGP)
            cnt = tl.load(cnt_ptr + lr.to(tl.int64) * SEGP + segs, mask=segs < n_seg, other=0, cache_modifier=".cg")
            total = tl.sum(cnt, 0)
            if (total <= CAP) & (tl.max(cnt, 0) <= LCAP):
                jj = tl.arange(0, LCAP)[None, :]
                m = jj < cnt[:, None]
                src = segs[:, None] * LCAP + jj
                dst = SEGP * LCAP + (tl.cumsum(cnt, 0) - cnt)[:, None] + jj  # ascending columns throughout
                tl.store(c_idx + dst, tl.load(c_idx + src, mask=m, cache_modifier=".cg"), mask=m)
                tl.store(c_key + dst, tl.load(c_key + src, mask=m, cache_modifier=".cg"), mask=m)
                tl.debug_barrier()
                if total <= CAP // 2:
                    _resolve_lists(c_idx + SEGP * LCAP, c_key + SEGP * LCAP, total, out_row, stride_oc, KB, BITS,
                                   CAP // 2, PACKED, R)
                else:
                    _resolve_lists(c_idx + SEGP * LCAP, c_key + SEGP * LCAP, total, out_row, stride_oc, KB, BITS,
                                   CAP, PACKED, R)
            else:
                _resolve_row(s_row, vis, out_row, stride_oc, KB, BITS, RBLOCK, PACKED, R)


_sampled = Launcher(_topk_sampled_kernel)
_bound = Launcher(_bound_kernel)


def sampled_tiles(num_cols: int, block_topk: int, block_g: int, small: bool) -> dict[str, int]:
    """Launch shapes for rows of num_cols columns whose score tiles hold block_g columns.
    sub: samples per score tile (runs of S = block_g / sub columns, about 4 Kb samples per row
    keeps the bound tight); nsp: samples read per row (a power of two); seg: columns per
    program; lcap: candidates per segment list; cap: candidates of a row resolved in
    registers; block / rblock: columns per sweep step (compaction / the whole-row resolve);
    bits: key bits per search step; lbits: high key bits of the bound; warps per program;
    bound: > 0, the bounds come from a launch of their own (one program a row, `bound` warps).
    small: the interpreter's tiles (tests cross every border with few columns)."""
    S = block_g
    while S > 1 and triton.cdiv(num_cols, S) < 4 * block_topk:
        S //= 2
    t = dict(sub=block_g // S, S=S, nsp=triton.next_power_of_2(triton.cdiv(max(num_cols, 1), S)))
    if small:
        return dict(t, seg=32, lcap=16, cap=32, block=16, rblock=16, bits=4, lbits=31, warps=4, bound=0)
    seg = max(2048, triton.next_power_of_2(triton.cdiv(num_cols, 64)))
    segp = triton.next_power_of_2(triton.cdiv(max(num_cols, 1), seg))
    # W2 (H200): the bound launch pays from 64 segments a row (1M B4 113.6 -> 107.0 us, 1M B4 x 4
    # rows 205.3 -> 162.1), not at 16 (128K B4 36.7 -> 37.6, 128K B16 67.8 -> 70.3).
    return dict(t, seg=seg, lcap=min(seg, max(64, 4096 // segp)), cap=2048, block=min(seg, 4096), rblock=1024,
                bits=2, lbits=16, warps=16, bound=8 if segp >= 64 else 0)


@dataclass(frozen=True)
class SampledScratch:
    """Scratch of the sampled route for a chunk of rows (flat): samples, candidate indices
    and keys, list lengths, arrival counters (zero between calls), the rows' bounds."""

    samples: torch.Tensor
    cand_idx: torch.Tensor
    cand_key: torch.Tensor
    counts: torch.Tensor
    arrive: torch.Tensor
    bounds: torch.Tensor


def sampled_scratch_elems(rows: int, num_cols: int, tiles: dict) -> dict[str, int]:
    """int32 elements of each `SampledScratch` field for `rows` rows of num_cols columns."""
    segp = triton.next_power_of_2(triton.cdiv(max(num_cols, 1), tiles["seg"]))
    lists = rows * (segp * tiles["lcap"] + tiles["cap"])
    return dict(samples=rows * tiles["nsp"], cand_idx=lists, cand_key=lists, counts=rows * segp, arrive=rows,
                bounds=rows)


def sampled_scratch(need: dict[str, int], device: torch.device | str) -> SampledScratch:
    """Allocate `need` elements per field (arrival counters zeroed)."""
    return SampledScratch(**{k: (torch.zeros if k == "arrive" else torch.empty)(v, dtype=torch.int32, device=device)
                             for k, v in need.items()})


def samples_view(scratch: SampledScratch, rows: int, tiles: dict) -> torch.Tensor:
    """The samples int32 [rows, nsp] the score launch writes."""
    return scratch.samples[: rows * tiles["nsp"]].view(rows, tiles["nsp"])


class SampledTopkLaunch(ChunkLaunches):
    """The top-k launch of one chunk of `rows` rows (from a free first row `row0`) bound to
    the score scratch fp32 [>= rows, num_cols], visible_blocks int32 [T] and `scratch` (with
    the samples of that chunk's score launch, `samples_view`); `__call__(row0, out,
    out_row_stride)` launches it into out: int32 [T, Kb] (any strides; `out` at binding fixes
    its column stride) or, with `positions` int64 [T] given, the packed selection int32
    [T, W + 1] (contiguous rows; W = width - 1, r = compress_ratio)."""

    def __init__(self, scores: torch.Tensor, visible_blocks: torch.Tensor, out: torch.Tensor,
                 scratch: SampledScratch, *, row0: int, rows: int, num_cols: int, block_topk: int, tiles: dict,
                 positions: torch.Tensor | None = None, compress_ratio: int = 1) -> None:
        Kb, t = block_topk, tiles
        write, pos = packed_write(out, positions, visible_blocks, compress_ratio)
        segs = triton.cdiv(max(num_cols, 1), t["seg"])
        segp = triton.next_power_of_2(segs)
        n = sampled_scratch_elems(rows, num_cols, t)
        samp = samples_view(scratch, rows, t)
        cidx, ckey = (x[: n["cand_idx"]].view(rows, -1) for x in (scratch.cand_idx, scratch.cand_key))
        search = dict(KB=Kb, S=t["S"], NSP=t["nsp"], BITS=t["bits"], LBITS=t["lbits"])
        self._launches: list[tuple[BoundLaunch, bool]] = []
        bounds = scratch.bounds[:rows].view(rows, 1)
        if t["bound"]:
            self._launches.append((_bound.bind(
                (rows,), visible_blocks, samp, bounds, row0, num_cols, samp.stride(0), free=("row0",), **search,
                num_warps=t["bound"]), False))
        given = bounds if t["bound"] else samp  # (BOUND: the kernel reads a row's bound where its samples were)
        self._launches.append((_sampled.bind(
            (rows, segs), scores, visible_blocks, given, cidx, ckey, scratch.counts, scratch.arrive, out, pos,
            row0, num_cols, scores.stride(0), given.stride(0), cidx.stride(0), out.stride(0), out.stride(1),
            free=("row0", "out_ptr", "stride_or"), KBP=triton.next_power_of_2(Kb), SEG=t["seg"], SEGP=segp,
            LCAP=t["lcap"], CAP=t["cap"], BLOCK=t["block"], RBLOCK=t["rblock"], BOUND=bool(t["bound"]), **search,
            **write, num_warps=t["warps"],
        ), True))
