"""Triton write side of a QSA step: the fused prepare (group compression, ring and K/V stores).

Mirrors `qsa_core.reference.prepare`. Numerics follow the reference's dtype path: norms in
fp32 rounded to the model dtype, RoPE with the cos/sin table rounded to the model dtype and
every product and sum rounded to it, as torch does for bf16 tensors.

`PrepareLaunch` is one or two launches. Launch 1, grid (T, 3 + ceil(Hq / heads per program)):
task 0 the indexer query, task 1 the compression of the group the row closes (if any),
task 2 the row's K/V store, tasks 3.. blocks of main query heads. The raw keys (and MRoPE
positions) go into the ring in launch 2, after launch 1: compression reads ring rows of
earlier steps, and a chunk's last C rows map onto those same ring slots. Where no request
of the step has C - r + 2 rows or more (every decode step), those slots cannot meet and task 2
stores the ring row too: one launch (the caller's `fuse_ring`; `qsa_core.cache.ring_store_fuses`).
`PrepareLaunch` binds them (`qsa_kernels.launch`) once per step shape and layer cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launcher, pdl_end, pdl_start
from .options import DEFAULT, KernelOptions

# Elements of one [heads, dims] tile of the main-query task.
MAIN_TILE = 2048


# ----------------------------------------------------------------------------- numerics


@triton.jit
def _rne_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    """fp32 x rounded to nearest even on a float grid with MANT mantissa bits and minimum
    normal exponent EMIN (subnormals included), saturated at +-FMAX."""
    e = ((tl.abs(x).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    quantum = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    y = x / quantum  # exact: power-of-two scale
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: fp32 adds round y to an integer (RNE)
    return tl.minimum(tl.maximum(y * quantum, -FMAX), FMAX)


@triton.jit
def _cvt(x, DT: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> DT with round-to-nearest-even.

    The interpreter truncates fp32 -> bf16 and loses mantissa carries in fp8 casts, so it
    first snaps x to the target grid in fp32 (the final cast is then exact): Veltkamp
    splitting for bf16 (x rounded to 8 significant bits, ties to even), `_rne_grid` for fp8.
    """
    if INTERP:
        if DT == tl.bfloat16:
            c = x * 65537.0  # 2**16 + 1
            x = c - (c - x)
        elif DT == tl.float8e4nv:
            x = _rne_grid(x, 3, -6, 448.0)
        elif DT == tl.float8e5:
            x = _rne_grid(x, 2, -14, 57344.0)
    return x.to(DT)


