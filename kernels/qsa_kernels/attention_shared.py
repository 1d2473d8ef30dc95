"""Triton prefill sparse attention that shares gathered K/V tiles across a block of rows.

One program per (block of BM consecutive rows, KV head). The block's rows x the head group's
queries form the MMA's M (row = m // G, head = m % G, M padded to a power of two). The program
walks the sorted union of the rows' selections: each step takes the next CAND entries of every
row (a cursor per row), sorts them, drops repeats and keeps the BN smallest distinct tokens
as one K/V tile. Each K/V tile is gathered once and multiplied against all rows; a row's
logits are masked to its own membership (the tile token equals one of its entries), so every
row attends exactly to its own selection. Every entry a row has <= the tile's last token is
consumed, so each entry is counted exactly once.

Fast path preconditions, checked per block on the device: all rows belong to one request and
every row's entries within its count are valid (0 <= idx < seq_len) and strictly ascending
(what `qsa_expand` produces). Other blocks (request boundaries, holes, duplicates, unsorted
rows) attend row by row with the per-row kernel body: results are the same either way.

A non-finite V row of the shared tile would reach every row through the shared P @ V
(0 * NaN = NaN): it is zeroed in the tile and the rows that do select it are set to NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import _attend, _gated_store

_SENT = tl.constexpr(2147483647)  # int32 max: an empty candidate / tile slot, sorts last


@triton.jit
def _sort(x, N: tl.constexpr, INTERPRET: tl.constexpr):
    """x [N] int32 ascending. The interpreter runs tl.sort's bitonic network op by op (about
    7 s per sort of 256 on a CI core), so it ranks by an [N, N] comparison instead."""
    if INTERPRET:
        k = tl.arange(0, N)
        before = (x[None, :] < x[:, None]) | ((x[None, :] == x[:, None]) & (k[None, :] < k[:, None]))
        rank = tl.sum(before.to(tl.int32), 1)  # final position of x[k]
        return tl.sum(tl.where(rank[None, :] == k[:, None], x[None, :], 0), 1)
    else:
        return tl.sort(x)


@triton.jit
def _block_shareable(sel_ptr, rows, rvalid, cnt, seq_len, W, stride_st, stride_sc,
                     BM_P: tl.constexpr, CHK: tl.constexpr):
    """True when every row's first cnt entries are valid and strictly ascending."""
    ok = tl.full((BM_P,), 1, tl.int1)
    j = tl.arange(0, CHK)
    base = sel_ptr + rows.to(tl.int64)[:, None] * stride_st
    most = tl.max(cnt, 0)
    c0 = 0
    while c0 < most:
        cols = c0 + j[None, :]
        m = rvalid[:, None] & (cols < cnt[:, None])
        e = tl.load(base + cols * stride_sc, mask=m, other=0)
        prev = tl.load(base + (cols - 1) * stride_sc, mask=m & (cols > 0), other=-1)
        good = (e >= 0) & (e < seq_len) & (e > prev)
        ok = ok & (tl.sum((m & ~good).to(tl.int32), 1) == 0)
        c0 += CHK
    return tl.sum((~ok).to(tl.int32), 0) == 0


