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
from typing import Any

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, Launcher, pdl_end, pdl_start

_MAX_SPLITS = 64
# Programs per SM the decode split count aims at: on the H200 (benchmarks/sweep_decode_attention.py at 7bb3f93)
# 3 against 2 cut 128K B64 from 91.1 to 86.3 us and 1M B4 with 4 rows per request from 40.6 to 37.6
# (L2 flushed); 4 was slower at B64 (105 us); rows <= 4 stay at the 33-split cap either way.
_PROGRAMS_PER_SM = 3
# Rows above which the one-pass kernel already fills the GPU.
_SPLIT_MAX_ROWS = 128
_LOG2E = 1.4426950408889634
# Rows from which `plan_attention`, given the compress ratio and shared_prefill, runs the
# shared-tile prefill kernels (attention_prefill.py) instead of the one pass; planners do so unless
# QSA_SHARED_PREFILL=0. H200, 16K rows, attention alone (session 21): where neighbouring rows'
# selections overlap 0.90-0.98, 7.99 -> 7.21-5.45 ms at 16K and 9.27 -> 6.41 at 128K; within 1 % of
# the one pass on random selections (`attention_prefill.MAX_UNION_RATIO`, BENCHMARKS.md session 21).
_PREFILL_MIN_ROWS = 1024
# Longest request (tokens) for which the one pass takes its short-context launch shape (`_launch_config`).
_SHORT_CONTEXT = 32768


def shared_prefill_enabled() -> bool:
    """Whether planners made now plan the shared-tile prefill kernels: yes unless
    QSA_SHARED_PREFILL=0 (read once, when a `QSAPlanner` is made)."""
    return os.environ.get("QSA_SHARED_PREFILL", "1") != "0"


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
def _attend_block(
    q, m, l, acc, c0, hi, sel_row, bt_row, seq_len, kvh, k_ptr, v_ptr, qk_scale,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_btp, stride_sc,
    D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Online-softmax update with selection columns [c0, min(c0 + BLOCK_N, hi))."""
    d = tl.arange(0, DP)
    d_mask = d < D
    cols = c0 + tl.arange(0, BLOCK_N)
    idx = tl.load(sel_row + cols * stride_sc, mask=cols < hi, other=-1)
    valid = (idx >= 0) & (idx < seq_len)
    safe = tl.where(valid, idx, 0)
    page = tl.maximum(tl.load(bt_row + (safe // PAGE) * stride_btp, mask=valid, other=0), 0).to(tl.int64)
    off = (safe % PAGE).to(tl.int64)
    # K gathered as its transpose [DP, BLOCK_N], the dot's operand as loaded, not [BLOCK_N, DP] and
    # tl.trans (H200, session 19, 16K prefill rows at 16K, ms: 32 columns / 1 warp / 2 stages 12.2 ->
    # 8.0, 64 / 2 / 1 11.0 -> 10.6; decode splits ~1 us).
    k = tl.load(k_ptr + (page * stride_kp + off * stride_ks + kvh * stride_kh)[None, :] + d[:, None],
                mask=d_mask[:, None] & valid[None, :], other=0.0).to(DOT_DTYPE)
    s = tl.dot(q, k, input_precision="ieee") * qk_scale  # [GP, BLOCK_N], log2 units
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A head with nothing valid yet keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + (page * stride_vp + off * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _attend(
    q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr,
    row, kvh, split, n_splits, W, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btr, stride_btp, stride_st, stride_sc,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Online softmax of one row and KV head over the split's share of the selection.

    Returns m [GP] (running max, log2 units), l [GP] (sum of exp2), acc [GP, DP] fp32
    (unnormalised P @ V, before v_scale)."""
    req = tl.load(req_ptr + row)
    seq_len = tl.load(seq_ptr + req)
    sel_row = sel_ptr + row.to(tl.int64) * stride_st
    count = tl.minimum(tl.maximum(tl.load(sel_row + W * stride_sc), 0), W)
    per_split = tl.cdiv(tl.cdiv(count, BLOCK_N), n_splits) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(count, lo + per_split)

    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    q_off = row.to(tl.int64) * stride_qt + (kvh * G + g)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(g < G)[:, None] & (d < D)[None, :], other=0.0).to(DOT_DTYPE)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_btr
    if INTERPRET:  # the interpreter cannot range over tensor bounds
        c0 = lo
        while c0 < hi:
            m, l, acc = _attend_block(
                q, m, l, acc, c0, hi, sel_row, bt_row, seq_len, kvh, k_ptr, v_ptr, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_btp, stride_sc,
                D, DP, PAGE, BLOCK_N, DOT_DTYPE,
            )
            c0 += BLOCK_N
    else:
        for c0 in range(lo, hi, BLOCK_N):
            m, l, acc = _attend_block(
                q, m, l, acc, c0, hi, sel_row, bt_row, seq_len, kvh, k_ptr, v_ptr, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_btp, stride_sc,
                D, DP, PAGE, BLOCK_N, DOT_DTYPE,
            )
    return m, l, acc


