"""Shared pieces of the attention kernels (`attention.py`, `attention_prefill.py`): the online
softmax over gathered K/V rows, the gated stores, the tl.dot operand dtype and the one-pass
kernel's launch shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Longest request (tokens) for which the one pass takes its short-context launch shape (`launch_config`).
SHORT_CONTEXT = 32768


def dot_dtype(q: torch.Tensor, kv: torch.Tensor, interpret: bool) -> tl.dtype:
    """tl.dot operand dtype: q's 16-bit type when K/V convert to it exactly, else fp32 (ieee).
    The interpreter (interpret: `KernelOptions.interpreter`) computes bf16 dots wrongly, so it
    always gets fp32."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if not interpret:
        if q.dtype == torch.bfloat16 and kv.dtype in (torch.bfloat16, *fp8):
            return tl.bfloat16
        if q.dtype == torch.float16 and kv.dtype in (torch.float16, *fp8):
            return tl.float16
    return tl.float32



@triton.jit
def tile_scores(q, page, off, load, kvh, k_ptr, qk_scale, stride_kp, stride_ks, stride_kh,
                D: tl.constexpr, DP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Scores fp32 [M, N] (log2 units) of the query tile q [M, DP] against N gathered keys of KV
    head kvh at page / off int64 [N], loaded where `load` [N] (0 elsewhere)."""
    d = tl.arange(0, DP)
    # K gathered as its transpose [DP, N], the dot's operand as loaded, not [N, DP] and
    # tl.trans, which made the prefill one pass slower (H200, NOTES.md (Kernels)).
    k = tl.load(k_ptr + (page * stride_kp + off * stride_ks + kvh * stride_kh)[None, :] + d[:, None],
                mask=(d < D)[:, None] & load[None, :], other=0.0).to(DOT_DTYPE)
    return tl.dot(q, k, input_precision="ieee") * qk_scale


@triton.jit
def online_update(s, keep, m, l, acc, page, off, load, kvh, v_ptr, stride_vp, stride_vs, stride_vh,
                  D: tl.constexpr, DP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Online-softmax update of (running max m, sum l fp32 [M], acc fp32 [M, DP]) with the
    scores s [M, N] of `tile_scores` where `keep` ([M, N], or [1, N] for every row) and the N
    values at page / off, loaded where `load` [N]."""
    d = tl.arange(0, DP)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # A head with nothing valid yet keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + (page * stride_vp + off * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
                mask=load[:, None] & (d < D)[None, :], other=0.0).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def attend_block(
    q, m, l, acc, c0, hi, sel_row, bt_row, seq_len, kvh, k_ptr, v_ptr, qk_scale,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_btp, stride_sc,
    D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Online-softmax update with selection columns [c0, min(c0 + BLOCK_N, hi))."""
    cols = c0 + tl.arange(0, BLOCK_N)
    idx = tl.load(sel_row + cols * stride_sc, mask=cols < hi, other=-1)
    valid = (idx >= 0) & (idx < seq_len)
    safe = tl.where(valid, idx, 0)
    page = tl.maximum(tl.load(bt_row + (safe // PAGE) * stride_btp, mask=valid, other=0), 0).to(tl.int64)
    off = (safe % PAGE).to(tl.int64)
    s = tile_scores(q, page, off, valid, kvh, k_ptr, qk_scale, stride_kp, stride_ks, stride_kh, D, DP, DOT_DTYPE)
    return online_update(s, valid[None, :], m, l, acc, page, off, valid, kvh, v_ptr, stride_vp, stride_vs, stride_vh,
                         D, DP, DOT_DTYPE)


@triton.jit
def attend(
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
            m, l, acc = attend_block(
                q, m, l, acc, c0, hi, sel_row, bt_row, seq_len, kvh, k_ptr, v_ptr, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_btp, stride_sc,
                D, DP, PAGE, BLOCK_N, DOT_DTYPE,
            )
            c0 += BLOCK_N
    else:
        for c0 in range(lo, hi, BLOCK_N):
            m, l, acc = attend_block(
                q, m, l, acc, c0, hi, sel_row, bt_row, seq_len, kvh, k_ptr, v_ptr, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_btp, stride_sc,
                D, DP, PAGE, BLOCK_N, DOT_DTYPE,
            )
    return m, l, acc


@triton.jit
def gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask):
    """out = dtype(o) * sigmoid(gate) multiplied in fp32; exact 0 where has_any is false
    (whatever the gate holds, NaN included)."""
    out_dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    gated = o.to(out_dtype).to(tl.float32) * tl.sigmoid(gate)
    tl.store(out_ptr + o_off, tl.where(has_any, gated, 0.0).to(out_dtype), mask=mask)


@triton.jit
def normalized_store(acc, l, v_scale, gate_ptr, out_ptr, g_off, o_off, mask):
    """`gated_store` of acc / l * v_scale for M heads: acc fp32 [M, DP], l fp32 [M] (their
    softmax sums; 0: nothing valid, stored as exact 0)."""
    has_any = (l > 0.0)[:, None]
    o = acc / tl.where(has_any, l[:, None], 1.0) * v_scale
    gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask)


@triton.jit
def store_row(acc, l, row, kvh, v_scale, gate_ptr, out_ptr, stride_gt, stride_gh, stride_ot,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """`normalized_store` of one row's G query heads of KV head kvh (acc [GP, DP], l [GP])."""
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    heads = kvh * G + g
    mask = (g < G)[:, None] & (d < D)[None, :]
    g_off = row.to(tl.int64) * stride_gt + heads[:, None] * stride_gh + d[None, :]
    o_off = row.to(tl.int64) * stride_ot + heads[:, None] * D + d[None, :]
    normalized_store(acc, l, v_scale, gate_ptr, out_ptr, g_off, o_off, mask)



def launch_config(dp: int, split: bool, context: int, small_tiles: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the attention kernel for head dim dp, split (decode,
    flash-decoding) or one pass, requests of at most `context` tokens (0: unknown); small_tiles:
    `KernelOptions.small_tiles`.

    D 256 (the H200 sweeps are in NOTES.md (Kernels)): decode splits hold 1-8 blocks, so 64
    columns / 2 warps / no pipelining, whatever the context. The one pass (prefill, and decode
    batches of > 128 rows): 32 / 1 / 2 up to SHORT_CONTEXT tokens, where the 16K-row prefill runs
    fastest with it, 64 / 2 / 2 beyond. Measure: `python benchmarks/bench_qsa.py --only
    prefill-16384-1-16384-bf16 prefill-131072-1-16384-bf16 decode-131072-4-1-bf16 --out DIR`."""
    if small_tiles:
        return 32, 4, 1
    if dp < 256:
        return 64, 4, 3
    if split:
        return 64, 2, 1
    return (32, 1, 2) if 0 < context <= SHORT_CONTEXT else (64, 2, 2)

