"""Triton sparse paged attention: GQA over each row's selected tokens, gated.

Contract: `qsa_core/reference/attention.py`. One program per (row, KV head[, split]) holds
the head group's queries as a [GP, D] tile (GP = group size padded to a power of two >= 16
for tl.dot) and runs an online softmax (fp32, exp2) over blocks of selection columns,
gathering K/V rows through the block table. Many rows: one pass (`_attn_kernel`, SPLIT off)
that also applies the gate. Few rows (decode): flash-decoding, each split writes (m, l, acc)
partials and `_combine_kernel` merges them and applies the gate. Entries < 0, >= the
request's seq_len or at columns >= the count column are ignored; rows with none left are 0.
`AttentionLaunch` binds the launches once per (schedule, layer cache) (`launch.py`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, Launcher

_MAX_SPLITS = 64
# Decode merges the splits in the attention kernel (one launch); its merger reads every
# split's partials, so fewer, longer splits than the two-launch path.
_FUSED = True
_FUSED_MAX_SPLITS = 16
_SPLIT_WAVES = 2
# Split loop software-pipelined (K and V requested together, the next blocks' lookups in flight).
_PIPELINE = True
# Rows above which the one-pass kernel already fills the GPU.
_SPLIT_MAX_ROWS = 128
_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dot_dtype(q: torch.Tensor, kv: torch.Tensor, interpret: bool) -> tl.dtype:
    """tl.dot operand dtype: q's 16-bit type when K/V convert to it exactly, else fp32 (ieee).
    The interpreter computes bf16 dots wrongly, so it always gets fp32."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if not interpret:
        if q.dtype == torch.bfloat16 and kv.dtype in (torch.bfloat16, *fp8):
            return tl.bfloat16
        if q.dtype == torch.float16 and kv.dtype in (torch.float16, *fp8):
            return tl.float16
    return tl.float32


@triton.jit
def _block_tokens(c0, hi, count, sel_row, stride_sc, BLOCK_N: tl.constexpr):
    """Entries of selection columns [c0, c0 + BLOCK_N): -1 at columns >= hi or >= count and
    at entries < 0 (entries >= seq_len are dropped later: the page lookup need not wait for
    seq_len)."""
    cols = c0 + tl.arange(0, BLOCK_N)
    idx = tl.load(sel_row + cols * stride_sc, mask=cols < hi, other=-1)
    return tl.where((idx >= 0) & (cols < count), idx, -1)


@triton.jit
def _block_rows(tok, bt_row, bt_cols, stride_btp, stride_kp, stride_ks, stride_vp, stride_vs, PAGE: tl.constexpr):
    """K and V row offsets (int64) of entries through the block table (0 where tok is -1 or
    past the table's bt_cols columns)."""
    blk = tok // PAGE
    live = (tok >= 0) & (blk < bt_cols)
    page = tl.maximum(tl.load(bt_row + tl.where(live, blk, 0) * stride_btp, mask=live, other=0), 0).to(tl.int64)
    off = (tl.maximum(tok, 0) % PAGE).to(tl.int64)
    return page * stride_kp + off * stride_ks, page * stride_vp + off * stride_vs