@triton.jit
def _gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask):
    """out = dtype(o) * sigmoid(gate) multiplied in fp32; exact 0 where has_any is false
    (whatever the gate holds, NaN included)."""
    out_dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    gated = o.to(out_dtype).to(tl.float32) * tl.sigmoid(gate)
    tl.store(out_ptr + o_off, tl.where(has_any, gated, 0.0).to(out_dtype), mask=mask)


@triton.jit
def _normalized_store(acc, l, v_scale, gate_ptr, out_ptr, g_off, o_off, mask):
    """`_gated_store` of acc / l * v_scale for M heads: acc fp32 [M, DP], l fp32 [M] (their
    softmax sums; 0: nothing valid, stored as exact 0)."""
    has_any = (l > 0.0)[:, None]
    o = acc / tl.where(has_any, l[:, None], 1.0) * v_scale
    _gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask)


@triton.jit
def _store_row(acc, l, row, kvh, v_scale, gate_ptr, out_ptr, stride_gt, stride_gh, stride_ot,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """`_normalized_store` of one row's G query heads of KV head kvh (acc [GP, DP], l [GP])."""
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    heads = kvh * G + g
    mask = (g < G)[:, None] & (d < D)[None, :]
    g_off = row.to(tl.int64) * stride_gt + heads[:, None] * stride_gh + d[None, :]
    o_off = row.to(tl.int64) * stride_ot + heads[:, None] * D + d[None, :]
    _normalized_store(acc, l, v_scale, gate_ptr, out_ptr, g_off, o_off, mask)


@triton.jit(do_not_specialize=["n_splits", "W"])
def _attn_kernel(
    q_ptr, gate_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    n_splits, W, qk_scale, v_scale,
    stride_qt, stride_qh, stride_gt, stride_gh, stride_ot,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btr, stride_btp, stride_st, stride_sc,
    HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Grid (rows, KV heads, splits). SPLIT off: out [T, HQ*D] directly. SPLIT on: partials
    ml fp32 [T, HQ, n_splits, 2] (m, l) and acc fp32 [T, HQ, n_splits, D]."""
    pdl_start(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    m, l, acc = _attend(
        q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, row, kvh, split, n_splits, W, qk_scale,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_btr, stride_btp, stride_st, stride_sc,
        G, GP, D, DP, PAGE, BLOCK_N, DOT_DTYPE, INTERPRET,
    )
    if SPLIT:
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        heads = kvh * G + g
        slot = (row.to(tl.int64) * HQ + heads) * n_splits + split
        tl.store(part_ml_ptr + slot * 2, m, mask=g < G)
        tl.store(part_ml_ptr + slot * 2 + 1, l, mask=g < G)
        tl.store(part_acc_ptr + slot[:, None] * D + d[None, :], acc, mask=(g < G)[:, None] & (d < D)[None, :])
    else:
        _store_row(acc, l, row, kvh, v_scale, gate_ptr, out_ptr, stride_gt, stride_gh, stride_ot, G, GP, D, DP)
    pdl_end(PDL)


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(
    gate_ptr, out_ptr, part_ml_ptr, part_acc_ptr, n_splits, v_scale, stride_gt, stride_gh, stride_ot,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """Grid (rows, HQ): merge the splits' (m, l, acc) of one head, normalise, gate, store."""
    pdl_start(PDL)
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
    _gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask)
    pdl_end(PDL)


def _num_splits(rows: int, kv_heads: int, width: int, block_n: int, device: torch.device) -> int:
    """Splits of the selection per (row, KV head): enough programs for about _PROGRAMS_PER_SM
    per SM when rows are few; 1 (one pass) when rows alone fill the GPU. The count is balanced so
    that a full row leaves no split empty (W 2051 in 64-column blocks: 33 splits of one
    block, or 17 of two, never 32 with 15 empty). Host ints only."""
    if rows > _SPLIT_MAX_ROWS:
        return 1
    want = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), max(rows, 1) * kv_heads)
    blocks = triton.cdiv(width, block_n)
    n = max(1, min(_MAX_SPLITS, blocks, want))
    return triton.cdiv(blocks, triton.cdiv(blocks, n))


