"""Triton exact top-k of prefill rows from the score kernel's subset maxima (design.md §2.7).

Contract: `qsa_core.reference.select.topk_groups` (as `select_radix` / `select_topk`): input a
chunk's fp32 score scratch [chunk rows, num_cols] (scores >= 0, -0.0 folded into +0.0, so the
int32 bits order like the values; columns >= visible are garbage) and its samples int32
[chunk rows, cdiv(num_cols, S)], which the prefill score launch writes next to the scores
(`select_score`, `sample_sub`): sample i of a row is the largest key of its columns
[i*S, i*S + S) below visible. Output per row the Kb largest groups, ties to the lowest group
index, ascending; rows with visible <= Kb take groups 0..visible-1 unscored, -1 padded; or
(PACKED) the packed selection rows (`select_common.packed_groups` / `packed_tail`).

The maxima of disjoint column subsets are real keys, so the Kb-th largest sample is a lower
bound L of the row's Kb-th largest key (to LBITS high bits: a lower bound still). Per chunk
one launch, grid rows x segments of SEG columns: each program finds L from its row's samples,
compacts its segment's keys >= L (ascending column) into its candidate list, and the program
that completes the row (its only one, or the last to arrive at the row's counter, acq_rel)
gathers the lists in column order and resolves them exactly in registers
(`select_topk._kth_key`, `emit`). More than CAP candidates (keys crowded near the threshold,
or rows too short to have Kb samples) send the row to the exact whole-row resolve
(`select_common.resolve_row`: slower, same result), which first compacts the row's candidates
into its list scratch in one sweep of its scores where they fit and are at most half the row,
and sweeps those; a second tier (`SampleTiles.cap2`) first
takes rows of up to cap2 candidates from their lists in a wider tile. With `defer`, the lists of
several chunks' rows stay (under CAND_BYTES) and one `_resolve_prefill_kernel` launch (a tier)
after the group's last chunk resolves them, many rows at once (a chunk has few rows at long
contexts); only overflowing rows resolve in the chunk's launch, while their scores are there. The scores make
one trip through memory after the score launch; no histogram.

Deterministic and batch-invariant: samples, counts and positions depend on the row's scores
only, lists sit at fixed offsets, no row reads another's state. `PrefillTopkLaunch` binds a
chunk's launches; `prefill_tiles` / `prefill_route` say when and with which shapes `plan_select` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions
from .warm import KVWarm, warm_kv_groups
from .select_radix import ChunkLaunches, packed_write
from .select_common import (compact_segment, compact_step, emit, emit_above, kth_bound, kth_key, resolve_row,
                            samples_bound, score_keys, write_short, write_tail)
from .select_score import sample_shift, store_row_samples


@triton.jit
def _resolve_lists(c_idx, c_key, cnt_row, n_seg, out_row, stride_oc, KB: tl.constexpr, BITS: tl.constexpr,
                   SEGP: tl.constexpr, CAP: tl.constexpr, LIST: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr,
                   RSBITS: tl.constexpr = 0):
    """Exact top-k of a row's candidate lists (list s at s * LIST of c_idx / c_key, its length
    at cnt_row[s], n_seg lists, KB to CAP candidates in all): gathered in segment order
    (ascending columns), the KB-th key found in registers (RSBITS 0: `kth_key`, 31 / BITS
    steps; else the bracket search `kth_bound`, 2^RSBITS counts a step until isolated), the
    chosen written ascending."""
    segs = tl.arange(0, SEGP)
    cnt = tl.load(cnt_row + segs, mask=segs < n_seg, other=0, cache_modifier=".cg")
    total = tl.sum(cnt, 0)
    # Candidate j of the row: entry j - first[sj] of list sj, the last list starting at or
    # before j (it is not empty where j < total), found by binary lifting over the starts
    # (non-decreasing; a gather a step, not a [CAP, SEGP] comparison: registers).
    j = tl.arange(0, CAP)
    first = tl.cumsum(cnt, 0) - cnt
    sj = j * 0
    for b in tl.static_range(SEGP.bit_length() - 1):
        step = SEGP >> (b + 1)
        sj = tl.where(tl.gather(first, sj + step, 0) <= j, sj + step, sj)
    src = sj * LIST + j - tl.gather(first, sj, 0)
    m = j < total
    key = tl.load(c_key + src, mask=m, other=-1, cache_modifier=".cg")
    idx = tl.load(c_idx + src, mask=m, other=0, cache_modifier=".cg")
    if RSBITS:
        thr, n_above = kth_bound(key, total, KB, RSBITS)
        emit_above(key, idx, thr, n_above, out_row, stride_oc, KB, PACKED, R)
    else:
        emit(key, idx, kth_key(key, KB, BITS, 31), out_row, stride_oc, KB, PACKED, R)


@triton.jit
def _row_counts(cnt_row, n_seg, SEGP: tl.constexpr):
    """(candidates of a row in all, the most of one list) from its n_seg list lengths."""
    segs = tl.arange(0, SEGP)
    cnt = tl.load(cnt_row + segs, mask=segs < n_seg, other=0, cache_modifier=".cg")
    return tl.sum(cnt, 0), tl.max(cnt, 0)


@triton.jit
def _cdiv_pow2(x, LOG):
    """cdiv(x, 2^LOG) of x >= 0 by shifts (LOG a constexpr or a runtime int32: no division)."""
    return (x + (1 << LOG) - 1) >> LOG


@triton.jit
def _compact_runs(s_row, samp_row, runs_row, l_idx, l_key, bound, run0, hi, run_end, LOG_S, RUNS: tl.constexpr,
                  CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Copy the keys >= bound of a segment's columns below hi (its runs of 2^LOG_S columns:
    [run0, run0 + RUNS) below run_end; LOG_S a constexpr, or a row's own) and their columns,
    ascending, to l_key / l_idx (the first CAP of them); returns how many. A run whose sample
    (its largest key) is below bound holds none: only the others are read, their ids first
    listed ascending at runs_row (int32 [RUNS], scratch) and then swept BLOCK columns per step
    (flat position f: run f >> LOG_S, column f & (2^LOG_S - 1); shifts, as a runtime divisor
    compiles to a division sequence per element)."""
    r = tl.arange(0, RUNS)
    run = run0 + r
    live = (tl.load(samp_row + run, mask=run < run_end, other=-1) >= bound).to(tl.int32)
    tl.store(runs_row + tl.cumsum(live, 0) - live, run, mask=live > 0)
    n_flat = tl.sum(live, 0) << LOG_S
    tl.debug_barrier()  # the run list before its reads
    f = tl.arange(0, BLOCK)
    n = n_flat * 0
    start = n_flat * 0
    while start < n_flat:  # (while: the interpreter cannot range over loaded values)
        fi = start + f
        m = fi < n_flat
        run_f = tl.load(runs_row + (fi >> LOG_S), mask=m, other=0, cache_modifier=".cg")
        cols = (run_f << LOG_S) + (fi & ((1 << LOG_S) - 1))
        n = compact_step(cols, score_keys(s_row, cols, m & (cols < hi)), bound, n, l_idx, l_key, CAP)
        start += BLOCK
    return n


