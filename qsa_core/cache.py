"""Cache layouts (design.md §4): the plan, validated once, and the per-layer views.

Every cache is a paged view with any page / row strides and a contiguous last dim, so an
engine hands over its own buffers as they are (no renumbering, no aliasing), and every
store's bounds guard stops at the view's own pages:
- main K/V `[num_pages, page_size, Hkv, D]` (vLLM's side-by-side page, SGLang's buffers);
- compressed keys `[num_pages, page_size / r, Di]`, page-aligned with the main KV: group g
  of a request is row `(g*r % page_size) / r` of its main page `block_table[q, g*r // page_size]`
  (flat, `compressed_slot = main slot // r`);
- the raw-key ring `[ring_rows, C, Di]`: request q's rows are page `ring_index[q]`, row `p % C`
  (flat, `ring_slot = ring_index * C + p % C`), with `[ring_rows, C, 3]` int64 RoPE
  positions per row (1-D positions fill all three axes), which key the groups whose first
  token an earlier step wrote (design.md §6.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from .config import QSAConfig, resolve_dtype


def ring_capacity(compress_ratio: int, num_speculative_tokens: int = 0) -> int:
    """C = r * ceil((r + num_spec) / r): the open group plus room for rejected drafts."""
    r = compress_ratio
    return r * math.ceil((r + num_speculative_tokens) / r)


def ring_store_fuses(max_query_len: int, ring_capacity: int, compress_ratio: int) -> bool:
    """Whether a step's ring store may run in prepare's first launch: no request has
    C - r + 2 rows or more. A request's compressions read ring slots of positions
    s-(r-1)..s-1 (s: its first row's position; the group its rows close first began before
    them) and its rows write slots of positions in [s, s + n); those slots (mod C) meet only
    if C <= n + r - 2. Decode steps qualify (C >= r + draft rows)."""
    return max_query_len <= ring_capacity - compress_ratio + 1


def check_page_size(page_size: int, compress_ratio: int) -> None:
    """Main KV pages must hold whole groups (compressed rows are page-aligned)."""
    if page_size <= 0 or page_size % compress_ratio:
        raise ValueError(f"page_size ({page_size}) must be a positive multiple of compress_ratio ({compress_ratio})")


@dataclass
class QSALayerCache:
    """The three caches of one QSA layer (views; the owner may be an engine)."""

    k: torch.Tensor  # [num_pages, page_size, Hkv, D], kv cache dtype
    v: torch.Tensor  # [num_pages, page_size, Hkv, D], kv cache dtype
    compressed: torch.Tensor  # [num_pages, page_size / r, Di], index dtype
    ring: torch.Tensor  # [ring_rows, C, Di], model dtype
    ring_positions: torch.Tensor | None  # [ring_rows, C, 3] int64; required for MRoPE
    k_scale: float = 1.0
    v_scale: float = 1.0


class QSACacheLayout(BaseModel):
    """How the caches of N QSA layers are laid out; validated once at allocation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(gt=0)
    page_size: int = Field(gt=0)
    num_pages: int = Field(gt=0)
    ring_rows: int = Field(gt=0, description="requests that can hold a ring row at once")
    num_speculative_tokens: int = Field(0, ge=0)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def ring_capacity(self, config: QSAConfig) -> int:
        return ring_capacity(config.compress_ratio, self.num_speculative_tokens)

    def allocate(
        self, config: QSAConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> list[QSALayerCache]:
        """Allocate all caches; main K/V live side by side in one page buffer per layer.

        Normal tensors even inside torch.inference_mode(): steps outside it write them.
        """
        with torch.inference_mode(False):
            return self._allocate(config, dtype, device)

    def _allocate(self, config: QSAConfig, dtype: torch.dtype, device: torch.device | str) -> list[QSALayerCache]:
        check_page_size(self.page_size, config.compress_ratio)
        dtypes = cache_dtypes(config, dtype)
        C = self.ring_capacity(config)
        D, Hkv, Di = config.head_dim, config.num_kv_heads, config.index_head_dim
        caches = []
        for _ in range(self.num_layers):
            kv = torch.zeros(self.num_pages, self.page_size, Hkv, 2 * D, dtype=dtypes["k"], device=device)
            caches.append(
                QSALayerCache(
                    k=kv[..., :D],
                    v=kv[..., D:],
                    compressed=torch.zeros(
                        self.num_pages, self.page_size // config.compress_ratio, Di, dtype=dtypes["compressed"],
                        device=device,
                    ),
                    ring=torch.zeros(self.ring_rows, C, Di, dtype=dtypes["ring"], device=device),
                    # 1-D models too: a group key is rotated at its first token's RoPE
                    # position, which may differ from the logical one (design.md §6.2).
                    ring_positions=torch.zeros(self.ring_rows, C, 3, dtype=torch.int64, device=device),
                )
            )
        return caches


def cache_dtypes(config: QSAConfig, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each float cache of a layer whose model (activation) dtype is `dtype`, by
    `QSALayerCache` field (design.md §4): main K/V the config's kv_cache_dtype, compressed
    keys its index_dtype ("auto": the model dtype), the raw-key ring the model dtype (raw
    keys are pooled as they are, design.md §2.3: a narrower ring would round only the keys a group
    takes from earlier steps). Ring positions are int64."""
    kv = resolve_dtype(config.kv_cache_dtype, dtype)
    return dict(k=kv, v=kv, compressed=resolve_dtype(config.index_dtype, dtype), ring=dtype)


def _dtype_source(field: str, value: str) -> str:
    """Where a cache's dtype comes from, for error messages: `field 'value'`."""
    return f"{field} {value!r}" + (" = the model dtype" if value == "auto" else "")


def validate_layer_cache(
    cache: QSALayerCache, config: QSAConfig, page_size: int, ring_capacity: int | None = None, *,
    dtype: torch.dtype,
) -> None:
    """Shape/dtype checks of cache views (once, at allocation or binding; no tensor reads).

    dtype: the model (activation) dtype the layer runs in (the planner's); each cache must
    hold exactly its `cache_dtypes` dtype: every store casts to the cache's dtype, so another
    one would round or garble (an integer view) what is stored, without an error.
    """
    D, Hkv, Di = config.head_dim, config.num_kv_heads, config.index_head_dim
    for name in ("k", "v"):
        t = getattr(cache, name)
        if t.dim() != 4 or t.shape[1] != page_size or tuple(t.shape[2:]) != (Hkv, D):
            raise ValueError(
                f"cache.{name} must be [num_pages, {page_size}, {Hkv}, {D}], got {tuple(t.shape)}"
            )
    if cache.v.shape[0] != cache.k.shape[0]:
        raise ValueError(  # the K/V store bounds both by K's slots
            f"cache.v must have as many pages as cache.k ({cache.k.shape[0]}), got {cache.v.shape[0]}"
        )
    rows_per_page = page_size // config.compress_ratio
    comp = cache.compressed
    if comp.dim() != 3 or tuple(comp.shape[1:]) != (rows_per_page, Di):
        raise ValueError(f"cache.compressed must be [num_pages, {rows_per_page}, {Di}], got {tuple(comp.shape)}")
    if comp.shape[0] < cache.k.shape[0]:
        raise ValueError(
            f"cache.compressed needs >= {cache.k.shape[0]} pages (one per main K/V page), got {comp.shape[0]}"
        )
    ring = cache.ring
    if ring.dim() != 3 or ring.shape[2] != Di or (ring_capacity is not None and ring.shape[1] != ring_capacity):
        C = ring_capacity if ring_capacity is not None else "C"
        raise ValueError(f"cache.ring must be [ring_rows, {C}, {Di}], got {tuple(ring.shape)}")
    kv = _dtype_source("kv_cache_dtype", config.kv_cache_dtype)
    sources = dict(k=kv, v=kv, compressed=_dtype_source("index_dtype", config.index_dtype),
                   ring="the model dtype: raw keys are pooled as they are")
    for name, want in cache_dtypes(config, dtype).items():
        t = getattr(cache, name)
        if t.dtype != want:
            raise ValueError(f"cache.{name} must be {want} ({sources[name]}), got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"cache.{name} must have a contiguous last dim")
    rp = cache.ring_positions
    if config.uses_mrope and rp is None:
        raise ValueError("cache.ring_positions is required for an MRoPE model")
    if rp is not None and (rp.dtype != torch.int64 or tuple(rp.shape) != (*ring.shape[:2], 3)):
        raise ValueError(
            f"cache.ring_positions must be int64 [{ring.shape[0]}, {ring.shape[1]}, 3], got {rp.dtype} {tuple(rp.shape)}"
        )
