"""Jit helpers shared by the selection kernels (`select_radix`, `select_topk`,
`select_prefill`): the packed selection row's writes, int32 keys of fp32 scores, candidate-list
compaction, the threshold searches (`kth_key`: radix over key bits; `kth_bound`: the bracket
search; `samples_bound`: a lower bound from samples) and the emits that write a row's chosen
groups at their ascending positions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def packed_groups(row_out, groups, cols, chosen, r: tl.constexpr):
    """Packed rows (unit column stride): the r tokens g*r .. g*r + r - 1 of each chosen group
    g at columns cols*r .. cols*r + r - 1 (any matching shapes)."""
    for j in tl.static_range(r):
        tl.store(row_out + cols * r + j, groups * r + j, mask=chosen)


@triton.jit
def packed_tail(row_out, n_groups, vis, p, live, r: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr):
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


@triton.jit
def score_keys(s_row, cols, mask):
    """int32 keys of scores at cols (masked: -1, below every key)."""
    s = tl.load(s_row + cols, mask=mask, other=0.0)
    return tl.where(mask, s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)


@triton.jit
def compact_step(cols, key, bound, n, l_idx, l_key, CAP: tl.constexpr):
    """One step of a candidate list's compaction: keys [BLOCK] (ascending cols) >= bound go
    to l_key / l_idx after the n already there (the first CAP in all); returns the new n."""
    keep = (key >= bound).to(tl.int32)
    pos = n + tl.cumsum(keep, 0) - keep
    ok = (keep > 0) & (pos < CAP)
    tl.store(l_idx + pos, cols, mask=ok)
    tl.store(l_key + pos, key, mask=ok)
    return n + tl.sum(keep, 0)


@triton.jit
def compact_segment(s_row, lo, hi, bound, l_idx, l_key, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Copy the keys >= bound of columns [lo, hi) of a score row and their columns, ascending,
    to l_key / l_idx (the first CAP of them), BLOCK columns per step; returns how many (the
    segment programs of this module and of `select_prefill`)."""
    ar = tl.arange(0, BLOCK)
    n = lo * 0
    start = lo
    while start < hi:  # (while: the interpreter cannot range over loaded values)
        cols = start + ar
        n = compact_step(cols, score_keys(s_row, cols, cols < hi), bound, n, l_idx, l_key, CAP)
        start += BLOCK
    return n


