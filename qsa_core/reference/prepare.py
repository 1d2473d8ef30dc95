"""Reference of the write side of a QSA step: store rows, compress groups, the fused prepare."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .common import apply_rope, gemma_rms_norm, rope_cos_sin
from .select import paged_rows

if TYPE_CHECKING:
    from ..cache import QSALayerCache
    from ..metadata import QSAForwardMetadata


def qsa_store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float = 1.0) -> None:
    """Paged row store: flat slot s is cache[s // M, s % M] = rows[t] / scale; slots outside
    [0, N * M) skip.

    cache [N, M, ...] (a paged view, any float dtype, fp8 included, or integer), slots int64
    [T], rows [T, ...].
    """
    per_page = cache.shape[1]
    keep = (slots >= 0) & (slots < cache.shape[0] * per_page)
    src = rows[keep]
    if scale != 1.0:
        src = src.float() / scale
    s = slots[keep]
    cache[s // per_page, s % per_page] = src.to(cache.dtype)


def qsa_store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write K/V [T, Hkv, D] into paged caches [pages, page_size, Hkv, D] at main slots; x / scale
    rounded to the cache dtype, saturated at its largest finite value in fp8 (as the kernels'
    conversion: torch turns e5m2 overflow into inf, e4m3fn saturates)."""
    page = k_cache.shape[1]
    keep = (slots >= 0) & (slots < k_cache.shape[0] * page)
    s = slots[keep]
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        y = x[keep].float() / scale
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            top = torch.finfo(cache.dtype).max
            y = y.clamp(-top, top)
        cache[s // page, s % page] = y.to(cache.dtype)


def _group_first_rope_positions(
    rope_positions: torch.Tensor, cache: "QSALayerCache", closing: torch.Tensor, first_row: torch.Tensor,
    in_step: torch.Tensor, ring_row: torch.Tensor, compress_ratio: int,
) -> torch.Tensor:
    """RoPE position of each closed group's first token: [G] (1-D) or [3, G] (MRoPE).

    A first token of this step: its row of rope_positions. Of an earlier step: the position
    its ring row remembered (cache.ring_positions); a cache without ring positions (1-D only)
    takes the group's positions as contiguous: rope position of the closing row - (r - 1).
    """
    if rope_positions.dim() == 1:
        here = rope_positions[first_row.clamp(min=0)]
        if cache.ring_positions is None:
            earlier = rope_positions[closing] - (compress_ratio - 1)
        else:
            earlier = paged_rows(cache.ring_positions, ring_row.clamp(min=0))[:, 0]
        return torch.where(in_step, here, earlier)
    if cache.ring_positions is None:
        raise ValueError("3-axis rope_positions need a cache with ring_positions (MRoPE layout)")
    here = rope_positions[:, first_row.clamp(min=0)]
    return torch.where(in_step[None, :], here, paged_rows(cache.ring_positions, ring_row.clamp(min=0)).T)


def qsa_compress_groups(
    raw_keys: torch.Tensor,
    rope_positions: torch.Tensor,
    *,
    k_norm: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rope_axes: torch.Tensor,
    cache: "QSALayerCache",
    meta: "QSAForwardMetadata",
) -> None:
    """Compress every group this step closes and store it in cache.compressed.

    A row with compressed_slot >= 0 closes group g = (p + 1) / r - 1. Its r raw keys
    [T, Di] come from this step's rows, or from the ring for tokens of earlier steps (read
    before this step's ring writes). pooled = dtype(fp32 sum / r); key =
    RoPE(GemmaRMSNorm(pooled, k_norm), RoPE position of the group's first token).
    """
    r, C = meta.compress_ratio, meta.ring_capacity
    closing = (meta.compressed_slot >= 0).nonzero().flatten()
    if closing.numel() == 0:
        return
    req = meta.token_to_req[closing].long()
    step_first_row = meta.query_start_loc[req].long()
    offsets = torch.arange(-(r - 1), 1, device=closing.device)
    rows = closing[:, None] + offsets[None, :]  # [G, r] rows of the group's tokens
    pos = meta.positions[closing][:, None] + offsets[None, :]
    in_step = rows >= step_first_row[:, None]
    ring_rows = meta.ring_index[req].long()[:, None] * C + pos.remainder(C)
    keys = torch.where(
        in_step[..., None], raw_keys[rows.clamp(min=0)], paged_rows(cache.ring, ring_rows).to(raw_keys.dtype)
    )
    pooled = (keys.float().sum(1) / r).to(raw_keys.dtype)
    normed = gemma_rms_norm(pooled, k_norm, eps)
    first = _group_first_rope_positions(
        rope_positions, cache, closing, rows[:, 0], in_step[:, 0], ring_rows[:, 0], r
    )
    cos, sin = rope_cos_sin(first, inv_freq, rope_axes)
    keys_out = apply_rope(normed[:, None, :], cos, sin)[:, 0]
    qsa_store_rows(cache.compressed, meta.compressed_slot[closing], keys_out)


def qsa_prepare(
    index_q: torch.Tensor,
    raw_keys: torch.Tensor,
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope_positions: torch.Tensor,
    *,
    index_q_norm: torch.Tensor,
    index_k_norm: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rope_axes: torch.Tensor,
    index_dtype: torch.dtype,
    cache: "QSALayerCache",
    meta: "QSAForwardMetadata",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused write side of a QSA layer for one step.

    Inputs (model dtype): index_q [T, Hi*Di], raw_keys [T, Di], q_gate [T, Hq*2D] (per head
    [q | gate]), k and v [T, Hkv*D]. Writes compressed keys, the raw-key ring (+ MRoPE
    positions) and main K/V. Returns q_idx [T, Hi, Di] (index_dtype), q and gate [T, Hq, D].
    """
    T, Di = raw_keys.shape
    D = k_norm.shape[0]
    cos, sin = rope_cos_sin(rope_positions, inv_freq, rope_axes)
    q_idx = apply_rope(gemma_rms_norm(index_q.view(T, -1, Di), index_q_norm, eps), cos, sin)
    qsa_compress_groups(
        raw_keys, rope_positions, k_norm=index_k_norm, eps=eps, inv_freq=inv_freq,
        rope_axes=rope_axes, cache=cache, meta=meta,
    )
    qsa_store_rows(cache.ring, meta.ring_slot, raw_keys)
    if cache.ring_positions is not None:
        rows3 = rope_positions.view(-1, T).expand(3, -1).T
        qsa_store_rows(cache.ring_positions, meta.ring_slot, rows3)
    qg = q_gate.view(T, -1, 2 * D)
    q = apply_rope(gemma_rms_norm(qg[..., :D], q_norm, eps), cos, sin)
    k_out = apply_rope(gemma_rms_norm(k.view(T, -1, D), k_norm, eps), cos, sin)
    qsa_store_kv(cache.k, cache.v, meta.slot_mapping, k_out, v.view(T, -1, D), cache.k_scale, cache.v_scale)
    return q_idx.to(index_dtype), q, qg[..., D:]