@triton.jit
def _row_bound(samp_row, vis, KB: tl.constexpr, BITS: tl.constexpr, LBITS: tl.constexpr, LOG_S,
               SAMPP: tl.constexpr, SBITS: tl.constexpr, BSLACK: tl.constexpr = 0):
    """A lower bound of a row's KB-th largest key from its samples int32 (one per 2^LOG_S
    columns, LOG_S a constexpr or the row's own; cdiv(vis, 2^LOG_S) of them, SAMPP >= that, a
    power of two).
    SBITS 0: the KB-th largest sample to its LBITS high bits (`kth_key`, ceil(LBITS / BITS)
    block reductions); else the bracket search (`select_common.samples_bound`, 2^SBITS counts
    a step, until isolated or, BSLACK > 0, until at most KB + BSLACK samples reach it). Either
    way >= KB samples reach it: <= the row's KB-th key."""
    p = tl.arange(0, SAMPP)
    samples = tl.load(samp_row + p, mask=p < _cdiv_pow2(vis, LOG_S), other=-1)
    if SBITS:
        return samples_bound(samples, KB, SBITS, BSLACK)
    return kth_key(samples, KB, BITS, LBITS)


@triton.jit
def _chunk_row_bound(samp_row, vis, KB: tl.constexpr, BITS: tl.constexpr, LBITS: tl.constexpr, S: tl.constexpr,
                     SAMPP: tl.constexpr, SBITS: tl.constexpr, ROW_SAMPLES: tl.constexpr, LOG_G: tl.constexpr,
                     BSLACK: tl.constexpr = 0):
    """`_row_bound` of a row with samples per S columns (a power of two), or (ROW_SAMPLES = WBITS
    > 0) per 2^`sample_shift(vis, WBITS, LOG_G)` columns."""
    if ROW_SAMPLES:
        bound = _row_bound(samp_row, vis, KB, BITS, LBITS, sample_shift(vis, ROW_SAMPLES, LOG_G), SAMPP, SBITS,
                           BSLACK)
    else:
        bound = _row_bound(samp_row, vis, KB, BITS, LBITS, S.bit_length() - 1, SAMPP, SBITS, BSLACK)
    return bound


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_pr"])
def _bound_prefill_kernel(
    vis_ptr, samp_ptr, bound_ptr, row0, n_cols, stride_pr,
    KB: tl.constexpr, BITS: tl.constexpr, LBITS: tl.constexpr, S: tl.constexpr, SAMPP: tl.constexpr,
    SBITS: tl.constexpr, ROW_SAMPLES: tl.constexpr = 0, LOG_G: tl.constexpr = 0, BSLACK: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
):
    """The bound of each row of a chunk, once (grid: chunk rows; tile bound 1 / 3): samp int32
    [chunk rows, >= its samples] -> bound int32 [chunk rows] (`_chunk_row_bound`; rows with
    visible <= KB: not written), which the chunk's `_topk_prefill_kernel` programs then read."""
    tl.static_assert((S & (S - 1)) == 0, "S: a power of two")
    pdl_start(PDL)
    lr = tl.program_id(0)
    vis = tl.minimum(tl.load(vis_ptr + row0 + lr), n_cols)
    if vis > KB:
        tl.store(bound_ptr + lr, _chunk_row_bound(samp_ptr + lr.to(tl.int64) * stride_pr, vis, KB, BITS, LBITS, S,
                                                  SAMPP, SBITS, ROW_SAMPLES, LOG_G, BSLACK))
    pdl_end(PDL)