@triton.jit
def _round(x, DT: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x rounded to DT, returned as fp32 (a torch op on DT tensors rounds like this)."""
    return _cvt(x, DT, INTERP).to(tl.float32)


@triton.jit
def _partner(d, RD: tl.constexpr):
    """Rotate-half partner lane of each lane d (itself beyond the rotary dims)."""
    half: tl.constexpr = RD // 2
    return tl.where(d < half, d + half, tl.where(d < RD, d - half, d))


@triton.jit
def _rope_cos_sin(pos, inv_freq_ptr, d, RD: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """cos, sin [BD] (fp32 values rounded to DT) of lanes d; pos [BD] int64 per lane."""
    inv = tl.load(inv_freq_ptr + d % (RD // 2), mask=d < RD, other=0.0)
    f = pos.to(tl.float32) * inv
    return _round(tl.cos(f), DT, INTERP), _round(tl.sin(f), DT, INTERP)


@triton.jit
def _lane_axes(rope_axes_ptr, d, RD: tl.constexpr):
    """Position axis (0 T, 1 H, 2 W) of each lane's frequency, int64 [BD]."""
    return tl.load(rope_axes_ptr + d % (RD // 2), mask=d < RD, other=0).to(tl.int64)


@triton.jit
def _norm_rope(x, xp, w_ptr, d, n_dims, eps, cos, sin,
               RD: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """RoPE(GemmaRMSNorm(x)) of a tile [BH, BD] as fp32 values of dtype DT.

    x, xp: fp32 [BH, BD], xp = x at each lane's rotate-half partner; lanes >= n_dims are 0.
    """
    dmask = d < n_dims
    pd = _partner(d, RD)
    w1 = 1.0 + tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    wp1 = 1.0 + tl.load(w_ptr + pd, mask=dmask, other=0.0).to(tl.float32)
    mean_sq = tl.div_rn(tl.sum(x * x, axis=1), n_dims.to(tl.float32))
    rstd = tl.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))[:, None]
    normed = _round(x * rstd * w1[None, :], DT, INTERP)
    normed_p = _round(xp * rstd * wp1[None, :], DT, INTERP)
    a = _round(normed * cos[None, :], DT, INTERP)
    b = _round(normed_p * sin[None, :], DT, INTERP)
    b = tl.where((d < RD // 2)[None, :], -b, b)
    return tl.where((d < RD)[None, :], _round(a + b, DT, INTERP), normed)


@triton.jit
def _load_heads(ptr, row_off, h, h_mask, stride_h, d, n_dims, RD: tl.constexpr):
    """x and its rotate-half partner xp, fp32 [BH, BD], of heads h of one row."""
    mask = h_mask[:, None] & (d < n_dims)[None, :]
    base = ptr + row_off + h[:, None] * stride_h
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + _partner(d, RD)[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, xp


@triton.jit
def _row_cos_sin(t, rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, d,
                 RD: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """cos, sin [BD] of row t's RoPE position(s) (rope_stride_axis 0 for 1-D positions)."""
    axes = _lane_axes(rope_axes_ptr, d, RD)
    pos = tl.load(rope_ptr + axes * rope_stride_axis + t * rope_stride_t)
    return _rope_cos_sin(pos, inv_freq_ptr, d, RD, DT, INTERP)


# ----------------------------------------------------------------------------- tasks


@triton.jit
def _compress_row(
    t, raw_ptr, stride_raw, rope_ptr, rope_stride_axis, rope_stride_t,
    w_ptr, eps, inv_freq_ptr, rope_axes_ptr,
    comp_ptr, stride_cpage, stride_comp, comp_rows, ring_ptr, stride_rpage, stride_ring,
    ring_pos_ptr, stride_rpp, stride_rp0, stride_rp1,
    comp_slot_ptr, to_req_ptr, pos_ptr, qsl_ptr, ring_index_ptr, Di,
    r: tl.constexpr, C: tl.constexpr, RPP: tl.constexpr, RD: tl.constexpr, BD: tl.constexpr,
    HAS_RING_POS: tl.constexpr, INTERP: tl.constexpr,
):
    """Compress and store the group that row t closes (nothing if it closes none).

    The r raw keys are this step's rows t-r+1..t, or ring rows for tokens of earlier steps.
    pooled = dtype(fp32 sequential sum / r); key = RoPE(GemmaRMSNorm(pooled)) at the RoPE
    position(s) of the group's first token: from this step's row, else from
    cache.ring_positions (HAS_RING_POS), else (1-D) the closing row's position - (r - 1).
    """
    slot = tl.load(comp_slot_ptr + t)
    if (slot >= 0) & (slot < comp_rows):
        DT: tl.constexpr = raw_ptr.dtype.element_ty
        d = tl.arange(0, BD)
        dmask = d < Di
        pd = _partner(d, RD)
        req = tl.load(to_req_ptr + t)
        first_row = tl.load(qsl_ptr + req).to(tl.int64)
        p = tl.load(pos_ptr + t)
        ring_base = tl.load(ring_index_ptr + req).to(tl.int64) * C
        acc = tl.zeros([BD], dtype=tl.float32)
        acc_p = tl.zeros([BD], dtype=tl.float32)
        for j in tl.static_range(r):
            row = t - (r - 1) + j
            in_step = row >= first_row
            ring_row = ring_base + (p - (r - 1) + j) % C  # positions >= 0 here
            here = raw_ptr + tl.maximum(row, 0) * stride_raw
            there = ring_ptr + (ring_row // C) * stride_rpage + (ring_row % C) * stride_ring
            k = tl.where(in_step, tl.load(here + d, mask=tl.where(in_step, dmask, False), other=0.0).to(tl.float32),
                         _round(tl.load(there + d, mask=tl.where(in_step, False, dmask), other=0.0).to(tl.float32), DT, INTERP))
            kp = tl.where(in_step, tl.load(here + pd, mask=tl.where(in_step, dmask, False), other=0.0).to(tl.float32),
                          _round(tl.load(there + pd, mask=tl.where(in_step, False, dmask), other=0.0).to(tl.float32), DT, INTERP))
            acc += k
            acc_p += kp
        pooled = _round(tl.div_rn(acc, tl.full([BD], r, tl.float32)), DT, INTERP)
        pooled_p = _round(tl.div_rn(acc_p, tl.full([BD], r, tl.float32)), DT, INTERP)
        row0 = t - (r - 1)
        axes = _lane_axes(rope_axes_ptr, d, RD)
        in_step0 = row0 >= first_row
        from_step = tl.load(rope_ptr + axes * rope_stride_axis + tl.maximum(row0, 0) * rope_stride_t,
                            mask=tl.where(in_step0, d < RD, False), other=0)
        if HAS_RING_POS:
            ring_row0 = ring_base + (p - (r - 1)) % C
            earlier = tl.load(ring_pos_ptr + (ring_row0 // C) * stride_rpp + (ring_row0 % C) * stride_rp0
                              + axes * stride_rp1,
                              mask=tl.where(in_step0, False, d < RD), other=0)
        else:  # 1-D positions taken as contiguous inside the group
            earlier = tl.load(rope_ptr + axes * rope_stride_axis + t * rope_stride_t,
                              mask=tl.where(in_step0, False, d < RD), other=0) - (r - 1)
        first_pos = tl.where(in_step0, from_step, earlier)
        cos, sin = _rope_cos_sin(first_pos, inv_freq_ptr, d, RD, DT, INTERP)
        key = _norm_rope(pooled[None, :], pooled_p[None, :], w_ptr, d, Di, eps, cos, sin, RD, DT, INTERP)
        out_dt: tl.constexpr = comp_ptr.dtype.element_ty
        dst = comp_ptr + (slot // RPP) * stride_cpage + (slot % RPP) * stride_comp
        tl.store(dst + d[None, :], _cvt(key, out_dt, INTERP), mask=dmask[None, :])


@triton.jit
def _store_kv_row(
    slot, k_vals, v_ptr, v_row_off, v_stride_h, h, h_mask, d, D,
    kc_ptr, vc_ptr, kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, page_size,
    k_scale, v_scale, INTERP: tl.constexpr,
):
    """Write one row's K (fp32 values [BH, BD]) and V (loaded here) at a valid main slot."""
    page = slot // page_size
    off = slot % page_size
    mask = h_mask[:, None] & (d < D)[None, :]
    k_dst = kc_ptr + page * kc_sp + off * kc_so + h[:, None] * kc_sh + d[None, :]
    k_out = tl.div_rn(k_vals, tl.full(k_vals.shape, k_scale, tl.float32))
    tl.store(k_dst, _cvt(k_out, kc_ptr.dtype.element_ty, INTERP), mask=mask)
    v = tl.load(v_ptr + v_row_off + h[:, None] * v_stride_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
    v_dst = vc_ptr + page * vc_sp + off * vc_so + h[:, None] * vc_sh + d[None, :]
    v_out = tl.div_rn(v, tl.full(v.shape, v_scale, tl.float32))
    tl.store(v_dst, _cvt(v_out, vc_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _heads_task(
    t, x_ptr, x_stride_t, x_stride_h, w_ptr, out_ptr, h0, H, Dx,
    rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, eps,
    RD: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr,
):
    """out[t, h0 + i] = RoPE(GemmaRMSNorm(x[t, h0 + i])) for BH heads; out [T, H, Dx]
    contiguous. Rounded to the input dtype first, then cast to out's dtype (index fp8)."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    d = tl.arange(0, BD)
    h = h0 + tl.arange(0, BH)
    cos, sin = _row_cos_sin(t, rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, d,
                            RD, DT, INTERP)
    x, xp = _load_heads(x_ptr, t * x_stride_t, h, h < H, x_stride_h, d, Dx, RD)
    y = _norm_rope(x, xp, w_ptr, d, Dx, eps, cos, sin, RD, DT, INTERP)
    dst = out_ptr + t * H * Dx + h[:, None] * Dx + d[None, :]
    tl.store(dst, _cvt(y, out_ptr.dtype.element_ty, INTERP), mask=(h < H)[:, None] & (d < Dx)[None, :])


@triton.jit
def _kv_task(
    t, k_ptr, k_stride_t, w_ptr, v_ptr, v_stride_t, Hkv, D, slot_ptr,
    kc_ptr, vc_ptr, kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, page_size, num_slots, k_scale, v_scale,
    rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, eps,
    RD: tl.constexpr, BKV: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr,
):
    """Main K norm + RoPE (rounded to the model dtype) and the row's K/V store."""
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        DT: tl.constexpr = k_ptr.dtype.element_ty
        d = tl.arange(0, BD)
        h = tl.arange(0, BKV)
        cos, sin = _row_cos_sin(t, rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, d,
                                RD, DT, INTERP)
        x, xp = _load_heads(k_ptr, t * k_stride_t, h, h < Hkv, D, d, D, RD)
        k = _norm_rope(x, xp, w_ptr, d, D, eps, cos, sin, RD, DT, INTERP)
        _store_kv_row(slot, k, v_ptr, t * v_stride_t, D, h, h < Hkv, d, D,
                      kc_ptr, vc_ptr, kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, page_size,
                      k_scale, v_scale, INTERP)


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["rope_stride_axis"])
def _prepare_kernel(
    # indexer query
    iq_ptr, iq_stride_t, iq_w_ptr, qidx_ptr, Hi, Di,
    # raw keys (row t at raw_ptr + raw_off + t * stride_raw), compression, compressed cache
    raw_ptr, stride_raw, raw_off, ik_w_ptr, comp_ptr, stride_cpage, stride_comp, comp_rows,
    ring_ptr, stride_rpage, stride_ring, ring_rows, ring_pos_ptr, stride_rpp, stride_rp0, stride_rp1,
    # main q / k / v
    qg_ptr, qg_stride_t, q_w_ptr, q_out_ptr, Hq, D,
    k_ptr, k_stride_t, k_w_ptr, v_ptr, v_stride_t, Hkv,
    kc_ptr, vc_ptr, kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, page_size, num_slots,
    k_scale, v_scale,
    # positions and metadata
    rope_ptr, rope_stride_axis, rope_stride_t, inv_freq_ptr, rope_axes_ptr, eps,
    slot_ptr, comp_slot_ptr, to_req_ptr, pos_ptr, qsl_ptr, ring_index_ptr, ring_slot_ptr,
    r: tl.constexpr, C: tl.constexpr, RPP: tl.constexpr, RD: tl.constexpr,
    BHI: tl.constexpr, BDI: tl.constexpr, BHQ: tl.constexpr, BD: tl.constexpr, BKV: tl.constexpr,
    HAS_RING_POS: tl.constexpr, RING_STORE: tl.constexpr, STORE_RING_POS: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """RING_STORE: task 2 also stores the row's ring row (+ its positions where
    STORE_RING_POS); only where no compression of the step can read a ring slot that another
    row of the step writes (`qsa_core.cache.ring_store_fuses`)."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    task = tl.program_id(1)
    if task == 0:
        _heads_task(t, iq_ptr, iq_stride_t, Di, iq_w_ptr, qidx_ptr, 0, Hi, Di,
                    rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, eps,
                    RD, BHI, BDI, INTERP)
    elif task == 1:
        _compress_row(
            t, raw_ptr + raw_off, stride_raw, rope_ptr, rope_stride_axis, rope_stride_t,
            ik_w_ptr, eps, inv_freq_ptr, rope_axes_ptr,
            comp_ptr, stride_cpage, stride_comp, comp_rows, ring_ptr, stride_rpage, stride_ring,
            ring_pos_ptr, stride_rpp, stride_rp0, stride_rp1,
            comp_slot_ptr, to_req_ptr, pos_ptr, qsl_ptr, ring_index_ptr, Di,
            r, C, RPP, RD, BDI, HAS_RING_POS, INTERP,
        )
    elif task == 2:
        _kv_task(t, k_ptr, k_stride_t, k_w_ptr, v_ptr, v_stride_t, Hkv, D, slot_ptr,
                 kc_ptr, vc_ptr, kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, page_size, num_slots, k_scale, v_scale,
                 rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, eps,
                 RD, BKV, BD, INTERP)
        if RING_STORE:
            _ring_row(t, raw_ptr, stride_raw, raw_off, ring_ptr, stride_rpage, stride_ring, ring_rows, ring_slot_ptr,
                      Di, ring_pos_ptr, stride_rpp, stride_rp0, stride_rp1, rope_ptr, rope_stride_axis,
                      rope_stride_t, C, STORE_RING_POS, BDI, INTERP)
    else:  # a block of main query heads; per head [q | gate] in q_gate
        _heads_task(t, qg_ptr, qg_stride_t, 2 * D, q_w_ptr, q_out_ptr, (task - 3) * BHQ, Hq, D,
                    rope_ptr, rope_stride_axis, rope_stride_t, rope_axes_ptr, inv_freq_ptr, eps,
                    RD, BHQ, BD, INTERP)
    pdl_end(PDL)


@triton.jit
def _ring_row(
    t, raw_ptr, stride_raw, raw_off, ring_ptr, stride_rpage, stride_ring, ring_rows, ring_slot_ptr, Di,
    ring_pos_ptr, stride_rpp, stride_rp0, stride_rp1, rope_ptr, rope_stride_axis, rope_stride_t,
    C: tl.constexpr, HAS_POS: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr,
):
    """ring[ring_slot[t]] = raw[t] (at raw_ptr + raw_off + t * stride_raw; + the row's 3 rope
    positions where HAS_POS) for a valid ring slot."""
    slot = tl.load(ring_slot_ptr + t)
    if (slot >= 0) & (slot < ring_rows):
        d = tl.arange(0, BD)
        x = tl.load(raw_ptr + raw_off + t * stride_raw + d, mask=d < Di, other=0.0).to(tl.float32)
        dst = ring_ptr + (slot // C) * stride_rpage + (slot % C) * stride_ring
        tl.store(dst + d, _cvt(x, ring_ptr.dtype.element_ty, INTERP), mask=d < Di)
        if HAS_POS:
            a = tl.arange(0, 4)
            pos = tl.load(rope_ptr + a * rope_stride_axis + t * rope_stride_t, mask=a < 3, other=0)
            pos_dst = ring_pos_ptr + (slot // C) * stride_rpp + (slot % C) * stride_rp0
            tl.store(pos_dst + a * stride_rp1, pos, mask=a < 3)


@triton.jit(do_not_specialize=["rope_stride_axis"])
def _ring_store_kernel(
    raw_ptr, stride_raw, raw_off, ring_ptr, stride_rpage, stride_ring, ring_rows, ring_slot_ptr, Di,
    ring_pos_ptr, stride_rpp, stride_rp0, stride_rp1, rope_ptr, rope_stride_axis, rope_stride_t,
    C: tl.constexpr, HAS_POS: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_start(PDL)
    _ring_row(tl.program_id(0).to(tl.int64), raw_ptr, stride_raw, raw_off, ring_ptr, stride_rpage, stride_ring,
              ring_rows, ring_slot_ptr, Di, ring_pos_ptr, stride_rpp, stride_rp0, stride_rp1,
              rope_ptr, rope_stride_axis, rope_stride_t, C, HAS_POS, BD, INTERP)
    pdl_end(PDL)


# ----------------------------------------------------------------------------- host side


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _rope_args(rope_positions: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(tensor, axis stride, row stride); a 1-D tensor feeds all three axes (stride 0)."""
    st = rope_positions.stride()
    return (rope_positions, 0, st[0]) if len(st) == 1 else (rope_positions, st[0], st[1])


def _ring_pos_args(rp: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, page, row and axis strides) of the paged [ring_rows, C, 3] MRoPE positions rp
    (None: fallback stands in, never read)."""
    if rp is None:
        return fallback, 0, 0, 0
    return rp, rp.stride(0), rp.stride(1), rp.stride(2)


def _paged_args(t: torch.Tensor) -> list:
    """(tensor, page stride, row stride, rows in all pages) of a paged view [pages, rows, F]."""
    return [t, t.stride(0), t.stride(1), t.shape[0] * t.shape[1]]


def _kv_cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> list:
    return [k_cache, v_cache, *k_cache.stride()[:3], *v_cache.stride()[:3]]


def _has_ring_positions(rope_positions: torch.Tensor, ring_positions: torch.Tensor | None) -> bool:
    """Whether group keys of earlier steps read their first position from the ring."""
    if rope_positions.dim() == 2 and ring_positions is None:
        raise ValueError("3-axis rope_positions need a cache with ring_positions (MRoPE layout)")
    return ring_positions is not None


_prepare = Launcher(_prepare_kernel)
_ring_store = Launcher(_ring_store_kernel)
# Per call: the projections, the norm weights (per layer), the step's positions and requests.
_PREPARE_FREE = ("iq_ptr", "iq_stride_t", "iq_w_ptr", "raw_ptr", "stride_raw", "ik_w_ptr", "qg_ptr", "qg_stride_t",
                 "q_w_ptr", "k_ptr", "k_stride_t", "k_w_ptr", "v_ptr", "v_stride_t",
                 "rope_ptr", "rope_stride_axis", "rope_stride_t", "qsl_ptr", "ring_index_ptr")
_RING_FREE = ("raw_ptr", "stride_raw", "rope_ptr", "rope_stride_axis", "rope_stride_t")


class PrepareLaunch:
    """The reference's `qsa_prepare` bound to one step shape (T rows, the plan's workspace)
    and one layer cache: one launch where fuse_ring (`qsa_core.cache.ring_store_fuses` of the
    step), else two; `__call__` takes what changes per layer call.

    Fixed at binding: the metadata's derived per-row fields (slot_mapping, compressed_slot
    int64 [T], token_to_req int32 [T], positions int64 [T], ring_slot int64 [T]: the plan's
    workspace views), the q_idx / q outputs, the layer cache (k_cache / v_cache [pages, page,
    Hkv, D] with k_scale / v_scale, compressed [pages, page / r, Di], ring [ring rows, C, Di],
    ring_positions int64 [ring rows, C, 3] or None), the RoPE tables, eps and the geometry
    (compress_ratio r, ring_capacity C). Per call: the projections, the norm weights,
    rope_positions, query_start_loc int32 [R + 1] and ring_index int32 [R] (the values given
    here are the first call's). index_q may be wider than Hi*Di (only its first Hi*Di columns
    are read; Hi comes from q_idx_out [T, Hi, Di]) and raw_keys' rows may start raw_offset
    elements in: the layer passes the whole index_qk projection as both, raw_offset = Hi*Di
    (no per-call views).
    """

    def __init__(
        self, index_q: torch.Tensor, raw_keys: torch.Tensor, q_gate: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, rope_positions: torch.Tensor, *, index_q_norm: torch.Tensor, index_k_norm: torch.Tensor,
        q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor, rope_axes: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float, compressed: torch.Tensor,
        ring: torch.Tensor, ring_positions: torch.Tensor | None, slot_mapping: torch.Tensor,
        compressed_slot: torch.Tensor, token_to_req: torch.Tensor, positions: torch.Tensor, ring_slot: torch.Tensor,
        query_start_loc: torch.Tensor, ring_index: torch.Tensor, compress_ratio: int, ring_capacity: int,
        q_idx_out: torch.Tensor, q_out: torch.Tensor, raw_offset: int = 0, fuse_ring: bool = False,
        options: KernelOptions = DEFAULT,
    ) -> None:
        T, Di = raw_keys.shape[0], index_k_norm.shape[0]
        D = k_norm.shape[0]
        Hi, Hq, Hkv = q_idx_out.shape[1], q_gate.shape[1] // (2 * D), k.shape[1] // D
        self.T, self.Hq, self.D = T, Hq, D
        self.q_idx, self.q = q_idx_out, q_out
        has_ring_pos = _has_ring_positions(rope_positions, ring_positions)
        rope, rs_axis, rs_t = _rope_args(rope_positions)
        # Without MRoPE the ring positions are never read: any fixed tensor stands in.
        ring_pos, rpp, rp0, rp1 = _ring_pos_args(ring_positions, ring)
        BD = _pow2(D)
        heads_per_prog = min(_pow2(Hq), max(1, MAIN_TILE // BD))
        page = k_cache.shape[1]
        interp = options.interpreter
        self._main = _prepare.bind(
            (T, 3 + triton.cdiv(Hq, heads_per_prog)),
            index_q, index_q.stride(0), index_q_norm, q_idx_out, Hi, Di,
            raw_keys, raw_keys.stride(0), raw_offset, index_k_norm, *_paged_args(compressed),
            *_paged_args(ring), ring_pos, rpp, rp0, rp1,
            q_gate, q_gate.stride(0), q_norm, q_out, Hq, D,
            k, k.stride(0), k_norm, v, v.stride(0), Hkv,
            *_kv_cache_args(k_cache, v_cache), page, k_cache.shape[0] * page,
            float(k_scale), float(v_scale),
            rope, rs_axis, rs_t, inv_freq, rope_axes, float(eps),
            slot_mapping, compressed_slot, token_to_req, positions,
            query_start_loc, ring_index, ring_slot,
            free=_PREPARE_FREE, options=options,
            r=compress_ratio, C=ring_capacity, RPP=compressed.shape[1], RD=2 * inv_freq.shape[0],
            BHI=_pow2(Hi), BDI=_pow2(Di), BHQ=heads_per_prog, BD=BD, BKV=_pow2(Hkv),
            HAS_RING_POS=has_ring_pos, RING_STORE=fuse_ring, STORE_RING_POS=ring_positions is not None,
            INTERP=interp,
        )
        self._ring = None if fuse_ring else _ring_store.bind(
            (T,), raw_keys, raw_keys.stride(0), raw_offset, *_paged_args(ring), ring_slot, Di,
            ring_pos, rpp, rp0, rp1, rope, rs_axis, rs_t,
            free=_RING_FREE, options=options,
            C=ring_capacity, HAS_POS=ring_positions is not None, BD=_pow2(Di), INTERP=interp,
        )

    def __call__(
        self, index_q: torch.Tensor, raw_keys: torch.Tensor, q_gate: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, rope_positions: torch.Tensor, index_q_norm: torch.Tensor, index_k_norm: torch.Tensor,
        q_norm: torch.Tensor, k_norm: torch.Tensor, query_start_loc: torch.Tensor, ring_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shapes as the reference's `qsa_prepare` (T rows each); returns (q_idx, q, gate)."""
        rope, rs_axis, rs_t = _rope_args(rope_positions)
        iq_stride = index_q.stride()[0]
        raw_stride = iq_stride if raw_keys is index_q else raw_keys.stride()[0]
        qg_stride = q_gate.stride()
        self._main(index_q, iq_stride, index_q_norm, raw_keys, raw_stride, index_k_norm, q_gate,
                   qg_stride[0], q_norm, k, k.stride()[0], k_norm, v, v.stride()[0], rope, rs_axis, rs_t,
                   query_start_loc, ring_index)
        if self._ring is not None:
            self._ring(raw_keys, raw_stride, rope, rs_axis, rs_t)
        return self.q_idx, self.q, _gate(q_gate, self.T, self.Hq, self.D, qg_stride)


def _gate(q_gate: torch.Tensor, T: int, Hq: int, D: int, st: tuple[int, ...]) -> torch.Tensor:
    """The gate half [T, Hq, D] of q_gate [T, Hq*2D] (per head [q | gate], contiguous rows;
    st = q_gate.stride()): `q_gate.view(T, Hq, 2D)[..., D:]` as one view op."""
    if st[1] != 1:
        raise ValueError(f"q_gate rows must be contiguous, got strides {st}")
    return q_gate.as_strided((T, Hq, D), (st[0], 2 * D, 1), q_gate.storage_offset() + D)


