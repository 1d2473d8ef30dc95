"""Prefill sparse attention that shares gathered K/V tiles across neighbouring rows (tile union).

Contract: `qsa_core/reference/attention.py`, the same op as `attention.py`'s kernel. The rows
are cut into blocks of BR consecutive rows (BR x G query heads fill the MMA's M), three launches:

1. `_union_kernel`, one program per block: a first look (row 0's first groups searched in the
   block's last row with entries) sends blocks unlikely to meet the ratio per row at once; else it
   checks that each row of the block is a packed row as the top-k writes it (entries
   ascending, whole groups g*r .. g*r + r - 1, then the open tail from a group boundary, all
   in [0, seq_len); the active rows of one request), and writes
   the block's groups as runs: a group (the KV slot of its first token, resolved through the
   request's block table) with the bitmask of the consecutive rows holding it, so that each
   (row, group) lies in one run; plus the slots of each row's last entry and of the request's
   last token. A block is *shared* when it is well formed and its runs number at most
   `max_union_ratio` x the sum of its rows' groups; else -1.
2. `_shared_kernel`, (block, KV head): walks the runs in tiles of BLOCK_G groups, gathers each
   K/V tile once for the whole block (no page lookups: the runs hold slots) and masks row i to
   the groups of its bit and, in the group of its last entry, the tokens up to it, which is
   exactly its own selection (a row's chosen groups all lie below its tail). Fallback blocks
   return at once. A request's block-table row must name distinct pages (as engines' do): the
   slots stand for tokens.
3. `_per_row_kernel`, (row, KV head): `attention.py`'s one-pass online softmax, for the rows
   of fallback blocks only (holes, junk and duplicates handled as there); rows of shared
   blocks return at once.

Rows with nothing valid (padding) give exact 0. Within a shared block a non-finite V entry
that some row selects reaches the block's other rows too (0 * NaN in the shared P @ V); tokens
>= seq_len are never loaded. `PrefillAttentionLaunch` binds the three launches once;
`attention.plan_attention` plans this path for chunks of >= 1024 rows unless `KernelOptions.shared_prefill` is off
(see there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_common import (LOG2E, attend, dot_dtype, launch_config, normalized_store, online_update, store_row,
                               tile_scores)
from .launch import BoundLaunch, Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions

# Blocks whose runs number at most this fraction of their rows' groups run shared: the shared
# kernel costs several times the per-row kernel per gathered token, so only blocks whose rows
# share most of their groups gain. 0.3 beat 0.25 where neighbours overlap 0.90-0.98 and matched
# the per-row kernel elsewhere; blocks of 5 rows (`default_block_rows`) beat 2 everywhere and 10
# at all but the highest overlap (H200, see NOTES.md (Kernels)). Measure:
# `python benchmarks/bench_qsa.py --only prefill-16384-1-16384-bf16 --prefill-data overlap --out DIR`.
MAX_UNION_RATIO = 0.3


@triton.jit
def _holds(sel_row, n, gt, active, R: tl.constexpr, LOG: tl.constexpr):
    """Where `active`: whether a row's first n groups (ascending first tokens at columns
    0, R, 2R, ...) hold the group of first token gt (lower-bound search, LOG >= log2(n + 1))."""
    lo = tl.zeros_like(gt)
    hi = tl.where(active, n, 0)
    for _ in range(LOG):
        look = lo < hi
        mid = (lo + hi) // 2
        lt = tl.load(sel_row + mid * R, mask=look, other=0) < gt
        lo = tl.where(look & lt, mid + 1, lo)
        hi = tl.where(look & ~lt, mid, hi)
    return active & (lo < n) & (tl.load(sel_row + lo * R, mask=active & (lo < n), other=-1) == gt)


@triton.jit
def _slot(bt_row, tok, valid, stride_btp, PAGE: tl.constexpr):
    """int32 KV slot (page x PAGE + offset) of token tok through a request's block-table row,
    where valid (else 0)."""
    page = tl.maximum(tl.load(bt_row + (tok // PAGE) * stride_btp, mask=valid, other=0), 0)
    return tl.where(valid, page * PAGE + tok % PAGE, 0)


@triton.jit
def _sel_row(sel_ptr, blk, i, T, stride_st, BR: tl.constexpr):
    """Selection row of the block's row i (clamped to the last row T - 1: padding reads a real
    row, masked after)."""
    return sel_ptr + tl.minimum(blk * BR + i, T - 1).to(tl.int64) * stride_st


@triton.jit
def _at(v, jr, i):
    """Entry i of the block's per-row vector v [BRP] (jr = arange(BRP); 0 where i is no row)."""
    return tl.sum(tl.where(jr == i, v, 0), 0)