@triton.jit(do_not_specialize=["row0", "crow0", "n_cols", "stride_sr", "stride_pr", "stride_cr"])
def _topk_prefill_kernel(
    s_ptr, vis_ptr, samp_ptr, cidx_ptr, ckey_ptr, cnt_ptr, arrive_ptr, out_ptr, pos_ptr, runs_ptr, bound_ptr,
    row0, crow0, n_cols, stride_sr, stride_pr, stride_cr, stride_or, stride_oc,
    req_ptr, bt_ptr, stride_btr, stride_btp, kc_ptr, vc_ptr, stride_kp, stride_ks, stride_vp, stride_vs,
    KB: tl.constexpr, KBP: tl.constexpr, BITS: tl.constexpr, LBITS: tl.constexpr, S: tl.constexpr,
    SAMPP: tl.constexpr, SEG: tl.constexpr, SEGP: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr, DEFER: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
    BLOCK_W: tl.constexpr, RUNS: tl.constexpr = 0, ROW_SAMPLES: tl.constexpr = 0, LOG_G: tl.constexpr = 0,
    BOUND_IN: tl.constexpr = 0, SBITS: tl.constexpr = 0, RSBITS: tl.constexpr = 0, WARM_K: tl.constexpr = 0,
    WARM_V: tl.constexpr = 0, PAGE: tl.constexpr = 1, BSLACK: tl.constexpr = 0, CAP2: tl.constexpr = 0,
    LIST: tl.constexpr = 0, PDL: tl.constexpr = 0,
):
    """One segment of a row (grid: chunk rows x segments). samp int32 [chunk rows, >= cdiv(n_cols,
    S)] (SAMPP >= its width, a power of two); candidate lists cidx / ckey int32 [rows, SEGP *
    LS] (LS = LIST, 0: CAP; the chunk's at crow0; list s at s * LS, at most LS entries stored), their lengths
    cnt int32 [rows, SEGP]; arrive int32 [chunk rows] zero between calls (the last arriver
    resets it). The last arriver resolves the row from its lists in a CAP-wide tile or, more
    than CAP candidates, by sweeps (`resolve_row`) over its candidates compacted anew into its
    list scratch where they fit (SEGP * LS) and are at most half its columns, else over its
    scores; CAP2 > CAP (no DEFER): rows of
    at most CAP2 candidates, no list past LS, from their lists in a CAP2-wide tile instead. DEFER: only
    the rows past CAP, `_resolve_prefill_kernel` does the rest after the chunk's scores are gone.
    ROW_SAMPLES = WBITS > 0 (decode; no DEFER): a row's samples are one per 2^`sample_shift(vis,
    WBITS, LOG_G)` columns (the decode score launch's or, MTP rows, `_row_samples_kernel`'s), not
    per S; with RUNS, rows of at most RUNS runs per segment read only their live runs, others the
    segment. The row's bound: BOUND_IN, read from bound int32 [chunk rows] (`_bound_prefill_kernel`,
    before this launch), else each program's own `_chunk_row_bound` (SBITS: the bracket search;
    BSLACK: its early end). RSBITS: the last arriver's CAP-wide resolve by the bracket search
    (`_resolve_lists`; 0: `kth_key`, as the CAP2-wide one). WARM_K > 0 (`warm.KV`): a program
    that does not resolve its row then hints its candidates' K and V rows into L2 (req, bt:
    token_to_req and the block table; kc / vc: the K / V caches, PAGE tokens a page; WARM_K /
    WARM_V: `warm.warm_kv_groups`' K_BYTES / V_BYTES)."""
    tl.static_assert((S & (S - 1)) == 0, "S: a power of two")
    tl.static_assert(not (DEFER and CAP2), "CAP2: the second tier of the chunk's own resolve (DEFER: LO)")
    LS: tl.constexpr = LIST if LIST else CAP
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
        samp_row = samp_ptr + lr.to(tl.int64) * stride_pr
        if BOUND_IN:
            bound = tl.load(bound_ptr + lr)
        else:
            bound = _chunk_row_bound(samp_row, vis, KB, BITS, LBITS, S, SAMPP, SBITS, ROW_SAMPLES, LOG_G, BSLACK)
        c_idx = cidx_ptr + (crow0 + lr).to(tl.int64) * stride_cr
        c_key = ckey_ptr + (crow0 + lr).to(tl.int64) * stride_cr
        cnt_row = cnt_ptr + (crow0 + lr).to(tl.int64) * SEGP
        lo = seg * SEG
        hi = tl.minimum(vis, lo + SEG)
        if RUNS:
            runs_row = runs_ptr + lr.to(tl.int64) * (SEGP * RUNS) + seg * RUNS
            if ROW_SAMPLES:  # per-row strides: rows of at most RUNS runs per segment read their live runs
                shift = sample_shift(vis, ROW_SAMPLES, LOG_G)
                n_runs = SEG >> shift
                if n_runs <= RUNS:
                    n = _compact_runs(s_row, samp_row, runs_row, c_idx + seg * LS, c_key + seg * LS, bound,
                                      seg * n_runs, hi, tl.minimum(_cdiv_pow2(vis, shift), (seg + 1) * n_runs),
                                      shift, RUNS, LS, BLOCK)
                else:
                    n = compact_segment(s_row, lo, hi, bound, c_idx + seg * LS, c_key + seg * LS, LS, BLOCK)
            else:
                n = _compact_runs(s_row, samp_row, runs_row, c_idx + seg * LS, c_key + seg * LS, bound, seg * RUNS,
                                  hi, tl.cdiv(vis, S), S.bit_length() - 1, RUNS, LS, BLOCK)
        else:
            n = compact_segment(s_row, lo, hi, bound, c_idx + seg * LS, c_key + seg * LS, LS, BLOCK)
        tl.store(cnt_row + seg, n)
        tl.debug_barrier()  # this program's list and count before its arrival / its resolve
        last = n_seg == 1
        if SEGP > 1:
            last = tl.atomic_add(arrive_ptr + lr, 1, sem="acq_rel", scope="gpu") == n_seg - 1
        if last:
            if SEGP > 1:
                tl.store(arrive_ptr + lr, 0)  # clean for the next call
            total, most = _row_counts(cnt_row, n_seg, SEGP)
            if total <= CAP:
                if not DEFER:
                    write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
                    _resolve_lists(c_idx, c_key, cnt_row, n_seg, out_row, stride_oc, KB, BITS, SEGP, CAP, LS, PACKED, R,
                                   RSBITS)
            else:
                write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
                # CAP2 0 (a constexpr) compiles no second tier; most <= LS: every list whole (a
                # segment of more than LS columns may have dropped some)
                if CAP2 and total <= CAP2 and most <= LS:
                    # `kth_key`: RSBITS' 2^RSBITS counts a step over CAP2 keys would double the registers
                    _resolve_lists(c_idx, c_key, cnt_row, n_seg, out_row, stride_oc, KB, BITS, SEGP, CAP2, LS, PACKED,
                                   R)
                else:
                    # Every key >= bound, compacted from the scores into the row's list scratch
                    # in one sweep, and resolved there where they fit and are at most half the
                    # row (the sweeps then read `total` keys, not `vis` scores), else the scores.
                    listed = (total <= SEGP * LS) & (2 * total <= vis)
                    if listed:
                        compact_segment(s_row, 0, vis, bound, c_idx, c_key, SEGP * LS, BLOCK)
                    resolve_row(s_row, tl.where(listed, total, vis), out_row, stride_oc, KB, BITS, RBLOCK, PACKED, R,
                                c_idx, c_key, listed)
        elif WARM_K:
            j = tl.arange(0, CAP)  # the list's first CAP
            m = j < n
            groups = tl.load(c_idx + seg * LS + j, mask=m, other=0)
            warm_kv_groups(groups, m, tl.load(req_ptr + row), bt_ptr, stride_btr, stride_btp, kc_ptr, vc_ptr,
                           stride_kp, stride_ks, stride_vp, stride_vs, PAGE, R, WARM_K, WARM_V)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "stride_cr"])