@triton.jit
def _union_estimate(sel_ptr, rows, rvalid, cnt, stride_st, stride_sc,
                    BM: tl.constexpr, BM_P: tl.constexpr, SAMPLES: tl.constexpr, LOG_W: tl.constexpr):
    """Estimated size of the union of the block's (sorted) selections: the sum over rows of
    count x the fraction of SAMPLES evenly spaced entries that no earlier row holds (binary
    searches); exact for identical or disjoint rows."""
    j = tl.arange(0, SAMPLES)
    i = tl.arange(0, BM_P)
    cols = (j[None, :] * cnt[:, None]) // SAMPLES  # [BM_P, SAMPLES], < cnt where cnt > 0
    has = rvalid[:, None] & (cnt[:, None] > 0)
    x = tl.load(sel_ptr + rows.to(tl.int64)[:, None] * stride_st + cols * stride_sc, mask=has, other=0)
    seen = tl.zeros((BM_P, SAMPLES), tl.int1)
    for back in range(1, BM):
        other = sel_ptr + (rows - back).to(tl.int64)[:, None] * stride_st
        n_other = tl.sum(tl.where(i[None, :] == i[:, None] - back, cnt[None, :], 0), 1)  # cnt of row i - back
        look = has & (i[:, None] >= back)
        lo = tl.zeros((BM_P, SAMPLES), tl.int32)
        hi = tl.where(look, n_other[:, None], 0)
        for _ in tl.static_range(LOG_W):
            mid = (lo + hi) // 2
            v = tl.load(other + mid * stride_sc, mask=mid < hi, other=0)
            right = v < x
            lo = tl.where((mid < hi) & right, mid + 1, lo)
            hi = tl.where((mid < hi) & ~right, mid, hi)
        hit = tl.load(other + lo * stride_sc, mask=look & (lo < n_other[:, None]), other=-1) == x
        seen = seen | (look & hit)
    new = tl.sum((has & ~seen).to(tl.float32), 1) / SAMPLES
    return tl.sum(new * cnt.to(tl.float32), 0)