@triton.jit
def kth_key(key, KB: tl.constexpr, BITS: tl.constexpr, TOP: tl.constexpr):
    """The KB-th largest of keys [N] (int32 in [0, 2^31) or -1 for none) resolved to its TOP
    high bits (31: exact), lower bits 0: the largest such t with at least KB keys >= t; 0
    when fewer than KB keys are >= 0. BITS key bits per step (one block reduction)."""
    j = tl.arange(0, 1 << BITS)
    prefix = tl.sum(key * 0, 0)
    for s in tl.static_range((TOP + BITS - 1) // BITS):
        hi = 31 - BITS * s
        shift = hi - BITS if hi > BITS else 0
        jmax = 1 << (hi - shift)
        t = prefix + (tl.minimum(j, jmax - 1) << shift)
        cnt = tl.sum((key[:, None] >= t[None, :]).to(tl.int32), 0)
        ok = (cnt >= KB) & (j < jmax)
        prefix += tl.maximum(tl.sum(ok.to(tl.int32), 0) - 1, 0) << shift
    return prefix


@triton.jit
def emit(key, idx, thr, out_row, stride_oc, KB: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr):
    """Write the chosen of keys/idx [N] (ascending idx; masked keys -1): keys above thr and
    the lowest-index keys equal to it, KB in all, at their ascending positions of out_row
    (PACKED: each group's R tokens at R x its position)."""
    packed = ((key > thr).to(tl.int32) << 16) | (key == thr).to(tl.int32)  # one scan for both ranks (N < 2^15)
    _emit_ranked(idx, packed, KB - (tl.sum(packed, 0) >> 16), out_row, stride_oc, KB, PACKED, R)


@triton.jit
def emit_above(key, idx, thr, n_above, out_row, stride_oc, KB: tl.constexpr, PACKED: tl.constexpr,
                R: tl.constexpr):
    """`emit` with n_above, the number of keys > thr (<= KB), known: no count of them."""
    packed = ((key > thr).to(tl.int32) << 16) | (key == thr).to(tl.int32)
    _emit_ranked(idx, packed, KB - n_above, out_row, stride_oc, KB, PACKED, R)


@triton.jit
def _taken_count(counts, need):
    """Keys chosen among those counted by counts = (keys above << 16) | ties: every key above,
    the first need ties."""
    return (counts >> 16) + tl.minimum(counts & 0xFFFF, need)


@triton.jit
def _emit_ranked(idx, packed, need, out_row, stride_oc, KB: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr):
    """`emit`'s writes from packed = (above << 16) | equal per key and need, the ties to take
    (every key above, the first need ties): a key's position is the count of chosen keys
    before it, and it is chosen where the count through it is larger (one compare a key)."""
    incl = tl.cumsum(packed, 0)
    pos = _taken_count(incl - packed, need)
    _store_groups(out_row, stride_oc, idx, pos, pos < _taken_count(incl, need), KB, PACKED, R)


@triton.jit
def _store_groups(out_row, stride_oc, groups, pos, chosen, KB: tl.constexpr, PACKED: tl.constexpr,
                  R: tl.constexpr):
    """Chosen groups at their positions, only in the row's KB columns (0 <= pos < KB, whatever
    the counts say): out_row[pos] = group, or (PACKED) its R tokens."""
    put = chosen & (pos.to(tl.uint32) < KB)
    if PACKED:
        packed_groups(out_row, groups, pos, put, R)
    else:
        tl.store(out_row + pos * stride_oc, groups, mask=put)


@triton.jit
def write_short(out_row, stride_oc, vis, KB: tl.constexpr, KBP: tl.constexpr, PACKED: tl.constexpr,
                 R: tl.constexpr):
    """A row with visible <= KB: groups 0..vis-1, then -1 (PACKED: their tokens)."""
    j = tl.arange(0, KBP)
    if PACKED:
        packed_groups(out_row, j, j, j < vis, R)
    else:
        tl.store(out_row + j * stride_oc, tl.where(j < vis, j, -1), mask=j < KB)


@triton.jit
def write_tail(out_row, pos_ptr, row, vis, KB: tl.constexpr, PACKED: tl.constexpr, R: tl.constexpr,
                W: tl.constexpr, BLOCK_W: tl.constexpr):
    """PACKED: the row's open tail, -1 padding and count after its min(vis, KB) groups."""
    if PACKED:
        packed_tail(out_row, tl.minimum(vis, KB), vis, tl.load(pos_ptr + row), True, R, W, BLOCK_W)


@triton.jit
def _bracket_step(key, t, lo, hi, c_lo, c_hi, KB: tl.constexpr):
    """One counting step of `kth_bound`: keys [N] >= each candidate t [M] (one block
    reduction); candidates strictly inside (lo, hi) narrow the bracket. Returns (lo, hi,
    c_lo, c_hi): c_lo = keys >= lo (>= KB), c_hi = keys >= hi (< KB)."""
    cnt = tl.sum((key[:, None] >= t[None, :]).to(tl.int32), 0)
    inside = (t > lo) & (t < hi)
    ok = inside & (cnt >= KB)
    low = inside & (cnt < KB)
    return (tl.max(tl.where(ok, t, lo), 0), tl.min(tl.where(low, t, hi), 0), tl.min(tl.where(ok, cnt, c_lo), 0),
            tl.max(tl.where(low, cnt, c_hi), 0))


@triton.jit
def kth_bound(key, vis, KB: tl.constexpr, BITS: tl.constexpr, SLACK: tl.constexpr = 0):
    """(thr, keys > thr) for `emit_above` of keys [N] (int32 in [0, 2^31), -1 masked;
    vis > KB valid): thr = the KB-th largest key, or one with exactly KB keys > thr. A
    bracket [lo, hi) with >= KB keys >= lo and < KB keys >= hi narrows by 2^BITS counts per
    step (`_bracket_step`) until hi = lo + 1 (thr = lo) or exactly KB keys are >= lo (thr =
    lo - 1): the first step's candidates are spread linearly in value below the largest key,
    later ones linearly in key bits over the bracket; candidate lo + 1 ends a search whose
    KB-th key is lo (ties). SLACK > 0 (`samples_bound` only: a lower bound, not the KB-th key):
    the search also ends once at most KB + SLACK keys are >= lo (thr = lo)."""
    j = tl.arange(0, 1 << BITS)
    top = tl.max(key, 0)
    frac = j.to(tl.float32) * (1.0 / (1 << BITS))
    t = tl.where(j == 0, 1, (top.to(tl.float32, bitcast=True) * frac).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    lo, hi, c_lo, c_hi = _bracket_step(key, t, vis * 0, top.to(tl.int64) + 1, vis, vis * 0, KB)
    # (the same trip count in every thread of the program)
    while (lo + 1 < hi) & (c_lo != KB) & ((SLACK == 0) | (c_lo > KB + SLACK)):
        t = tl.where(j == 0, lo + 1, lo + ((hi - lo) * j >> BITS)).to(tl.int32)
        lo, hi, c_lo, c_hi = _bracket_step(key, t, lo, hi, c_lo, c_hi, KB)
    exact = c_lo == KB
    return tl.where(exact, lo - 1, lo).to(tl.int32), tl.where(exact, KB, c_hi)


@triton.jit
def samples_bound(samples, KB: tl.constexpr, SBITS: tl.constexpr, SLACK: tl.constexpr = 0):
    """A lower bound of a row's KB-th largest key from its samples int32 [N] (each a real key
    of the row, the largest of a subset of its columns; -1: an empty subset) by the bracket
    search (`kth_bound`, 2^SBITS counts a step): its bracket's low end, the KB-th largest
    sample or a value >= 0 below it that exactly KB samples reach (SLACK > 0: or that KB + 1 to
    KB + SLACK samples reach, a looser bound in fewer steps); 0 with fewer than KB samples.
    Either way >= KB of the row's keys reach it."""
    thr, n_above = kth_bound(samples, tl.sum((samples >= 0).to(tl.int32), 0), KB, SBITS, SLACK)
    return thr + (n_above == KB).to(tl.int32)  # (thr: one below the low end where KB samples reach it)


@triton.jit
def _row_block(s_row, l_idx, l_key, start, ar, n, listed):
    """Columns and keys of a row's entries [start, start + BLOCK) below n (others key -1): its
    scores' (n = visible), or (listed, a runtime flag) a compacted candidate list's (n entries,
    ascending column)."""
    i = start + ar
    if listed:
        cols = tl.load(l_idx + i, mask=i < n, other=0)
        key = tl.load(l_key + i, mask=i < n, other=-1)
    else:
        cols = i
        key = score_keys(s_row, i, i < n)
    return cols, key


@triton.jit
def resolve_row(s_row, vis, out_row, stride_oc, KB: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                PACKED: tl.constexpr, R: tl.constexpr, l_idx, l_key, listed):
    """Exact top-k of a whole row by sweeps over its scores (the overflow route): the
    threshold's bits by counts (`kth_key` with the keys streamed), then the emit. listed (a
    runtime flag, so one copy of the sweeps serves both): over the row's candidates compacted
    into l_idx / l_key (vis of them, ascending column: every key of the row at or above a lower
    bound of its Kb-th) instead, the same result."""
    ar = tl.arange(0, BLOCK)
    j = tl.arange(0, 1 << BITS)
    prefix = vis * 0
    # A runtime loop, not `static_range`: unrolled, each of the 31 / BITS steps would be a copy
    # of the sweep in every kernel that carries this rare route (compile time, not speed).
    for s in range((31 + BITS - 1) // BITS):
        hi = 31 - BITS * s
        shift = tl.maximum(hi - BITS, 0)
        jmax = 1 << (hi - shift)
        t = prefix + (tl.minimum(j, jmax - 1) << shift)
        cnt = tl.zeros((1 << BITS,), tl.int32)
        start = vis * 0
        while start < vis:
            key = _row_block(s_row, l_idx, l_key, start, ar, vis, listed)[1]
            cnt += tl.sum((key[:, None] >= t[None, :]).to(tl.int32), 0)
            start += BLOCK
        ok = (cnt >= KB) & (j < jmax)
        prefix += tl.maximum(tl.sum(ok.to(tl.int32), 0) - 1, 0) << shift
    above_all = vis * 0
    start = vis * 0
    while start < vis:
        key = _row_block(s_row, l_idx, l_key, start, ar, vis, listed)[1]
        above_all += tl.sum((key > prefix).to(tl.int32), 0)
        start += BLOCK
    need = KB - above_all
    taken = vis * 0
    ties = vis * 0
    start = vis * 0
    while start < vis:
        cols, key = _row_block(s_row, l_idx, l_key, start, ar, vis, listed)
        above = (key > prefix).to(tl.int32)
        equal = (key == prefix).to(tl.int32)
        rank = ties + tl.cumsum(equal, 0) - equal
        chosen = above + equal * (rank < need).to(tl.int32)
        _store_groups(out_row, stride_oc, cols, taken + tl.cumsum(chosen, 0) - chosen, chosen > 0, KB, PACKED, R)
        taken += tl.sum(chosen, 0)
        ties += tl.sum(equal, 0)
        start += BLOCK