def _resolve_prefill_kernel(
    vis_ptr, cidx_ptr, ckey_ptr, cnt_ptr, out_ptr, pos_ptr, row0, n_rows, n_cols, stride_cr, stride_or, stride_oc,
    KB: tl.constexpr, BITS: tl.constexpr, SEG: tl.constexpr, SEGP: tl.constexpr, CAP: tl.constexpr,
    PACKED: tl.constexpr, R: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, LIST: tl.constexpr,
    LO: tl.constexpr, PDL: tl.constexpr = 0,
):
    """The deferred resolve of rows [row0, row0 + n_rows) (grid: >= n_rows programs) from the
    candidate lists `_topk_prefill_kernel` (DEFER) left at their local row (LIST entries a
    list): rows with visible > KB and LO < candidates <= CAP, resolved in a CAP-wide tile (the
    others are written, or another tier's)."""
    pdl_start(PDL)
    lr = tl.program_id(0)
    if lr < n_rows:
        row = row0 + lr
        vis = tl.minimum(tl.load(vis_ptr + row), n_cols)
        n_seg = tl.cdiv(vis, SEG)
        cnt_row = cnt_ptr + lr.to(tl.int64) * SEGP
        if vis > KB:
            total = _row_counts(cnt_row, n_seg, SEGP)[0]
            if (total > LO) & (total <= CAP):
                out_row = out_ptr + row.to(tl.int64) * stride_or
                write_tail(out_row, pos_ptr, row, vis, KB, PACKED, R, W, BLOCK_W)
                _resolve_lists(cidx_ptr + lr.to(tl.int64) * stride_cr, ckey_ptr + lr.to(tl.int64) * stride_cr,
                               cnt_row, n_seg, out_row, stride_oc, KB, BITS, SEGP, CAP, LIST, PACKED, R)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["row0", "n_cols", "stride_sr", "stride_pr"])