@triton.jit
def _row_runs(sel_ptr, sel_i, sel_p, ng_i, ng_p, n_groups, jr, blk, i, c0, n_union, T, stride_st, bt_row, ok,
              stride_btp, base, mbase, BR: tl.constexpr, R: tl.constexpr, LOG: tl.constexpr, CAP: tl.constexpr,
              PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """The runs that row i of block blk opens among its groups c0 .. c0 + BLOCK - 1 (first tokens
    at columns c0 * R, ...): a group opens one unless row i - 1 holds it too; its mask has the
    bits of the consecutive rows i, i + 1, ... holding it (binary searches over the rows'
    ascending group tokens). Writes them at n_union, n_union + 1, ... (below CAP) and returns
    the new count."""
    kk = c0 + tl.arange(0, BLOCK)
    gv = kk < ng_i
    gt = tl.load(sel_i + kk * R, mask=gv, other=0)
    start = gv & ~_holds(sel_p, ng_p, gt, gv, R, LOG)
    bits = tl.where(start, 1 << i, 0)
    alive = start
    j = i + 1
    while (j < BR) & (tl.max(alive.to(tl.int32), 0) > 0):
        alive = alive & _holds(_sel_row(sel_ptr, blk, j, T, stride_st, BR), _at(n_groups, jr, j), gt, alive, R, LOG)
        bits = bits | tl.where(alive, 1 << j, 0)
        j += 1
    k32 = start.to(tl.int32)
    pos = n_union + tl.cumsum(k32, 0) - k32
    first = _slot(bt_row, gt, tl.where(ok, start, False), stride_btp, PAGE)
    tl.store(base + pos, first, mask=start & (pos < CAP))
    tl.store(mbase + pos, bits, mask=start & (pos < CAP))
    return n_union + tl.sum(k32, 0)


@triton.jit(do_not_specialize=["T"])
def _union_kernel(
    req_ptr, seq_ptr, sel_ptr, bt_ptr, info_ptr, last_ptr, ug_ptr, um_ptr, T, max_ratio, min_share, stride_st,
    stride_btr, stride_btp,
    BR: tl.constexpr, BRP: tl.constexpr, W: tl.constexpr, R: tl.constexpr, NG: tl.constexpr, CAP: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, PRE: tl.constexpr,
    LOG: tl.constexpr, PDL: tl.constexpr = 0,
):
    """Grid (blocks,). info int32 [blocks, 2]: (number of runs or -1 = per-row, the KV slot of
    the block's request's last token); last int32 [T]: the KV slot of a fully passed block's
    rows' last entries (-1: empty or the block not well formed); ug / um int32 [blocks, CAP]: the
    runs' group first KV slots (page-resolved through the block table) and row bitmasks.
    selection with unit column stride.

    First look: of row 0's first PRE groups, the share the block's last row with entries holds;
    below min_share (host-side, `_min_share`) the block goes per row at once."""
    pdl_start(PDL)
    blk = tl.program_id(0)
    jr = tl.arange(0, BRP)  # the block's rows on axis 0
    rows = blk * BR + jr
    inb = (jr < BR) & (rows < T)
    sel_rows = _sel_row(sel_ptr, blk, jr, T, stride_st, BR)
    counts = tl.where(inb, tl.minimum(tl.maximum(tl.load(sel_rows + W), 0), W), 0)
    n_groups = (counts + R - 1) // R
    lr = tl.max(tl.where(counts > 0, jr, 0), 0)  # the block's last row with entries (padding has none)
    pk = tl.arange(0, PRE)
    pv = pk < _at(n_groups, jr, 0)
    hit = _holds(_sel_row(sel_ptr, blk, lr, T, stride_st, BR), _at(n_groups, jr, lr),
                 tl.load(_sel_row(sel_ptr, blk, 0, T, stride_st, BR) + pk * R, mask=pv, other=0), pv, R, LOG)
    info = -1
    block_end = 0
    if tl.sum(hit.to(tl.int32), 0) >= min_share * tl.sum(pv.to(tl.int32), 0):
        reqs = tl.load(req_ptr + tl.minimum(rows, T - 1))
        seq_lens = tl.load(seq_ptr + reqs)
        bad = 0
        for c0 in range(0, W, BLOCK_C):
            k = c0 + tl.arange(0, BLOCK_C)[None, :]
            inc = k < counts[:, None]
            e = tl.load(sel_rows[:, None] + k, mask=inc, other=0)
            prev = tl.load(sel_rows[:, None] + k - 1, mask=inc & (k > 0), other=-1)
            kr = k % R
            good = (e >= 0) & (e < seq_lens[:, None]) & (e % R == kr) & tl.where(kr == 0, e > prev, e == prev + 1)
            bad += tl.sum(tl.sum(tl.where(inc & ~good, 1, 0), 1), 0)
        active = counts > 0
        req_lo = tl.min(tl.where(active, reqs, 2147483647), 0)
        req_hi = tl.max(tl.where(active, reqs, -1), 0)
        # Well formed and of one request (or none: padding, shared with nothing to do); with a
        # request (ok), its tokens resolve to KV slots through that request's pages.
        well = (bad == 0) & (req_lo >= req_hi)
        ok = well & (req_hi >= 0)
        block_req = tl.where(req_hi >= 0, req_hi, 0)
        bt_row = bt_ptr + block_req.to(tl.int64) * stride_btr
        has_last = tl.where(ok, active, False)  # not `active & ok`: the interpreter makes that int32
        last = tl.load(sel_rows + counts - 1, mask=has_last, other=0)
        tl.store(last_ptr + rows, tl.where(has_last, _slot(bt_row, last, has_last, stride_btp, PAGE), -1), mask=inb)
        end = tl.load(seq_ptr + block_req) - 1
        end_slot = tl.where(ok, _slot(bt_row, end, ok, stride_btp, PAGE), 0)
        total = tl.sum(n_groups, 0)
        # Runs, row by row (`_row_runs`): each (row, group) lies in exactly one, so a group that
        # skips a row gets one run per stretch of rows. Stops once they outgrow the ratio.
        limit = max_ratio * total
        n_union = 0
        base = ug_ptr + blk.to(tl.int64) * CAP
        mbase = um_ptr + blk.to(tl.int64) * CAP
        i = 0
        while (i < BR) & (n_union <= limit):
            sel_i = _sel_row(sel_ptr, blk, i, T, stride_st, BR)
            sel_p = _sel_row(sel_ptr, blk, tl.maximum(i - 1, 0), T, stride_st, BR)
            ng_i = _at(n_groups, jr, i)
            ng_p = _at(n_groups, jr, i - 1)  # 0 for row 0
            for c0 in range(0, NG // BLOCK_G * BLOCK_G, BLOCK_G):
                n_union = _row_runs(sel_ptr, sel_i, sel_p, ng_i, ng_p, n_groups, jr, blk, i, c0, n_union, T,
                                    stride_st, bt_row, ok, stride_btp, base, mbase, BR, R, LOG, CAP, PAGE, BLOCK_G)
            if NG % BLOCK_G:  # the groups past the last whole tile (the open tail's) in a narrow one
                n_union = _row_runs(sel_ptr, sel_i, sel_p, ng_i, ng_p, n_groups, jr, blk, i,
                                    NG // BLOCK_G * BLOCK_G, n_union, T, stride_st, bt_row, ok, stride_btp, base,
                                    mbase, BR, R, LOG, CAP, PAGE, BLOCK_T)
            i += 1
        info = tl.where(well & (n_union <= limit), n_union, -1)
        block_end = end_slot
    tl.store(info_ptr + blk * 2, info)
    tl.store(info_ptr + blk * 2 + 1, block_end)
    pdl_end(PDL)


@triton.jit
def _shared_tile(
    q, m, l, acc, t0, n_union, ug_row, um_row, end_slot, kvh, k_ptr, v_ptr, qk_scale, local, last,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr, R: tl.constexpr, BLOCK_G: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Online-softmax update of the block's M query heads with union groups [t0, t0 + BLOCK_G).

    A group's R tokens lie in one page at consecutive slots (page_size % R == 0), so slots stand
    for tokens: the only group a row holds in part is the one of its last entry (its open tail),
    and the only group with tokens >= seq_len is the one of the request's last token (end_slot);
    those are found by their first slot (a request's pages are distinct)."""
    n = tl.arange(0, BLOCK_G * R)
    gi = t0 + n // R
    inu = gi < n_union
    first = tl.load(ug_row + gi, mask=inu, other=0)
    bits = tl.load(um_row + gi, mask=inu, other=0)
    nr = n % R
    real = inu & ((first != end_slot - end_slot % R) | (nr <= end_slot % R))
    slot = first + nr
    page = (slot // PAGE).to(tl.int64)
    off = (slot % PAGE).to(tl.int64)
    s = tile_scores(q, page, off, real, kvh, k_ptr, qk_scale, stride_kp, stride_ks, stride_kh, D, DP, DOT_DTYPE)
    in_tail = first[None, :] == (last - last % R)[:, None]
    keep = ((((bits[None, :] >> local[:, None]) & 1) != 0) & (~in_tail | (nr[None, :] <= (last % R)[:, None]))
            & real[None, :])
    return online_update(s, keep, m, l, acc, page, off, real, kvh, v_ptr, stride_vp, stride_vs, stride_vh,
                         D, DP, DOT_DTYPE)


@triton.jit(do_not_specialize=["T"])
def _shared_kernel(
    q_ptr, gate_ptr, k_ptr, v_ptr, info_ptr, last_ptr, ug_ptr, um_ptr, out_ptr,
    T, qk_scale, v_scale,
    stride_qt, stride_qh, stride_gt, stride_gh, stride_ot,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    BR: tl.constexpr, G: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, R: tl.constexpr, CAP: tl.constexpr, BLOCK_G: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Grid (blocks, KV heads): out [T, HQ*D] of a shared block's rows; fallback blocks return."""
    pdl_start(PDL)
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    n_union = tl.load(info_ptr + blk * 2)
    if n_union >= 0:
        end_slot = tl.load(info_ptr + blk * 2 + 1)
        mi = tl.arange(0, M)
        local = mi // G
        row = blk * BR + local
        live = (mi < BR * G) & (row < T)
        heads = kvh * G + mi % G
        d = tl.arange(0, DP)
        mask = live[:, None] & (d < D)[None, :]
        rows64 = tl.minimum(row, T - 1).to(tl.int64)
        q = tl.load(q_ptr + (rows64 * stride_qt + heads * stride_qh)[:, None] + d[None, :], mask=mask,
                    other=0.0).to(DOT_DTYPE)
        last = tl.load(last_ptr + row, mask=live, other=-1)
        m = tl.full((M,), float("-inf"), tl.float32)
        l = tl.zeros((M,), tl.float32)
        acc = tl.zeros((M, DP), tl.float32)
        ug_row = ug_ptr + blk.to(tl.int64) * CAP
        um_row = um_ptr + blk.to(tl.int64) * CAP
        if INTERPRET:  # the interpreter cannot range over tensor bounds
            t0 = 0
            while t0 < n_union:
                m, l, acc = _shared_tile(
                    q, m, l, acc, t0, n_union, ug_row, um_row, end_slot, kvh, k_ptr, v_ptr, qk_scale,
                    local, last, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                    D, DP, PAGE, R, BLOCK_G, DOT_DTYPE,
                )
                t0 += BLOCK_G
        else:
            for t0 in range(0, n_union, BLOCK_G):
                m, l, acc = _shared_tile(
                    q, m, l, acc, t0, n_union, ug_row, um_row, end_slot, kvh, k_ptr, v_ptr, qk_scale,
                    local, last, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                    D, DP, PAGE, R, BLOCK_G, DOT_DTYPE,
                )
        g_off = (rows64 * stride_gt + heads * stride_gh)[:, None] + d[None, :]
        o_off = (rows64 * stride_ot + heads * D)[:, None] + d[None, :]
        normalized_store(acc, l, v_scale, gate_ptr, out_ptr, g_off, o_off, mask)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["W"])
def _per_row_kernel(
    q_ptr, gate_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, info_ptr, out_ptr, W, qk_scale, v_scale,
    stride_qt, stride_qh, stride_gt, stride_gh, stride_ot,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btr, stride_btp, stride_st, stride_sc,
    BR: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Grid (rows, KV heads): `attention.py`'s one pass for rows of fallback blocks."""
    pdl_start(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    if tl.load(info_ptr + (row // BR) * 2) < 0:
        m, l, acc = attend(
            q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, row, kvh, 0, 1, W, qk_scale,
            stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_btr, stride_btp, stride_st, stride_sc,
            G, GP, D, DP, PAGE, BLOCK_N, DOT_DTYPE, INTERPRET,
        )
        store_row(acc, l, row, kvh, v_scale, gate_ptr, out_ptr, stride_gt, stride_gh, stride_ot, G, GP, D, DP)
    pdl_end(PDL)


@dataclass(frozen=True)
class PrefillSchedule:
    """How one shared-tile prefill attention runs, fixed when the step is planned.

    Workspace views: info int32 [blocks, 2], last int32 [T], union_tokens / union_masks int32
    [blocks, cap] (`union_capacity`)."""

    num_rows: int
    block_rows: int
    compress_ratio: int
    block_groups: int
    num_warps: int
    num_stages: int
    max_union_ratio: float
    options: KernelOptions
    row_launch: tuple[int, int, int]
    info: torch.Tensor
    last: torch.Tensor
    union_tokens: torch.Tensor
    union_masks: torch.Tensor


def _launch_config(dp: int, small_tiles: bool) -> tuple[int, int, int]:
    """(BLOCK_G groups per shared tile, num_warps, num_stages) of the shared kernel. D 256, M 64:
    8 groups (32 tokens), 4 warps, 3 stages, the fastest of the H200 sweep (2 stages tied; see
    NOTES.md (Kernels))."""
    if small_tiles:
        return 8, 4, 1
    return (8, 4, 3) if dp >= 256 else (16, 4, 2)


def union_capacity(block_rows: int, width: int, compress_ratio: int, max_union_ratio: float) -> int:
    """Runs a block's union can hold. The union pass starts a row only while its runs number at
    most max_union_ratio x the block's groups, and a row adds at most ceil(W / r) runs: so
    ratio x block_rows x ceil(W / r) + ceil(W / r) (+ 1 for fp32 rounding), at most every row's
    groups (Hq 24 / Hkv 2, ratio 0.3: 2.5 of 5 rows' groups)."""
    ng = triton.cdiv(width, compress_ratio)
    return min(block_rows * ng, math.floor(max_union_ratio * block_rows * ng) + ng + 1)


def workspace_size(num_rows: int, num_heads: int, num_kv_heads: int, width: int, compress_ratio: int,
                   block_rows: int | None = None, max_union_ratio: float = MAX_UNION_RATIO) -> int:
    """int32 elements of the workspace a `plan_prefill_attention` of num_rows needs (~2.1 KB a
    row at Hq 24 / Hkv 2, W 2051, r 4)."""
    br = block_rows or default_block_rows(num_heads, num_kv_heads)
    return _workspace_offsets(num_rows, br, union_capacity(br, width, compress_ratio, max_union_ratio))[-1]


def _workspace_offsets(num_rows: int, block_rows: int, cap: int) -> tuple[int, int, int, int]:
    """Start of the views last, ut, um and the end (int32 elements), each start a multiple of 4:
    every view 16-byte aligned whatever num_rows, so one compiled variant serves every step
    (Triton specializes a pointer on its 16-byte alignment)."""
    blocks = triton.cdiv(num_rows, block_rows)
    last = -(-blocks * 2 // 4) * 4
    ut = -(-(last + num_rows) // 4) * 4
    um = -(-(ut + blocks * cap) // 4) * 4
    return last, ut, um, um + blocks * cap


def default_block_rows(num_heads: int, num_kv_heads: int) -> int:
    """Rows per block: as many as fill 64 query heads of the MMA's M (Hq 24 / Hkv 2: 5 rows)."""
    return max(1, min(31, 64 // (num_heads // num_kv_heads)))


def plan_prefill_attention(
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    width: int,
    compress_ratio: int,
    *,
    device: torch.device | str,
    block_rows: int | None = None,
    max_union_ratio: float = MAX_UNION_RATIO,
    workspace: torch.Tensor | None = None,
    launch: tuple[int, int, int] | None = None,
    row_launch: tuple[int, int, int] | None = None,
    context: int = 0,
    options: KernelOptions = DEFAULT,
) -> PrefillSchedule:
    """Schedule of a shared-tile attention over num_rows rows of W = width selection columns
    of groups of r = compress_ratio tokens. workspace: flat int32 of `workspace_size`, else
    allocated. launch: the shared kernel's (BLOCK_G, num_warps, num_stages), else
    `_launch_config`; row_launch: the per-row kernel's (BLOCK_N, num_warps, num_stages), else
    `attention.py`'s one-pass shape for requests of at most `context` tokens (0: unknown)."""
    dev = torch.device(device)
    br = block_rows or default_block_rows(num_heads, num_kv_heads)
    if not 1 <= br <= 31:
        raise ValueError(f"block_rows must be in [1, 31] (a row bitmask of int32), got {br}")
    block_g, warps, stages = launch or _launch_config(triton.next_power_of_2(head_dim), options.small_tiles)
    row = row_launch or launch_config(triton.next_power_of_2(head_dim), False, context, options.small_tiles)
    blocks = triton.cdiv(num_rows, br)
    cap = union_capacity(br, width, compress_ratio, max_union_ratio)
    need = workspace_size(num_rows, num_heads, num_kv_heads, width, compress_ratio, br, max_union_ratio)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.int32, device=dev)
    if workspace.dtype != torch.int32 or workspace.numel() < need:
        raise ValueError(f"prefill attention workspace must be int32 of >= {need} elements, "
                         f"got {workspace.dtype} of {workspace.numel()}")
    at_last, at_ut, at_um, _ = _workspace_offsets(num_rows, br, cap)
    info = workspace[: blocks * 2].view(blocks, 2)
    last = workspace[at_last: at_last + num_rows]
    ut = workspace[at_ut: at_ut + blocks * cap].view(blocks, cap)
    um = workspace[at_um: at_um + blocks * cap].view(blocks, cap)
    return PrefillSchedule(num_rows, br, compress_ratio, block_g, warps, stages, float(max_union_ratio), options,
                           row, info, last, ut, um)


def union_tiles(num_groups: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_T) of the union pass over a row's num_groups groups: whole tiles of BLOCK_G
    and, for the groups past them, one of BLOCK_T; or one padded tile where that has no more
    lanes. Every lane pays each search's steps: 513 groups (W 2051) take 512 + 16 lanes, not 1024."""
    tile = min(1024, 1 << (num_groups.bit_length() - 1))
    rest = num_groups % tile
    tail = max(16, triton.next_power_of_2(rest)) if rest else 0
    if num_groups <= 1024 and triton.next_power_of_2(num_groups) <= num_groups - rest + tail:
        return triton.next_power_of_2(num_groups), 16
    return tile, tail or 16


# Groups of a block's first row looked up in its last row before the full pass.
_FIRST_LOOK = 64


def _min_share(block_rows: int, max_ratio: float) -> float:
    """Share of the first look's groups the last row must hold for the full pass. Where each row
    keeps a share o of the previous row's n groups, a block's union is about n (1 + (BR - 1)(1 - o))
    and its first and last rows share about o^(BR - 1): the share at which that union meets the
    ratio (BR 5, ratio 0.3: 0.59). A looser share (2 - BR x ratio less 0.15: 0.35) let through
    blocks that then failed the full pass, which was slower (H200, NOTES.md (Kernels))."""
    if block_rows == 1:
        return 0.0
    keep = min(1.0, max(0.0, 1.0 - (block_rows * max_ratio - 1.0) / (block_rows - 1)))
    return keep ** (block_rows - 1)


_UNION_FREE = ("req_ptr", "seq_ptr", "sel_ptr", "bt_ptr", "stride_st", "stride_btr", "stride_btp")
_SHARED_FREE = ("q_ptr", "gate_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_gt", "stride_gh", "stride_ot")
_ROW_FREE = ("q_ptr", "gate_ptr", "bt_ptr", "req_ptr", "seq_ptr", "sel_ptr", "out_ptr", "stride_qt", "stride_qh",
             "stride_gt", "stride_gh", "stride_ot", "stride_btr", "stride_btp", "stride_st", "stride_sc")


class PrefillAttentionLaunch:
    """The shared-tile attention bound once to a `PrefillSchedule`, a layer's K/V cache and its
    scales; `__call__(q, gate, block_table, token_to_req, seq_lens, selection, out)` as
    `attention.AttentionLaunch` (same shapes, any strides; selection rows with unit column
    stride)."""

    def __init__(self, q: torch.Tensor, gate: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, token_to_req: torch.Tensor, seq_lens: torch.Tensor,
                 selection: torch.Tensor, *, softmax_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                 out: torch.Tensor, schedule: PrefillSchedule) -> None:
        T, Hq, D = q.shape
        _, page, Hkv, _ = k_cache.shape
        W = selection.shape[1] - 1
        s = schedule
        if T != s.num_rows:
            raise ValueError(f"the prefill attention schedule was planned for {s.num_rows} rows, got {T}")
        if selection.stride(1) != 1:
            raise ValueError(f"selection must have unit column stride, got {selection.stride(1)}")
        if page % s.compress_ratio:
            raise ValueError(f"page_size {page} must be a multiple of compress_ratio {s.compress_ratio}")
        self.num_rows = T
        self._launches: list[tuple[BoundLaunch, str]] = []
        if T == 0:
            return
        G = Hq // Hkv
        DP = triton.next_power_of_2(D)
        R, BR = s.compress_ratio, s.block_rows
        blocks = s.info.shape[0]
        ng = triton.cdiv(W, R)
        block_g, block_t = union_tiles(ng)
        options = s.options
        dot = dot_dtype(q, k_cache, options.interpreter)
        qk_scale = softmax_scale * k_scale * LOG2E
        self._launches.append((_union.bind(
            (blocks,), token_to_req, seq_lens, selection, block_table, s.info, s.last, s.union_tokens,
            s.union_masks, T, s.max_union_ratio, _min_share(BR, s.max_union_ratio), selection.stride(0),
            block_table.stride(0), block_table.stride(1), free=_UNION_FREE, options=options,
            BR=BR, BRP=triton.next_power_of_2(BR), W=W, R=R, NG=ng, CAP=s.union_tokens.shape[1], PAGE=page,
            BLOCK_C=min(4096 // triton.next_power_of_2(BR), triton.next_power_of_2(W)),
            BLOCK_G=block_g, BLOCK_T=block_t, PRE=min(_FIRST_LOOK, triton.next_power_of_2(ng)),
            LOG=max(1, math.ceil(math.log2(ng + 1))), num_warps=4,
        ), "union"))
        kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        self._launches.append((_shared.bind(
            (blocks, Hkv), q, gate, k_cache, v_cache, s.info, s.last, s.union_tokens, s.union_masks, out, T,
            qk_scale, v_scale, q.stride(0), q.stride(1), gate.stride(0), gate.stride(1), out.stride(0), *kv_strides,
            free=_SHARED_FREE, options=options,
            BR=BR, G=G, M=max(16, triton.next_power_of_2(BR * G)), D=D, DP=DP, PAGE=page, R=R,
            CAP=s.union_tokens.shape[1], BLOCK_G=s.block_groups, DOT_DTYPE=dot, INTERPRET=options.interpreter,
            num_warps=s.num_warps, num_stages=s.num_stages,
        ), "shared"))
        row_block, row_warps, row_stages = s.row_launch
        self._launches.append((_per_row.bind(
            (T, Hkv), q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection, s.info, out, W,
            qk_scale, v_scale, q.stride(0), q.stride(1), gate.stride(0), gate.stride(1), out.stride(0), *kv_strides,
            block_table.stride(0), block_table.stride(1), selection.stride(0), selection.stride(1), free=_ROW_FREE,
            options=options,
            BR=BR, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=DP, PAGE=page, BLOCK_N=row_block,
            DOT_DTYPE=dot, INTERPRET=options.interpreter, num_warps=row_warps, num_stages=row_stages,
        ), "row"))

    def __call__(self, q: torch.Tensor, gate: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                 seq_lens: torch.Tensor, selection: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.num_rows or out.shape[0] != self.num_rows:
            raise ValueError(f"prefill attention bound for {self.num_rows} rows, got q {tuple(q.shape)}, "
                             f"out {tuple(out.shape)}")
        ss = selection.stride()
        if self.num_rows and ss[1] != 1:
            raise ValueError(f"selection must have unit column stride, got {ss[1]}")
        qs, gs, bs, os = q.stride(), gate.stride(), block_table.stride(), out.stride()
        for launch, kind in self._launches:
            if kind == "union":
                launch(token_to_req, seq_lens, selection, block_table, ss[0], bs[0], bs[1])
            elif kind == "shared":
                launch(q, gate, out, qs[0], qs[1], gs[0], gs[1], os[0])
            else:
                launch(q, gate, block_table, token_to_req, seq_lens, selection, out, qs[0], qs[1], gs[0], gs[1],
                       os[0], bs[0], bs[1], ss[0], ss[1])
        return out


_union = Launcher(_union_kernel)
_shared = Launcher(_shared_kernel)
_per_row = Launcher(_per_row_kernel)