@triton.jit
def _attend_rows(
    q, m, l, acc, tok, seq_len, k_row, v_row, kvh, k_ptr, v_ptr, qk_scale, stride_kh, stride_vh,
    D: tl.constexpr, DP: tl.constexpr, DOT_DTYPE: tl.constexpr, EARLY_V: tl.constexpr,
):
    """Online-softmax update with one block's entries (valid: 0 <= tok < seq_len). EARLY_V: V is requested with
    K, before the first dot (one memory round trip per block, more registers); else after it."""
    d = tl.arange(0, DP)
    valid = (tok >= 0) & (tok < seq_len)
    kv_mask = valid[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + (k_row + kvh * stride_kh)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if EARLY_V:
        v = tl.load(v_ptr + (v_row + kvh * stride_vh)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale  # [GP, BLOCK_N], log2 units
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A head with nothing valid yet keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l = l * alpha + tl.sum(p, 1)
    if not EARLY_V:
        v = tl.load(v_ptr + (v_row + kvh * stride_vh)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _attend(
    q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr,
    row, kvh, split, n_splits, W, bt_cols, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btr, stride_btp, stride_st, stride_sc,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr, PIPELINE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Online softmax of one row and KV head over the split's share of the selection.

    SPLIT (decode): the share is of W, not of the count, so the first selection load need
    not wait for the count; the loop is software-pipelined: while a block's K/V are read, the
    next block's page lookups and the one after's selection columns are in flight.
    Returns m [GP] (running max, log2 units), l [GP] (sum of exp2), acc [GP, DP] fp32
    (unnormalised P @ V, before v_scale)."""
    req = tl.load(req_ptr + row)
    seq_len = tl.load(seq_ptr + req)
    sel_row = sel_ptr + row.to(tl.int64) * stride_st
    count = tl.minimum(tl.maximum(tl.load(sel_row + W * stride_sc), 0), W)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    q_off = row.to(tl.int64) * stride_qt + (kvh * G + g)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(g < G)[:, None] & (d < D)[None, :], other=0.0).to(DOT_DTYPE)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_btr
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(W, BLOCK_N), n_splits) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(W, lo + per_split)
    else:
        lo = 0
        hi = count
    if SPLIT and PIPELINE:
        c0 = lo
        tok = _block_tokens(c0, hi, count, sel_row, stride_sc, BLOCK_N)
        k_row, v_row = _block_rows(tok, bt_row, bt_cols, stride_btp, stride_kp, stride_ks, stride_vp, stride_vs, PAGE)
        tok_next = _block_tokens(c0 + BLOCK_N, hi, count, sel_row, stride_sc, BLOCK_N)
        while c0 < hi:
            k_next, v_next = _block_rows(tok_next, bt_row, bt_cols, stride_btp, stride_kp, stride_ks, stride_vp,
                                         stride_vs, PAGE)
            tok_after = _block_tokens(c0 + 2 * BLOCK_N, hi, count, sel_row, stride_sc, BLOCK_N)
            m, l, acc = _attend_rows(q, m, l, acc, tok, seq_len, k_row, v_row, kvh, k_ptr, v_ptr, qk_scale,
                                     stride_kh, stride_vh, D, DP, DOT_DTYPE, True)
            tok, k_row, v_row, tok_next = tok_next, k_next, v_next, tok_after
            c0 += BLOCK_N
    elif INTERPRET:  # the interpreter cannot range over tensor bounds
        c0 = lo
        while c0 < hi:
            tok = _block_tokens(c0, hi, count, sel_row, stride_sc, BLOCK_N)
            k_row, v_row = _block_rows(tok, bt_row, bt_cols, stride_btp, stride_kp, stride_ks, stride_vp, stride_vs, PAGE)
            m, l, acc = _attend_rows(q, m, l, acc, tok, seq_len, k_row, v_row, kvh, k_ptr, v_ptr, qk_scale,
                                     stride_kh, stride_vh, D, DP, DOT_DTYPE, False)
            c0 += BLOCK_N
    else:
        for c0 in range(lo, hi, BLOCK_N):
            tok = _block_tokens(c0, hi, count, sel_row, stride_sc, BLOCK_N)
            k_row, v_row = _block_rows(tok, bt_row, bt_cols, stride_btp, stride_kp, stride_ks, stride_vp, stride_vs, PAGE)
            m, l, acc = _attend_rows(q, m, l, acc, tok, seq_len, k_row, v_row, kvh, k_ptr, v_ptr, qk_scale,
                                     stride_kh, stride_vh, D, DP, DOT_DTYPE, False)
    return m, l, acc


@triton.jit
def _gated_store(o, has_any, gate, out_ptr, o_off, mask):
    """out = dtype(o) * sigmoid(gate) multiplied in fp32; exact 0 where has_any is false
    (whatever the gate holds, NaN included)."""
    out_dtype = out_ptr.dtype.element_ty
    gated = o.to(out_dtype).to(tl.float32) * tl.sigmoid(gate.to(tl.float32))
    tl.store(out_ptr + o_off, tl.where(has_any, gated, 0.0).to(out_dtype), mask=mask)


@triton.jit
def _load_partial(part_ml_ptr, part_acc_ptr, pair, s, n_splits, g, d, G: tl.constexpr, D: tl.constexpr):
    """Split s's (m, l, acc) of a (row, KV head) pair from the fused layout [pair, split, G, (2 | D)];
    an empty split (m -inf, l 0, acc 0) beyond n_splits. L2 reads (.cg): written by other programs."""
    live = (g < G) & (tl.zeros_like(g) + s < n_splits)
    slot = (pair.to(tl.int64) * n_splits + s) * G + g
    m = tl.load(part_ml_ptr + slot * 2, mask=live, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
    x = tl.load(part_acc_ptr + slot[:, None] * D + d[None, :], mask=live[:, None] & (d < D)[None, :],
                other=0.0, cache_modifier=".cg")
    return m, l, x


@triton.jit
def _merge(m, l, acc, m_s, l_s, x_s):
    """Fold one split's partial into the running (m, l, acc): the online-softmax rescale."""
    m_new = tl.maximum(m, m_s)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(m - m_shift)
    b = tl.math.exp2(m_s - m_shift)
    return m_new, l * a + l_s * b, acc * a[:, None] + x_s * b[:, None]


@triton.jit(do_not_specialize=["n_splits", "W", "bt_cols"])
def _attn_kernel(
    q_ptr, gate_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, out_ptr, part_ml_ptr, part_acc_ptr, cnt_ptr,
    n_splits, W, bt_cols, qk_scale, v_scale,
    stride_qt, stride_qh, stride_gt, stride_gh, stride_ot,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btr, stride_btp, stride_st, stride_sc,
    HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
    FUSED: tl.constexpr, PIPELINE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (rows, KV heads, splits). SPLIT off: out [T, HQ*D] directly. SPLIT on: partials
    ml fp32 (m, l) and acc fp32 (D); FUSED off: [T, HQ, n_splits, 2 | D], merged by
    `_combine_kernel`; FUSED on: [T * Hkv, n_splits, G, 2 | D], and the last split of a
    (row, KV head) to arrive (cnt_ptr int32 [T * Hkv], an arrival counter it resets to 0)
    merges them in split order and stores the gated output: one launch, the same bits
    whatever the arrival order."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    heads = kvh * G + g
    mask = (g < G)[:, None] & (d < D)[None, :]
    g_off = row.to(tl.int64) * stride_gt + heads[:, None] * stride_gh + d[None, :]
    o_off = row.to(tl.int64) * stride_ot + heads[:, None] * D + d[None, :]
    m, l, acc = _attend(
        q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, row, kvh, split, n_splits, W, bt_cols, qk_scale,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_btr, stride_btp, stride_st, stride_sc,
        G, GP, D, DP, PAGE, BLOCK_N, DOT_DTYPE, SPLIT, PIPELINE, INTERPRET,
    )
    if FUSED:
        pair = row * tl.num_programs(1) + kvh
        slot = (pair.to(tl.int64) * n_splits + split) * G + g
        tl.store(part_ml_ptr + slot * 2, m, mask=g < G)
        tl.store(part_ml_ptr + slot * 2 + 1, l, mask=g < G)
        tl.store(part_acc_ptr + slot[:, None] * D + d[None, :], acc, mask=mask)
        # Every program requests its heads' gate (one DRAM read per pair, L2 hits after): the
        # merger then does not wait for it after the arrival count.
        gate = tl.load(gate_ptr + g_off, mask=mask, other=0.0)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        ticket = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if ticket == n_splits - 1:
            mu = tl.full((GP,), float("-inf"), tl.float32)
            lu = tl.zeros((GP,), tl.float32)
            au = tl.zeros((GP, DP), tl.float32)
            s0 = 0
            while s0 < n_splits:  # four splits' loads in flight, folded in split order
                m0, l0, x0 = _load_partial(part_ml_ptr, part_acc_ptr, pair, s0, n_splits, g, d, G, D)
                m1, l1, x1 = _load_partial(part_ml_ptr, part_acc_ptr, pair, s0 + 1, n_splits, g, d, G, D)
                m2, l2, x2 = _load_partial(part_ml_ptr, part_acc_ptr, pair, s0 + 2, n_splits, g, d, G, D)
                m3, l3, x3 = _load_partial(part_ml_ptr, part_acc_ptr, pair, s0 + 3, n_splits, g, d, G, D)
                mu, lu, au = _merge(mu, lu, au, m0, l0, x0)
                mu, lu, au = _merge(mu, lu, au, m1, l1, x1)
                mu, lu, au = _merge(mu, lu, au, m2, l2, x2)
                mu, lu, au = _merge(mu, lu, au, m3, l3, x3)
                s0 += 4
            has_any = (lu > 0.0)[:, None]
            o = au / tl.where(has_any, lu[:, None], 1.0) * v_scale
            _gated_store(o, has_any, gate, out_ptr, o_off, mask)
            tl.atomic_xchg(cnt_ptr + pair, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    elif SPLIT:
        slot = (row.to(tl.int64) * HQ + heads) * n_splits + split
        tl.store(part_ml_ptr + slot * 2, m, mask=g < G)
        tl.store(part_ml_ptr + slot * 2 + 1, l, mask=g < G)
        tl.store(part_acc_ptr + slot[:, None] * D + d[None, :], acc, mask=mask)
    else:
        has_any = (l > 0.0)[:, None]
        o = acc / tl.where(has_any, l[:, None], 1.0) * v_scale
        gate = tl.load(gate_ptr + g_off, mask=mask, other=0.0)
        _gated_store(o, has_any, gate, out_ptr, o_off, mask)


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(
    gate_ptr, out_ptr, part_ml_ptr, part_acc_ptr, n_splits, v_scale, stride_gt, stride_gh, stride_ot,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
):
    """Grid (rows, HQ): merge the splits' (m, l, acc) of one head, normalise, gate, store."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SP)
    d = tl.arange(0, DP)
    slot = (row.to(tl.int64) * HQ + head) * n_splits + sp
    m = tl.load(part_ml_ptr + slot * 2, mask=sp < n_splits, other=float("-inf"))
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=sp < n_splits, other=0.0)
    acc = tl.load(part_acc_ptr + slot[:, None] * D + d[None, :], mask=(sp < n_splits)[:, None] & (d < D)[None, :],
                  other=0.0)
    m_all = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # empty splits: weight 0
    l_all = tl.sum(w * l, 0)
    has_any = l_all > 0.0
    o = tl.sum(w[:, None] * acc, 0) / tl.where(has_any, l_all, 1.0) * v_scale
    mask = d < D
    g_off = row.to(tl.int64) * stride_gt + head * stride_gh + d
    o_off = row.to(tl.int64) * stride_ot + head * D + d
    gate = tl.load(gate_ptr + g_off, mask=mask, other=0.0)
    _gated_store(o, has_any, gate, out_ptr, o_off, mask)


def _num_splits(rows: int, kv_heads: int, width: int, block_n: int, device: torch.device,
                max_splits: int = _MAX_SPLITS) -> int:
    """Splits of the selection per (row, KV head): enough programs for about _SPLIT_WAVES
    programs per SM when rows are few, at most max_splits; 1 (one pass) when rows alone fill
    the GPU. The count is balanced so that a full row leaves no split empty (W 2051 in
    64-column blocks: 33 splits of one block, or 17 of two, never 32 with 15 empty). Host ints."""
    if rows > _SPLIT_MAX_ROWS:
        return 1
    want = triton.cdiv(_SPLIT_WAVES * _num_sms(device), max(rows, 1) * kv_heads)
    blocks = triton.cdiv(width, block_n)
    n = max(1, min(max_splits, blocks, want))
    return triton.cdiv(blocks, triton.cdiv(blocks, n))


def _launch_config(dp: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the one-pass kernel (many rows); K and V stages share memory.

    D 256 on the H200 (benchmarks/sweep_attention.py, 18 configs): 2 warps, no pipelining
    was fastest for prefill (16K rows at 128K: 12.4 vs 16.4 ms for 8 warps / 2 stages)."""
    if _interpreting():
        return 32, 4, 1
    return (64, 2, 1) if dp >= 256 else (64, 4, 3)


def _decode_config(dp: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split (decode) kernel."""
    if _interpreting():
        return 32, 4, 1
    return (32, 4, 1) if dp >= 256 else (64, 4, 1)


def _split_plan(rows: int, kv_heads: int, head_dim: int, width: int, device: torch.device
                ) -> tuple[int, bool, tuple[int, int, int]]:
    """(n_splits, fused, (BLOCK_N, num_warps, num_stages)) of rows rows."""
    dp = triton.next_power_of_2(head_dim)
    if rows > _SPLIT_MAX_ROWS:
        return 1, False, _launch_config(dp)
    config = _decode_config(dp)
    n = _num_splits(rows, kv_heads, width, config[0], device, _FUSED_MAX_SPLITS if _FUSED else _MAX_SPLITS)
    if n == 1:
        return 1, False, _launch_config(dp)
    return n, _FUSED, config


@dataclass(frozen=True)
class AttentionSchedule:
    """How one sparse-attention call runs, fixed when the step is planned.

    n_splits > 1: flash-decoding partials part_ml fp32 (m, l) and part_acc fp32 (D) (flat
    views); fused: [T * Hkv, n_splits, G, 2 | D] merged by the last split of each (row, KV
    head) to arrive, counted in counters int32 [T * Hkv] (zero between launches); else
    [T, Hq, n_splits, 2 | D] merged by the combine kernel. n_splits 1: one pass.
    """

    num_rows: int
    n_splits: int
    fused: bool
    block_n: int
    num_warps: int
    num_stages: int
    pipeline: bool
    interpret: bool
    part_ml: torch.Tensor | None
    part_acc: torch.Tensor | None
    counters: torch.Tensor | None


def partials_size(max_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, width: int,
                  device: torch.device | str) -> int:
    """Elements of part_acc any `plan_attention` with num_rows <= max_rows needs (part_ml:
    2 / head_dim of it)."""
    dev = torch.device(device)
    most = 0
    for rows in range(1, min(max_rows, _SPLIT_MAX_ROWS) + 1):
        most = max(most, rows * _split_plan(rows, num_kv_heads, head_dim, width, dev)[0])
    return most * num_heads * head_dim


def partials_workspace(max_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, width: int,
                       device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split partials of any `plan_attention` with num_rows <= max_rows: (ml fp32, acc fp32,
    counters int32 zeros [min(max_rows, 128) * Hkv]); the fused kernel leaves counters at 0."""
    acc = partials_size(max_rows, num_heads, num_kv_heads, head_dim, width, device)
    return (torch.empty(acc * 2 // head_dim, dtype=torch.float32, device=device),
            torch.empty(acc, dtype=torch.float32, device=device),
            torch.zeros(min(max_rows, _SPLIT_MAX_ROWS) * num_kv_heads, dtype=torch.int32, device=device))


def plan_attention(
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    width: int,
    *,
    device: torch.device | str,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> AttentionSchedule:
    """Schedule of a sparse attention over num_rows rows of W = width selection columns.

    partials: a workspace's (ml, acc, counters) (`partials_workspace`), else allocated.
    """
    dev = torch.device(device)
    n_splits, fused, (block_n, num_warps, num_stages) = _split_plan(num_rows, num_kv_heads, head_dim, width, dev)
    part_ml = part_acc = counters = None
    if n_splits > 1:
        n = num_rows * num_heads * n_splits
        if partials is None:
            partials = partials_workspace(num_rows, num_heads, num_kv_heads, head_dim, width, dev)
        ml, acc, cnt = partials
        if ml.numel() < n * 2 or acc.numel() < n * head_dim or cnt.numel() < num_rows * num_kv_heads:
            raise ValueError(f"attention partials hold {acc.numel()} < {n * head_dim} elements "
                             f"or counters {cnt.numel()} < {num_rows * num_kv_heads}")
        part_ml, part_acc = ml[: n * 2], acc[: n * head_dim]
        counters = cnt[: num_rows * num_kv_heads] if fused else None
    return AttentionSchedule(num_rows, n_splits, fused, block_n, num_warps, num_stages, _PIPELINE and n_splits > 1,
                             _interpreting(),
                             part_ml, part_acc, counters)


_FREE = ("q_ptr", "gate_ptr", "bt_ptr", "req_ptr", "seq_ptr", "sel_ptr", "out_ptr", "bt_cols", "stride_qt", "stride_qh",
         "stride_gt", "stride_gh", "stride_ot", "stride_btr", "stride_btp", "stride_st", "stride_sc")
_COMBINE_FREE = ("gate_ptr", "out_ptr", "stride_gt", "stride_gh", "stride_ot")


class AttentionLaunch:
    """`qsa_sparse_attention` bound once to a schedule, a layer's K/V cache and its scales
    (`qsa_kernels.launch`); `__call__(q, gate, block_table, token_to_req, seq_lens, selection,
    out)` relaunches with those tensors only (same shapes, any strides as in the op)."""

    def __init__(self, q: torch.Tensor, gate: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, token_to_req: torch.Tensor, seq_lens: torch.Tensor,
                 selection: torch.Tensor, *, softmax_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                 out: torch.Tensor, schedule: AttentionSchedule) -> None:
        T, Hq, D = q.shape
        _, page, Hkv, _ = k_cache.shape
        W = selection.shape[1] - 1
        if T != schedule.num_rows:
            raise ValueError(f"the attention schedule was planned for {schedule.num_rows} rows, got {T}")
        self.num_rows = T
        self._launches: list[tuple[BoundLaunch, bool]] = []  # (launch, combine: fewer free args)
        if T == 0:
            return
        G = Hq // Hkv
        DP = triton.next_power_of_2(D)
        n_splits = schedule.n_splits
        split = n_splits > 1
        part_ml, part_acc = (schedule.part_ml, schedule.part_acc) if split else (out, out)
        counters = schedule.counters if schedule.fused else out  # unused unless fused
        if schedule.fused and counters.numel() < T * Hkv:
            raise ValueError(f"the attention schedule has {counters.numel()} counters for {T} rows x {Hkv} KV heads")
        common = dict(G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=DP, PAGE=page,
                      DOT_DTYPE=_dot_dtype(q, k_cache, schedule.interpret), INTERPRET=schedule.interpret)
        qk_scale = softmax_scale * k_scale * _LOG2E
        tensors = (q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection, out)
        strides = (q.stride(0), q.stride(1), gate.stride(0), gate.stride(1), out.stride(0),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                   block_table.stride(0), block_table.stride(1), selection.stride(0), selection.stride(1))
        self._launches.append((_per_row.bind(
            (T, Hkv, n_splits), *tensors, part_ml, part_acc, counters, n_splits, W, block_table.shape[1], qk_scale, v_scale, *strides,
            free=_FREE, HQ=Hq, BLOCK_N=schedule.block_n, SPLIT=split, FUSED=schedule.fused,
            PIPELINE=schedule.pipeline,
            num_warps=schedule.num_warps, num_stages=schedule.num_stages, **common,
        ), False))
        if split and not schedule.fused:
            self._launches.append((_combine.bind(
                (T, Hq), gate, out, part_ml, part_acc, n_splits, v_scale, gate.stride(0), gate.stride(1),
                out.stride(0), free=_COMBINE_FREE, HQ=Hq, D=D, DP=DP, SP=max(2, triton.next_power_of_2(n_splits)),
            ), True))

    def __call__(self, q: torch.Tensor, gate: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                 seq_lens: torch.Tensor, selection: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.num_rows or out.shape[0] != self.num_rows:
            raise ValueError(f"attention bound for {self.num_rows} rows, got q {tuple(q.shape)}, out {tuple(out.shape)}")
        for launch, combine in self._launches:
            if combine:
                launch(gate, out, gate.stride(0), gate.stride(1), out.stride(0))
            else:
                launch(q, gate, block_table, token_to_req, seq_lens, selection, out, block_table.shape[1],
                       q.stride(0), q.stride(1),
                       gate.stride(0), gate.stride(1), out.stride(0), block_table.stride(0), block_table.stride(1),
                       selection.stride(0), selection.stride(1))
        return out


def qsa_sparse_attention(
    q: torch.Tensor,
    gate: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    selection: torch.Tensor,
    *,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor,
    schedule: AttentionSchedule,
) -> torch.Tensor:
    """out [T, Hq*D] (q.dtype) = dtype(softmax(q.k * scale) v) * sigmoid(gate), fp32 math.

    q, gate [T, Hq, D] (last dim contiguous); k_cache, v_cache [pages, page_size, Hkv, D]
    (any strides, contiguous last dim; bf16 or fp8 with per-tensor k_scale / v_scale);
    selection int32 [T, W + 1] with the count in the last column; out [T, Hq*D] contiguous
    rows (any row stride). schedule: `plan_attention(T, Hq, Hkv, D, W, ...)`. Binds on every
    call: a plan keeps an `AttentionLaunch` per layer cache instead.
    """
    if q.shape[0] == 0:
        return out
    launch = AttentionLaunch(q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection,
                             softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale, out=out, schedule=schedule)
    return launch(q, gate, block_table, token_to_req, seq_lens, selection, out)


_per_row = Launcher(_attn_kernel)
_combine = Launcher(_combine_kernel)