def _row_samples_kernel(
    s_ptr, vis_ptr, samp_ptr, row0, n_cols, stride_sr, stride_pr,
    KB: tl.constexpr, WBITS: tl.constexpr, BLOCK: tl.constexpr, LOG_G: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Per-row samples of scores already in the scratch (grid: chunk rows x blocks of BLOCK
    columns, a multiple of 2^LOG_G): s fp32 [chunk rows, n_cols] -> samp int32 [chunk rows,
    2^WBITS], what the decode score launch's ROW_SAMPLES writes (`store_row_samples`) for rows
    with visible > KB, from the columns below visible."""
    pdl_start(PDL)
    lr = tl.program_id(0)
    g0 = tl.program_id(1) * BLOCK
    vis = tl.load(vis_ptr + row0 + lr)
    vis = tl.where(vis > KB, tl.minimum(vis, n_cols), 0)
    if g0 < vis:
        g = g0 + tl.arange(0, BLOCK)
        m = g < vis
        s = tl.load(s_ptr + lr.to(tl.int64) * stride_sr + g, mask=m, other=0.0)
        one = tl.arange(0, 1)
        store_row_samples(samp_ptr, lr + one, g0, s[:, None], m[:, None], vis + one, stride_pr, WBITS, BLOCK, 1,
                           LOG_G)
    pdl_end(PDL)


_row_samples = Launcher(_row_samples_kernel)
_prefill_bound = Launcher(_bound_prefill_kernel)
_prefill_topk = Launcher(_topk_prefill_kernel)
_prefill_resolve = Launcher(_resolve_prefill_kernel)


# Longest sample run (columns): 32 made the top-k launches of 16K rows at 1M fastest on the H200
# of runs from 16 to 128, see NOTES.md (Kernels) (--only prefill-1048576-1-16384-bf16).
SAMPLE_COLS = 32
# Cap on the candidate lists kept for a deferred resolve (bytes): rows of several chunks.
CAND_BYTES = 64 << 20
# The second resolve tier's lists (`SampleTiles.cap2`) hold this many times cap, for prefill rows
# of at least twice as many columns (narrower rows resolve as fast from the whole row). Rows whose
# top keys cluster (recent keys scoring high, as served rows do) crowd the sample bound's
# candidates past cap; the whole-row resolve of a 128K row sweeps it 16 times. Figures: NOTES.md
# (Kernels); `benchmarks/select_overflow.py` counts the candidates.
PREFILL_TIER2 = 4


@dataclass(frozen=True)
class SampleTiles:
    """Launch shapes of the sample-bounded top-k (`prefill_tiles`, `decode_tiles`).

    sub: samples per score tile; seg: columns per segment program; cap: candidates of a row (and
    of one list) the resolve takes in registers; cap2 (0: none): a second tier, rows of more than
    cap and at most cap2 candidates resolve from their lists in a cap2-wide tile, others by the
    whole-row resolve; with defer the lists hold cap2 entries (`lists`) and a second resolve
    launch (r2warps warps) takes those rows, without it the last arriver does, from lists of cap
    entries none of which lost any (a segment of more than cap columns may); block / rblock:
    columns per sweep step (compaction / the whole-row resolve);
    bits: key bits per radix search step; lbits: high key bits of the bound; warps: per program;
    regs: registers per thread the compiler may use (0: its choice); defer: resolve the rows of
    several chunks in one later launch (`defer_rows`) with rwarps / rregs; bound: where a row's
    lower bound comes from (0: each segment program's radix search of the samples, 1: a bound
    launch per chunk, 2: as 0 by the bracket search of 2^sbits counts a step, 3: as 1 by the
    bracket search); skip: the candidate launch reads only the runs whose sample reaches the
    bound (`seg_runs`). Decode only (per-row sample strides, `decode_tiles`): row_s = WBITS
    (2^row_s sample slots a row), log_g (log2 of the score tile's columns), skip_shift,
    rsbits (the resolve's bracket search), sample_launch (MTP rows: samples from a launch of
    their own, sblock columns a program), bslack (the bound's bracket search ends once at most
    Kb + bslack samples reach its low end), list_cap (0: cap; the chunk's own resolve with a
    second tier: entries a list keeps, so a list of more than cap candidates still reaches it)."""

    sub: int
    seg: int
    cap: int
    block: int
    rblock: int
    bits: int
    lbits: int
    warps: int
    regs: int
    defer: int
    rwarps: int
    rregs: int
    bound: int
    sbits: int
    skip: int = 0
    row_s: int = 0
    log_g: int = 0
    skip_shift: int = 0
    rsbits: int = 0
    sample_launch: int = 0
    sblock: int = 0
    bslack: int = 0
    cap2: int = 0
    r2warps: int = 0
    list_cap: int = 0

    @property
    def lists(self) -> int:
        """Entries a candidate list holds: cap2 (else cap) for the deferred resolve, whose lists
        wait for a later launch; list_cap (else cap) for the chunk's own, whose second tier gathers
        them from several lists (a decode chunk has many rows: its scratch stays a few cap a list)."""
        return self.cap2 if self.defer and self.cap2 else self.list_cap or self.cap


def prefill_tiles(num_cols: int, block_topk: int, score_block_g: int, small: bool) -> SampleTiles:
    """Launch shapes for prefill rows of num_cols columns whose score tiles are score_block_g
    columns wide (fields: `SampleTiles`). sub: a power of two, the fewest giving >= 4 Kb samples
    over num_cols and runs of at most SAMPLE_COLS, at most score_block_g / 4 (S = score_block_g /
    sub columns per sample). small (`KernelOptions.small_tiles`): tiles that tests cross with few
    columns. Else the H200's: the top-k is bound by latency, so 8 warps at 64 registers (4
    programs an SM), 1024 candidates and the deferred resolve (faster than the radix passes from
    16K to 1M context); skip from 32768 columns (it pays only where segments hold many runs: at
    128K and 1M, not at 16K); bound 1 for rows of several segments (one search in the bound
    launch), 2 for rows of one segment (the bracket search in their program). Figures: NOTES.md
    (Kernels). Measure: `python benchmarks/bench_qsa.py --only prefill-16384-1-16384-bf16
    prefill-131072-1-16384-bf16 prefill-1048576-1-16384-bf16 --out DIR`."""
    sub = 1
    while 4 * sub < score_block_g and (num_cols * sub < 4 * block_topk * score_block_g
                                       or score_block_g > SAMPLE_COLS * sub):
        sub *= 2
    cap = 32 if small else 1024
    tier2 = dict(cap2=PREFILL_TIER2 * cap, r2warps=8) if num_cols >= 2 * PREFILL_TIER2 * cap else {}
    if small:
        return SampleTiles(sub=sub, seg=64, cap=cap, block=16, rblock=16, bits=4, lbits=31, warps=4, regs=0, defer=1,
                           rwarps=4, rregs=0, bound=0, sbits=2, **tier2)
    seg = 32768
    return SampleTiles(sub=sub, seg=seg, cap=cap, block=2048, rblock=1024, bits=2, lbits=16, warps=8, regs=64,
                       defer=1, rwarps=4, rregs=0, skip=int(num_cols >= 32768), bound=1 if num_cols > seg else 2,
                       sbits=2, **tier2)


# Decode chunks of at least this many rows search each row's bound once, in a bound launch (tile
# bound 3), and run their segment programs at 4 warps (`decode_tiles`).
DECODE_BOUND_ROWS = 16
# Segment programs a decode chunk's top-k launch aims at (`decode_seg`): about one per SM of the
# H100 / H200 (132). A fixed count, not the device's: the plan reads nothing from the device.
DECODE_TOPK_PROGRAMS = 128
# The most segments (candidate lists) of a decode row: what 8192-column segments make at 1M
# context, the most the resolve's gather was measured with.
DECODE_MAX_SEGS = 32
# The decode route's second resolve tier (`SampleTiles.cap2`): up to this many times cap
# candidates (16 a thread of the 8-warp segment program, 32 of the 4-warp one of many rows), for
# rows of at least twice as many columns (as PREFILL_TIER2).
# Decode rows whose top keys cluster (recent keys scoring high, as served rows do) crowd the
# bound's candidates past cap too, and the whole-row resolve sweeps a row 16 times. Its lists stay
# cap entries (a chunk has up to 256 rows): the last arriver gathers them into a cap2-wide tile in
# its registers, by `kth_key` (the bracket search's counts over 4096 keys took 254 registers at 8
# warps). Timed on the H100 against no tier (select+expand, us; NOTES.md (Kernels)): 128K B4 318 ->
# 60 on recency rows, 37.2 -> 37.7 on random ones (the program takes 176 registers under triton
# 3.6 against 125); 1M B4 unchanged (4598 -> 4565: those recency rows pass 4096) at +0.5 % on
# random rows. Chunks of many rows at 4 warps with a 2048-wide tier and lists of cap did not take
# the 128K B64 recency rows (924 -> 930; 1.5 % on random ones): up to 3099 candidates, a list of
# up to 1111. With lists of DECODE_MANY_LISTS cap and a 4096 tier they would (CPU counts; not yet
# timed: the 4-warp program then takes 248-255 registers, from 128).
DECODE_TIER2 = 4
# Chunks with the second tier sample their rows at most this many columns apart (`decode_tiles`),
# more than 4 Kb samples on rows past 128 Kb columns (1M context: 8192, from 2048 one per 128
# columns). 1M recency rows crowded the sparser bound past 4 cap2 (median 8885 candidates on
# bench_qsa's rows); samples 32 columns apart keep them within it. Timed on the H100 against 2048
# samples (1M B4, select+expand / whole step, us): recency 4601 / 4613 -> 158 / 176, random 122.8 /
# 143.6 -> 128.3 / 146.3; rows of up to 128 Kb columns (256K context) keep 4 Kb samples, the same
# tiles as before. Chunks of many rows take them too (1M MTP rows: up to 10980 candidates on
# recency rows with 2048 samples, 3090 with 8192; without a tier those samples cost 10 % on
# random rows).
DECODE_TIER2_SAMPLE_COLS = 32
# Candidate lists of decode chunks of many rows (>= DECODE_BOUND_ROWS) keep this many times cap
# entries: their segments are the base's (4096 / 8192 columns), and on clustered scores the
# newest segment alone holds more than cap candidates (`select_overflow.py --decode --data
# recency`: 128K up to 1111, 1M up to 1274 with samples DECODE_TIER2_SAMPLE_COLS apart).
DECODE_MANY_LISTS = 2


def decode_seg(num_cols: int, rows: int, base: int, min_seg: int, programs: int) -> int:
    """Columns per segment program of the decode top-k for a chunk of `rows` rows of num_cols
    columns: the largest of (a) num_cols * next_pow2(rows) / programs, so that a chunk of few long
    rows still runs about `programs` programs; (b) num_cols / DECODE_MAX_SEGS, at most that many
    lists for the resolve to gather; (c) min_seg (the score tile: a segment holds whole sample
    runs of every row's stride); each rounded up to a power of two, and at most `base` (the
    segment of chunks with enough rows, measured on the H200).

    Why: a segment program is bound by latency, not throughput (one program per SM, its
    dependent loads and block reductions), and at 128K B4 the base rule ran 4 x 8 programs on
    132 SMs while the score launch ran 512. A program's bound search and the last arriver's
    resolve do not depend on the segment; its run scan and compaction sweep do (a quarter of a
    segment's runs reach the bound on random rows, more where the top groups cluster), so smaller
    segments shorten every program and the last arriver's wait, and 4x more programs still fit one
    per SM. rows enters as a power of two (thresholds at powers of two: `qsa_core.warmup`); the
    choice changes no selected group (the resolve is exact whatever the segments: a row's result
    does not depend on its chunk)."""
    spread = triton.cdiv(num_cols * triton.next_power_of_2(max(rows, 1)), programs)
    seg = max(spread, triton.cdiv(num_cols, DECODE_MAX_SEGS), min_seg)
    return min(base, triton.next_power_of_2(seg))


def decode_tiles(num_cols: int, block_topk: int, score_block_g: int, small: bool, rows: int = 1,
                 rows_per_request: int = 1) -> SampleTiles:
    """Launch shapes of the decode route (`select.plan_select`, `KernelOptions.decode_samples`): the
    decode score launch writes each row's samples at a stride of its own (`ScoreLaunch`'s
    row_samples = row_s = WBITS, `sample_shift`): 2^WBITS slots per row, WBITS the least with
    >= 4 Kb slots and rows of num_cols columns at most score_block_g (= 2^log_g) columns per
    sample, in chunks with the second tier at most DECODE_TIER2_SAMPLE_COLS. So every scored row
    has at least Kb samples, a row of at most 2^WBITS columns one per column (its bound is its
    Kb-th key) and a longer one more than 2 Kb: a short row of a long plan keeps a tight bound.
    One launch per chunk (no deferred resolve). seg: `decode_seg` (chunks of few rows take
    smaller segments than the base, and so more programs); block: the
    compaction's sweep, at most a segment. skip: rows of at least 2^skip_shift columns per sample
    read only the runs whose sample reaches the bound (`seg_runs`), others their whole segment.
    bound 2: each program's bracket search of its row's samples; bound 3 (chunks of >=
    DECODE_BOUND_ROWS rows, and rows of more than 4 Kb samples, whose search in every program
    spills on sm_90): a bound launch's; rsbits: the resolve's bracket search
    (`_resolve_lists`); bslack Kb / 4: that bound search ends once at most 1.25 Kb samples reach
    its low end, a looser bound (still >= Kb samples reach it) in fewer steps, on every program's
    critical path, with candidates well inside the lists (simulated on random rows, NOTES.md
    (Kernels)). sample_launch (MTP rows, rows_per_request > 1): the samples come from a launch of
    their own over the score scratch (`_row_samples_kernel`, sblock columns a program), not from
    the score launch. cap2 (`DECODE_TIER2`: 4 cap; rows of at least 2 cap2 columns): the last
    arriver resolves a row of more than cap candidates, at most cap2, none dropped from a list,
    from its lists in a cap2-wide tile (`kth_key`; else from its scores); list_cap: lists of
    DECODE_MANY_LISTS cap in chunks of many rows (their segments are the base's). The
    other fields as `prefill_tiles`'. rows: the chunk's. small: the interpreter's tiles (a
    64-column base, 64 programs: the tests' chunks of 1-8 rows take 16- and 32-column segments;
    cap 32, cap2 128 from 256 columns).

    Choices, each faster than what it replaced (H200; decode_seg with bslack on the H100; figures
    in NOTES.md (Kernels)): the bracket searches, the tile skip and 8192-column segments against
    the radix search and whole segments; a base of 4096-column segments up to 32768 columns (at 1M
    they make 64 lists to gather); chunks of >= DECODE_BOUND_ROWS rows search each row's bound once
    in a bound launch and run 4 warps (it pays only where a chunk runs in one wave; chunks of 4
    rows lose); decode_seg with bslack against the 4096 / 8192 base with the exact search. Measure:
    `python benchmarks/bench_qsa.py --only decode-131072-4-1-bf16 decode-131072-64-1-bf16
    decode-1048576-4-1-bf16 decode-1048576-4-4-bf16 --out DIR` (`benchmarks/ab_decode.sh` against
    main)."""
    log_g = score_block_g.bit_length() - 1
    many = rows >= DECODE_BOUND_ROWS
    floor = (4 * block_topk - 1).bit_length()
    gap = log_g if small else min(log_g, DECODE_TIER2_SAMPLE_COLS.bit_length() - 1)
    wbits = max(floor, (max(num_cols, 1) - 1).bit_length() - gap)
    t = dict(sub=1, row_s=wbits, log_g=log_g, defer=0, skip_shift=min(3, log_g), regs=0, rwarps=4, rregs=0,
             sample_launch=int(rows_per_request > 1), bslack=block_topk // 4)
    cap, warps = (32, 4) if small else (1024, 4 if many else 8)
    cap2 = DECODE_TIER2 * cap if num_cols >= 2 * DECODE_TIER2 * cap else 0
    t.update(cap=cap, warps=warps, cap2=cap2, list_cap=DECODE_MANY_LISTS * cap if many and cap2 else 0)
    if small:
        seg = decode_seg(num_cols, rows, 64, score_block_g, 64)
        return SampleTiles(**t, seg=seg, block=min(16, seg), rblock=16, bits=4, lbits=31, skip=0, sbits=2, rsbits=2,
                           bound=2, sblock=2 * score_block_g)
    seg = decode_seg(num_cols, rows, 4096 if num_cols <= 32768 else 8192, score_block_g, DECODE_TOPK_PROGRAMS)
    return SampleTiles(**t, seg=seg, block=min(2048, seg), rblock=1024, bits=2, lbits=16, skip=1, sbits=3, rsbits=3,
                       bound=3 if many or wbits > floor else 2, sblock=max(2048, score_block_g))


def prefill_route(num_cols: int, block_topk: int, tiles: SampleTiles, score_block_g: int) -> bool:
    """Whether prefill rows of num_cols columns take this route: their samples number at
    least 2 Kb (fewer make a loose bound: crowded candidates, the slow whole-row resolve)."""
    return num_cols * tiles.sub >= 2 * block_topk * score_block_g


def sample_cols(tiles: SampleTiles, score_block_g: int) -> int:
    """Columns per sample (S)."""
    return score_block_g // tiles.sub


def samples_per_row(num_cols: int, tiles: SampleTiles, score_block_g: int) -> int:
    """Sample slots of a row: 2^row_s (decode, per-row strides), else one per S columns."""
    if tiles.row_s:
        return 1 << tiles.row_s
    return triton.cdiv(num_cols, sample_cols(tiles, score_block_g))


def seg_runs(num_cols: int, tiles: SampleTiles, score_block_g: int) -> int:
    """Runs of S columns (samples) per segment program where the candidate launch reads only
    the runs whose sample reaches the bound (tile skip), else 0; per-row strides: the most
    (rows of 2^skip_shift columns per sample; rows of narrower runs read their whole segment)."""
    if not tiles.skip:
        return 0
    if tiles.row_s:
        return max(min(tiles.seg, triton.next_power_of_2(num_cols)) >> tiles.skip_shift, 1)
    return max(min(tiles.seg, triton.next_power_of_2(num_cols)) // sample_cols(tiles, score_block_g), 1)


def defer_rows(chunk: int, num_rows: int, num_cols: int, tiles: SampleTiles) -> int:
    """Rows whose candidate lists one resolve launch takes: a multiple of chunk, the lists
    under CAND_BYTES (or chunk, without defer)."""
    if not tiles.defer:
        return chunk
    segp = triton.next_power_of_2(triton.cdiv(num_cols, tiles.seg))
    per_chunk = chunk * segp * tiles.lists * 8
    return chunk * max(1, min(triton.cdiv(num_rows, chunk), CAND_BYTES // per_chunk))


@dataclass(frozen=True)
class PrefillScratch:
    """Scratch of this route (flat; views per schedule): samples, arrival counters (zero
    between calls), the lists of runs to read (tile skip) and the rows' bounds (tile bound 1 /
    3) of a chunk, candidate indices, keys and list lengths of `defer_rows` rows."""

    samples: torch.Tensor
    cand_idx: torch.Tensor
    cand_key: torch.Tensor
    counts: torch.Tensor
    arrive: torch.Tensor
    runs: torch.Tensor
    bound: torch.Tensor


def prefill_scratch_elems(chunk: int, num_rows: int, num_cols: int, tiles: SampleTiles,
                          score_block_g: int) -> dict[str, int]:
    """int32 elements of each `PrefillScratch` field for a call of num_rows rows of num_cols
    columns in chunks of `chunk` rows."""
    segp = triton.next_power_of_2(triton.cdiv(num_cols, tiles.seg))
    group = defer_rows(chunk, num_rows, num_cols, tiles)
    return dict(samples=chunk * samples_per_row(num_cols, tiles, score_block_g),
                cand_idx=group * segp * tiles.lists, cand_key=group * segp * tiles.lists, counts=group * segp,
                arrive=chunk, runs=max(chunk * segp * seg_runs(num_cols, tiles, score_block_g), 1),
                bound=chunk if tiles.bound & 1 else 1)


def prefill_scratch(elems: dict[str, int], device: torch.device | str) -> PrefillScratch:
    """Allocate `elems` (`prefill_scratch_elems`) int32 elements per field, arrivals zeroed."""
    return PrefillScratch(**{k: (torch.zeros if k == "arrive" else torch.empty)(v, dtype=torch.int32, device=device)
                             for k, v in elems.items()})


def samples_view(scratch: PrefillScratch, rows: int, num_cols: int, tiles: SampleTiles, score_block_g: int) -> torch.Tensor:
    """The samples int32 [rows, `samples_per_row`] of a chunk (what the score launch writes)."""
    n = samples_per_row(num_cols, tiles, score_block_g)
    return scratch.samples[: rows * n].view(rows, n)


class PrefillTopkLaunch(ChunkLaunches):
    """The top-k launches of a chunk of `rows` rows (from a free first row `row0`) of a call
    over rows [first_row, first_row + num_rows) in chunks of `chunk` rows, bound to the
    score scratch fp32 [>= rows, num_cols], its samples (`samples_view`), visible_blocks int32
    [T] and `scratch`; `__call__(row0, out, out_row_stride)` launches the chunk's (and, defer:
    after the last chunk of a `defer_rows` group, the group's resolve) into out: int32 [T, Kb]
    (any strides; `out` at binding fixes its column stride) or, with `positions` int64 [T]
    given, the packed selection int32 [T, W + 1] (contiguous rows; r = compress_ratio). Tile
    bound 1 / 3: the chunk's bound launch first. kv (decode rows, packed output): the top-k
    also warms the attention's K/V (`warm.KVWarm`); then block_table (the first call's) and
    every call's block table are required."""

    def __init__(self, scores: torch.Tensor, samples: torch.Tensor, visible_blocks: torch.Tensor,
                 out: torch.Tensor, scratch: PrefillScratch, *, row0: int, rows: int, num_cols: int,
                 block_topk: int, tiles: SampleTiles, score_block_g: int, first_row: int, num_rows: int, chunk: int,
                 positions: torch.Tensor | None = None, compress_ratio: int = 1, kv: KVWarm | None = None,
                 block_table: torch.Tensor | None = None, options: KernelOptions = DEFAULT) -> None:
        Kb, t = block_topk, tiles
        write, pos = packed_write(out, positions, visible_blocks, compress_ratio)
        segs = triton.cdiv(num_cols, t.seg)
        segp = triton.next_power_of_2(segs)
        n = prefill_scratch_elems(chunk, num_rows, num_cols, t, score_block_g)
        self.rows, self.first, self.end = rows, first_row, first_row + num_rows
        self.group = defer_rows(chunk, num_rows, num_cols, t)
        cidx, ckey = (x[: n["cand_idx"]].view(self.group, -1) for x in (scratch.cand_idx, scratch.cand_key))
        common = dict(KB=Kb, BITS=t.bits, SEG=t.seg, SEGP=segp, **write)
        runs = seg_runs(num_cols, t, score_block_g)
        row_s = t.row_s
        if row_s and (t.defer or samples.shape[1] != 1 << row_s) or t.sample_launch and not row_s:
            raise ValueError(f"per-row sample strides (row_s {row_s}) take no deferred resolve, and samples "
                             f"[rows, 2^row_s] (a sample launch writes only those); got {tuple(samples.shape)}")
        S, SAMPP = sample_cols(t, score_block_g), triton.next_power_of_2(samples.shape[1])
        self._samples = _row_samples.bind(
            (rows, triton.cdiv(num_cols, t.sblock)), scores, visible_blocks, samples, row0, num_cols,
            scores.stride(0), samples.stride(0), free=("row0",), options=options, KB=Kb, WBITS=row_s, BLOCK=t.sblock,
            LOG_G=t.log_g, num_warps=4,
        ) if t.sample_launch else None
        sbits = t.sbits if t.bound >= 2 else 0
        # Decode rows of packed output may warm the attention's K/V (`warm.KV`): block_table per call.
        self.kv = kv if kv is not None and row_s and not t.defer and positions is not None else None
        warm_args = self.kv.args(block_table) if self.kv is not None else (visible_blocks, visible_blocks, 0, 0,
                                                                               scores, scores, 0, 0, 0, 0)
        self._bound = _prefill_bound.bind(
            (rows,), visible_blocks, samples, scratch.bound, row0, num_cols, samples.stride(0), free=("row0",), options=options,
            KB=Kb, BITS=t.bits, LBITS=t.lbits, S=S, SAMPP=SAMPP, SBITS=sbits, ROW_SAMPLES=row_s,
            LOG_G=t.log_g, BSLACK=t.bslack, num_warps=t.warps,
        ) if t.bound & 1 else None
        self._topk = _prefill_topk.bind(
            (rows, segs), scores, visible_blocks, samples, cidx, ckey, scratch.counts, scratch.arrive, out, pos,
            scratch.runs, scratch.bound, row0, 0, num_cols, scores.stride(0), samples.stride(0), cidx.stride(0),
            out.stride(0), out.stride(1), *warm_args,
            free=("row0", "crow0", "out_ptr", "stride_or") + (("bt_ptr", "stride_btr", "stride_btp") if self.kv else ()),
            options=options,
            WARM_K=self.kv.k_bytes if self.kv else 0, WARM_V=self.kv.v_bytes if self.kv else 0,
            PAGE=self.kv.k.shape[1] if self.kv else 1,
            KBP=triton.next_power_of_2(Kb), LBITS=t.lbits, S=S, SAMPP=SAMPP, BLOCK=t.block, RBLOCK=t.rblock,
            DEFER=bool(t.defer), RUNS=runs, ROW_SAMPLES=row_s, LOG_G=t.log_g,
            BOUND_IN=bool(t.bound & 1), SBITS=sbits, RSBITS=t.rsbits, BSLACK=t.bslack,
            CAP=t.lists if t.defer else t.cap, LIST=t.list_cap,
            CAP2=0 if t.defer else t.cap2, **common, num_warps=t.warps,
            **({"maxnreg": t.regs} if t.regs else {}),
        )
        resolve = ((t.cap, 0, t.rwarps, t.rregs),) + (((t.cap2, t.cap, t.r2warps, 0),) if t.cap2 else ())
        self._resolve = [_prefill_resolve.bind(
            (self.group,), visible_blocks, cidx, ckey, scratch.counts, out, pos, row0, rows, num_cols,
            cidx.stride(0), out.stride(0), out.stride(1), free=("row0", "n_rows", "out_ptr", "stride_or"), options=options,
            CAP=cap, LIST=t.lists, LO=lo, **common, num_warps=warps, **({"maxnreg": regs} if regs else {}),
        ) for cap, lo, warps, regs in resolve] if t.defer else []

    def __call__(self, row0: int, out: torch.Tensor, out_row_stride: int,
                 block_table: torch.Tensor | None = None) -> None:
        crow0 = (row0 - self.first) % self.group
        if self._samples is not None:
            self._samples(row0)
        if self._bound is not None:
            self._bound(row0)
        if self.kv is not None:
            if block_table is None:
                raise ValueError("this top-k launch warms the attention's K/V: pass the step's block table")
            self._topk(row0, crow0, out, out_row_stride, block_table, block_table.stride(0), block_table.stride(1))
        else:
            self._topk(row0, crow0, out, out_row_stride)
        done = crow0 + self.rows
        if done >= self.group or row0 + self.rows >= self.end:
            for resolve in self._resolve:
                resolve(row0 - crow0, done, out, out_row_stride)