def _launch_config(dp: int, split: bool, context: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the attention kernel for head dim dp, split (decode,
    flash-decoding) or one pass, requests of at most `context` tokens (0: unknown).

    D 256 on the H200: decode splits hold 1-8 blocks, 64 columns / 2 warps / no pipelining (the
    first speed pass's sweep: 4 rows 10.4 vs 11.2 us for 8 warps / 2 stages); their shape does not
    depend on the context. The one pass (prefill), 16K rows, ms (session 19, main's 64 / 2 / 1 ->
    32 / 1 / 2 -> 64 / 2 / 2): at 16K context 11.02 -> 7.96 -> 8.61, 128K 12.45 -> 12.03 -> 11.80,
    1M 15.53 -> 15.70 -> 15.32; so 32 / 1 / 2 up to _SHORT_CONTEXT tokens. Decode batches of > 128
    rows (the one pass too), us: 8K B256 276.8 -> 325.8 -> 279.8, 32K B256 310.0 -> 330.5 -> 284.2,
    128K B160 217.0 -> 179.8 -> 232.7 (BENCHMARKS.md session 19)."""
    if _interpreting():
        return 32, 4, 1
    if dp < 256:
        return 64, 4, 3
    if split:
        return 64, 2, 1
    return (32, 1, 2) if 0 < context <= _SHORT_CONTEXT else (64, 2, 2)


def _split_block_n(dp: int) -> int:
    """Columns per block of the split (decode) kernel, which the split count is planned in."""
    return _launch_config(dp, True, 0)[0]


@dataclass(frozen=True)
class AttentionSchedule:
    """How one sparse-attention call runs, fixed when the step is planned.

    n_splits > 1: flash-decoding partials part_ml fp32 [T, Hq, n_splits, 2] and part_acc
    fp32 [T, Hq, n_splits, D] (views), merged by the combine kernel; else one pass.
    """

    num_rows: int
    n_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    interpret: bool
    part_ml: torch.Tensor | None
    part_acc: torch.Tensor | None
    prefill: Any = None  # an attention_prefill.PrefillSchedule: its kernels run instead


def partials_size(max_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, width: int,
                  device: torch.device | str) -> int:
    """Elements of part_acc any `plan_attention` with num_rows <= max_rows needs (part_ml:
    2 / head_dim of it)."""
    dev = torch.device(device)
    block_n = _split_block_n(triton.next_power_of_2(head_dim))
    most = 0
    for rows in range(1, min(max_rows, _SPLIT_MAX_ROWS) + 1):
        most = max(most, rows * _num_splits(rows, num_kv_heads, width, block_n, dev))
    return most * num_heads * head_dim


def plan_attention(
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    width: int,
    *,
    device: torch.device | str,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    compress_ratio: int | None = None,
    shared_prefill: bool = False,
    prefill_workspace: torch.Tensor | None = None,
    context: int = 0,
) -> AttentionSchedule:
    """Schedule of a sparse attention over num_rows rows of W = width selection columns.

    context: about the step's longest request in tokens (the planner's column bound x r; 0:
    unknown), which picks the one pass's launch shape (`_launch_config`).

    partials: flat fp32 (ml, acc) buffers of a workspace (`partials_size`), else allocated.
    shared_prefill with compress_ratio given and at least _PREFILL_MIN_ROWS rows: the
    shared-tile prefill kernels (`attention_prefill.plan_prefill_attention`, on prefill_workspace
    if given).
    """
    dev = torch.device(device)
    dp = triton.next_power_of_2(head_dim)
    n_splits = _num_splits(num_rows, num_kv_heads, width, _split_block_n(dp), dev)
    block_n, num_warps, num_stages = _launch_config(dp, n_splits > 1, context)
    part_ml = part_acc = None
    if n_splits > 1:
        n = num_rows * num_heads * n_splits
        if partials is None:
            partials = (torch.empty(n * 2, dtype=torch.float32, device=dev),
                        torch.empty(n * head_dim, dtype=torch.float32, device=dev))
        ml, acc = partials
        if ml.numel() < n * 2 or acc.numel() < n * head_dim:
            raise ValueError(f"attention partials hold {acc.numel()} < {n * head_dim} elements")
        part_ml = ml[: n * 2].view(num_rows, num_heads, n_splits, 2)
        part_acc = acc[: n * head_dim].view(num_rows, num_heads, n_splits, head_dim)
    prefill = None
    if shared_prefill and compress_ratio is not None and n_splits == 1 and num_rows >= _PREFILL_MIN_ROWS:
        from .attention_prefill import plan_prefill_attention

        prefill = plan_prefill_attention(num_rows, num_heads, num_kv_heads, head_dim, width, compress_ratio,
                                         device=dev, workspace=prefill_workspace, context=context)
    return AttentionSchedule(num_rows, n_splits, block_n, num_warps, num_stages, _interpreting(), part_ml, part_acc,
                             prefill)


_FREE = ("q_ptr", "gate_ptr", "bt_ptr", "req_ptr", "seq_ptr", "sel_ptr", "out_ptr", "stride_qt", "stride_qh",
         "stride_gt", "stride_gh", "stride_ot", "stride_btr", "stride_btp", "stride_st", "stride_sc")
_COMBINE_FREE = ("gate_ptr", "out_ptr", "stride_gt", "stride_gh", "stride_ot")


class AttentionLaunch:
    """The reference's `qsa_sparse_attention` as a launch bound once to a schedule, a layer's K/V cache and its scales
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
        self._prefill = None
        if T == 0:
            return
        if schedule.prefill is not None:
            from .attention_prefill import PrefillAttentionLaunch

            self._prefill = PrefillAttentionLaunch(
                q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection, softmax_scale=softmax_scale,
                k_scale=k_scale, v_scale=v_scale, out=out, schedule=schedule.prefill)
            return
        G = Hq // Hkv
        DP = triton.next_power_of_2(D)
        n_splits = schedule.n_splits
        split = n_splits > 1
        part_ml, part_acc = (schedule.part_ml, schedule.part_acc) if split else (out, out)
        common = dict(G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=DP, PAGE=page,
                      DOT_DTYPE=_dot_dtype(q, k_cache, schedule.interpret), INTERPRET=schedule.interpret)
        qk_scale = softmax_scale * k_scale * _LOG2E
        tensors = (q, gate, k_cache, v_cache, block_table, token_to_req, seq_lens, selection, out)
        strides = (q.stride(0), q.stride(1), gate.stride(0), gate.stride(1), out.stride(0),
                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                   block_table.stride(0), block_table.stride(1), selection.stride(0), selection.stride(1))
        self._launches.append((_per_row.bind(
            (T, Hkv, n_splits), *tensors, part_ml, part_acc, n_splits, W, qk_scale, v_scale, *strides,
            free=_FREE, HQ=Hq, BLOCK_N=schedule.block_n, SPLIT=split,
            num_warps=schedule.num_warps, num_stages=schedule.num_stages, **common,
        ), False))
        if split:
            self._launches.append((_combine.bind(
                (T, Hq), gate, out, part_ml, part_acc, n_splits, v_scale, gate.stride(0), gate.stride(1),
                out.stride(0), free=_COMBINE_FREE, HQ=Hq, D=D, DP=DP, SP=max(2, triton.next_power_of_2(n_splits)),
            ), True))

    def __call__(self, q: torch.Tensor, gate: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                 seq_lens: torch.Tensor, selection: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.num_rows or out.shape[0] != self.num_rows:
            raise ValueError(f"attention bound for {self.num_rows} rows, got q {tuple(q.shape)}, out {tuple(out.shape)}")
        if self._prefill is not None:
            return self._prefill(q, gate, block_table, token_to_req, seq_lens, selection, out)
        qs, gs, bs, ss, os = q.stride(), gate.stride(), block_table.stride(), selection.stride(), out.stride()
        for launch, combine in self._launches:
            if combine:
                launch(gate, out, gs[0], gs[1], os[0])
            else:
                launch(q, gate, block_table, token_to_req, seq_lens, selection, out, qs[0], qs[1], gs[0], gs[1], os[0],
                       bs[0], bs[1], ss[0], ss[1])
        return out


_per_row = Launcher(_attn_kernel)
_combine = Launcher(_combine_kernel)