@triton.jit(do_not_specialize=["row_base", "num_rows", "W"])
def _shared_kernel(
    q_ptr, gate_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, out_ptr,
    row_base, num_rows, W, qk_scale, v_scale, max_union,
    stride_qt, stride_qh, stride_gt, stride_gh, stride_ot,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_btr, stride_btp, stride_st, stride_sc,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
    BM: tl.constexpr, BM_P: tl.constexpr, MB: tl.constexpr, CAND: tl.constexpr, BN: tl.constexpr,
    LOG_W: tl.constexpr, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (cdiv(num_rows, BM), KV heads): rows row_base + [blk*BM, blk*BM + BM) -> out.

    A block shares tiles when its estimated union is at most max_union x its longest row
    (beyond that the masked MMA work outweighs the loads saved)."""
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = row_base + blk * BM
    n_here = tl.minimum(BM, row_base + num_rows - row0)
    i = tl.arange(0, BM_P)
    rvalid = i < n_here
    rows = row0 + i
    req0 = tl.load(req_ptr + row0)
    reqs = tl.load(req_ptr + rows, mask=rvalid, other=0)
    seq_len = tl.load(seq_ptr + req0)
    cnt = tl.load(sel_ptr + rows.to(tl.int64) * stride_st + W * stride_sc, mask=rvalid, other=0)
    cnt = tl.where(rvalid, tl.minimum(tl.maximum(cnt, 0), W), 0)
    one_req = tl.sum((rvalid & (reqs != req0)).to(tl.int32), 0) == 0
    shareable = one_req & _block_shareable(sel_ptr, rows, rvalid, cnt, seq_len, W, stride_st, stride_sc, BM_P, 64)
    union = _union_estimate(sel_ptr, rows, rvalid, cnt, stride_st, stride_sc, BM, BM_P, 32, LOG_W)
    shareable = shareable & (union <= max_union * tl.max(cnt, 0).to(tl.float32))

    d = tl.arange(0, DP)
    d_mask = d < D
    if shareable:
        m_idx = tl.arange(0, MB)
        r_loc = m_idx // G
        head = kvh * G + m_idx % G
        m_ok = r_loc < n_here
        m_row = (row0 + r_loc).to(tl.int64)
        q = tl.load(q_ptr + (m_row * stride_qt + head * stride_qh)[:, None] + d[None, :],
                    mask=m_ok[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
        # onehot[m, i]: query row m belongs to block row i (expands row membership to M).
        onehot = ((r_loc[:, None] == i[None, :]) & m_ok[:, None]).to(DOT_DTYPE)
        bt_row = bt_ptr + req0.to(tl.int64) * stride_btr
        sel_rows = sel_ptr + rows.to(tl.int64)[:, None] * stride_st
        jc = tl.arange(0, CAND)
        kk = tl.arange(0, BM_P * CAND)
        m = tl.full((MB,), float("-inf"), tl.float32)
        l = tl.zeros((MB,), tl.float32)
        acc = tl.zeros((MB, DP), tl.float32)
        bad = tl.zeros((MB,), tl.int1)
        cur = tl.zeros((BM_P,), tl.int32)
        while tl.max(cnt - cur, 0) > 0:
            cols = cur[:, None] + jc[None, :]
            e_mask = cols < cnt[:, None]
            e = tl.load(sel_rows + cols * stride_sc, mask=e_mask, other=_SENT)  # [BM_P, CAND]
            s_all = _sort(tl.reshape(e, [BM_P * CAND]), BM_P * CAND, INTERPRET)
            prev = tl.gather(s_all, tl.maximum(kk - 1, 0), 0)
            first = (s_all != prev) | (kk == 0)
            uniq = _sort(tl.where(first, s_all, _SENT), BM_P * CAND, INTERPRET)
            u = tl.min(tl.reshape(uniq, [BM_P * CAND // BN, BN]), 0)  # BN smallest distinct
            u_ok = u != _SENT
            u_last = tl.max(tl.where(u_ok, u, -1), 0)
            # Each row consumes its entries <= u_last (all in u); one entry per match.
            hit = (e[:, :, None] == u[None, None, :]) & u_ok[None, None, :]
            mem = tl.sum(hit.to(tl.int32), 1)  # [BM_P, BN]
            cur += tl.sum((e_mask & (e <= u_last)).to(tl.int32), 1)

            safe = tl.where(u_ok, u, 0)
            page = tl.maximum(tl.load(bt_row + (safe // PAGE) * stride_btp, mask=u_ok, other=0), 0).to(tl.int64)
            off = (safe % PAGE).to(tl.int64)
            kv_mask = u_ok[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + (page * stride_kp + off * stride_ks + kvh * stride_kh)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0).to(DOT_DTYPE)
            member = tl.dot(onehot, mem.to(DOT_DTYPE), input_precision="ieee") > 0.5  # [MB, BN]
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            sc = tl.where(member, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - m_shift)
            p = tl.math.exp2(sc - m_shift[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (page * stride_vp + off * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
                        mask=kv_mask, other=0.0)
            v_fin = tl.abs(v.to(tl.float32)) < float("inf")
            v_bad = tl.sum((~v_fin).to(tl.int32), 1) > 0  # [BN]
            bad = bad | (tl.sum((member & v_bad[None, :]).to(tl.int32), 1) > 0)
            v = tl.where(v_fin, v, 0.0).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
            m = m_new
        has_any = (l > 0.0)[:, None]
        o = acc / tl.where(has_any, l[:, None], 1.0) * v_scale
        o = tl.where(bad[:, None], float("nan"), o)
        mask = m_ok[:, None] & d_mask[None, :]
        g_off = m_row[:, None] * stride_gt + head[:, None] * stride_gh + d[None, :]
        o_off = m_row[:, None] * stride_ot + head[:, None] * D + d[None, :]
        _gated_store(o, has_any, gate_ptr, out_ptr, g_off, o_off, mask)
    else:
        g = tl.arange(0, GP)
        heads1 = kvh * G + g
        mask1 = (g < G)[:, None] & d_mask[None, :]
        r = 0
        while r < n_here:
            row = row0 + r
            m1, l1, acc1 = _attend(
                q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, seq_ptr, sel_ptr, row, kvh, 0, 1, W, qk_scale,
                stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_btr, stride_btp, stride_st, stride_sc,
                G, GP, D, DP, PAGE, BN, DOT_DTYPE, INTERPRET,
            )
            has1 = (l1 > 0.0)[:, None]
            o1 = acc1 / tl.where(has1, l1[:, None], 1.0) * v_scale
            g_off1 = row.to(tl.int64) * stride_gt + heads1[:, None] * stride_gh + d[None, :]
            o_off1 = row.to(tl.int64) * stride_ot + heads1[:, None] * D + d[None, :]
            _gated_store(o1, has1, gate_ptr, out_ptr, g_off1, o_off1, mask1)
            r += 1
