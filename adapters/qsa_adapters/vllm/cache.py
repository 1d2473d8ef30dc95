"""KV-cache specs of a QSA layer and the binding of vLLM's tensors to `QSALayerCache` views.

vLLM's allocator owns all three caches of a QSA layer:
- main K/V and compressed keys: one `FullAttentionSpec` page [Hkv, page_size, 2D] (K and V
  side by side) followed by the block's page_size / r compressed rows of Di (row = main slot // r);
  with an fp8 KV cache (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`) the K/V half is vLLM's
  uint8 storage, viewed as the core's float8 dtype, with the layer's per-tensor scales;
- raw-key ring: `CircularBufferSpec(block_size=C)`, a group of its own, one block per request;
  for MRoPE each block's C rows of Di are followed by their int64 [C, 3] RoPE positions (the
  first token of an open group may come from an earlier step, design.md §6.2).
All QSA backends declare block-outermost layouts (mixed page sizes in several groups need
them), so one block holds every layer's page; the core's paged views keep vLLM's block
strides (core page = vLLM block), with no renumbering.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
)

from qsa_core import QSAConfig, QSALayerCache, resolve_dtype, ring_capacity, validate_layer_cache

from .context import register_layer
from .metadata import PagedGeometry


def speculative_tokens(vllm_config: VllmConfig) -> int:
    """Draft tokens per step (0 without speculative decoding): sizes the ring."""
    spec = vllm_config.speculative_config
    return int(spec.num_speculative_tokens or 0) if spec is not None else 0


# vLLM's fp8 --kv-cache-dtype values and the core's kv_cache_dtype for each: vLLM's "fp8" is
# e4m3 (its CacheConfig, its CUDA kernels and upstream's QSA; the CPU attention takes the
# same names). vLLM stores every one of them as uint8 pages.
FP8_KV_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
SERVED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", *FP8_KV_CACHE_DTYPES)


def core_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The core's `QSAConfig.kv_cache_dtype` for vLLM's `cache_config.cache_dtype`
    (`--kv-cache-dtype`), or a ValueError naming the flag and the values served."""
    if cache_dtype in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[cache_dtype]
    if cache_dtype == "auto" or (cache_dtype == "float32" and model_dtype == torch.float32):
        return "auto"
    if cache_dtype == "bfloat16":
        return "auto" if model_dtype == torch.bfloat16 else "bf16"
    raise ValueError(
        f"QSA_CORE does not serve --kv-cache-dtype {cache_dtype} with a {model_dtype} model: its main K/V "
        f"path serves {', '.join(SERVED_KV_CACHE_DTYPES)} (float32 only for a float32 model)"
    )


def check_kv_cache_settings(vllm_config: VllmConfig, quant_config=None) -> None:
    """Refuse, naming the flag, the KV-cache settings the core-backed QSA layers do not serve:
    a `--kv-cache-dtype` outside `SERVED_KV_CACHE_DTYPES`, per-layer fp8 exceptions
    (`--kv-cache-dtype-skip-layers`: the main K/V pages of all QSA layers share one dtype
    here) and a checkpoint's KV-cache quantization scheme (as upstream refuses it)."""
    cache = vllm_config.cache_config
    kv = core_kv_cache_dtype(cache.cache_dtype, vllm_config.model_config.dtype)
    if kv.startswith("fp8") and cache.kv_cache_dtype_skip_layers:
        raise ValueError(
            f"QSA_CORE does not serve --kv-cache-dtype-skip-layers ({cache.kv_cache_dtype_skip_layers}) with "
            f"--kv-cache-dtype {cache.cache_dtype}: every QSA layer's main K/V is fp8 or none is"
        )
    quant = quant_config if quant_config is not None else getattr(vllm_config, "quant_config", None)
    if getattr(quant, "kv_cache_scheme", None) is not None:
        raise ValueError(
            "QSA_CORE does not serve the checkpoint's quantization_config.kv_cache_scheme (KV-cache quantization "
            "scheme): fp8 KV with per-tensor k_scale / v_scale is served through --kv-cache-dtype fp8"
        )


def checked_kv_scale(name: str, scale: torch.Tensor) -> float:
    """A layer's per-tensor fp8 K or V scale (a one-element tensor) as a positive finite float:
    read once after the weights load (a host read), never per step."""
    if scale.numel() != 1:
        raise ValueError(f"{name} must be one per-tensor scale, got shape {tuple(scale.shape)}")
    value = float(scale.item())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite scale, got {value}")
    return value


def kv_storage_dtype(config: QSAConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of vLLM's main K/V pages: uint8 for an fp8 cache (as vLLM and upstream's QSA
    allocate fp8 pages; `bind_layer_cache` views them as the float8 dtype), else the cache dtype."""
    dtype = resolve_dtype(config.kv_cache_dtype, model_dtype)
    return torch.uint8 if dtype.itemsize == 1 else dtype


def main_kv_spec(
    vllm_config: VllmConfig, config: QSAConfig, dtype: torch.dtype, index_dtype: torch.dtype
) -> FullAttentionSpec:
    """Main K/V [Hkv, page_size, 2D] per block (K then V in the last dim; `dtype` the model
    dtype, the pages `kv_storage_dtype`), followed in the same page by the block's compressed
    keys [page_size / r, Di] (`index_dtype`).

    The compressed rows ride in the page's padding (`page_size_padded`), so they share the
    main block table and prefix-cache blocks by construction: a separate spec lands in a KV-cache
    group of its own with other block ids when vLLM groups a hybrid model. Made when vLLM
    asks, from the block size it has settled on (design.md §6.11).
    """
    block_size = vllm_config.cache_config.block_size
    if block_size % config.compress_ratio:
        raise ValueError(
            f"cache_config.block_size ({block_size}) must be a multiple of compress_ratio "
            f"({config.compress_ratio})"
        )
    storage = kv_storage_dtype(config, dtype)
    main_bytes = block_size * config.num_kv_heads * 2 * config.head_dim * storage.itemsize
    compressed_bytes = block_size // config.compress_ratio * config.index_head_dim * index_dtype.itemsize
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_dim,
        head_size_v=config.head_dim,
        dtype=storage,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR if storage == torch.uint8 else KVQuantMode.NONE,
        page_size_padded=main_bytes + compressed_bytes,
    )


def compressed_view(kv_cache: torch.Tensor, config: QSAConfig, index_dtype: torch.dtype) -> torch.Tensor:
    """The compressed keys [B, 1, page / r, Di] behind the main K/V of each block of vLLM's
    main view kv_cache [B, Hkv, page, 2D] (see `main_kv_spec`)."""
    B, Hkv, page, D2 = kv_cache.shape
    item = kv_cache.element_size()
    main_bytes = Hkv * page * D2 * item
    rows, Di = page // config.compress_ratio, config.index_head_dim
    block_bytes = kv_cache.stride(0) * item
    if block_bytes < main_bytes + rows * Di * index_dtype.itemsize:
        raise ValueError(
            f"main K/V blocks ({block_bytes} bytes apart) leave no room for {rows} compressed rows "
            "after the K/V page: the cache was not allocated from main_kv_spec"
        )
    raw = kv_cache.view(torch.uint8)  # the same storage, byte-addressed
    region = raw.as_strided(
        (B, rows * Di * index_dtype.itemsize), (block_bytes, 1), raw.storage_offset() + main_bytes
    )
    return region.view(index_dtype).unflatten(-1, (1, rows, Di))


def ring_spec(vllm_config: VllmConfig, config: QSAConfig, dtype: torch.dtype) -> CircularBufferSpec:
    """Raw-key ring: one block of C = r * ceil((r + num_spec) / r) rows of Di per request,
    and for MRoPE the rows' int64 [C, 3] positions in the block's padding (`page_size_padded`,
    as the compressed keys ride in the main page's: vLLM allocates and rebinds them with the ring).

    C must divide the block size vLLM has settled on: the ring's block size joins the least
    common multiple that sets the scheduler's block size.
    """
    C = ring_capacity(config.compress_ratio, speculative_tokens(vllm_config))
    block_size = vllm_config.cache_config.block_size
    if block_size % C:
        raise ValueError(
            f"cache_config.block_size ({block_size}) must be a multiple of the QSA ring capacity {C} "
            f"(r = {config.compress_ratio}, {speculative_tokens(vllm_config)} speculative tokens)"
        )
    padded = None
    if config.uses_mrope:
        padded = C * config.index_head_dim * dtype.itemsize + C * 3 * torch.int64.itemsize
    return CircularBufferSpec(
        block_size=C, num_kv_heads=1, head_size=config.index_head_dim, head_size_v=0, dtype=dtype,
        page_size_padded=padded,
    )


def ring_positions_view(ring: torch.Tensor) -> torch.Tensor:
    """The int64 [B, C, 3] RoPE positions behind the C raw-key rows of each block of vLLM's
    ring view ring [B, 1, C, Di] (see `ring_spec`)."""
    B, _, C, Di = ring.shape
    item = ring.element_size()
    rows_bytes, positions_bytes = C * Di * item, C * 3 * torch.int64.itemsize
    block_bytes = ring.stride(0) * item
    if block_bytes < rows_bytes + positions_bytes or rows_bytes % torch.int64.itemsize:
        raise ValueError(
            f"ring blocks ({block_bytes} bytes apart) leave no room for {C} int64 [3] positions after the "
            f"{rows_bytes} bytes of raw keys: the ring was not allocated from ring_spec of an MRoPE config"
        )
    raw = ring.view(torch.uint8)  # the same storage, byte-addressed
    region = raw.as_strided((B, positions_bytes), (block_bytes, 1), raw.storage_offset() + rows_bytes)
    return region.view(torch.int64).unflatten(-1, (C, 3))


def mtp_ring_prefixes(vllm_config: VllmConfig, text_config) -> list[str]:
    """The ring names of the MTP draft's QSA layers (`Qwen4ExpMTP` builds its layer i as
    `mtp.layers.{num_hidden_layers + i}`), or none without MTP speculative decoding."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "mtp":
        return []
    first, count = int(text_config.num_hidden_layers), int(getattr(text_config, "mtp_num_hidden_layers", 1))
    return [f"mtp.layers.{first + i}.self_attn.indexer.raw_key_cache" for i in range(count)]


class QSASideCache(nn.Module, AttentionLayerBase):
    """The QSA side cache that vLLM allocates and binds per layer: the raw-key ring.

    Registers itself in `static_forward_context[prefix]`. Its spec is made by
    `make_spec(vllm_config)` each time vLLM asks, so it follows the block size vLLM has
    settled on by then (design.md §6.11: vLLM raises it for hybrid models after the model is
    built). After binding, `kv_cache` is vLLM's view [num_blocks, 1, rows per block, Di].
    """

    def __init__(
        self, *, vllm_config: VllmConfig, make_spec: Callable[[VllmConfig], KVCacheSpec], prefix: str
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.make_spec = make_spec
        self.spec: KVCacheSpec | None = None
        self.kv_cache = torch.tensor([])
        self.for_draft = False
        register_layer(vllm_config, prefix, self)

    @classmethod
    def for_draft_layer(
        cls, *, vllm_config: VllmConfig, make_spec: Callable[[VllmConfig], KVCacheSpec], prefix: str
    ) -> "QSASideCache":
        """The ring of a draft (MTP) layer, registered by the target model while it is built.

        vLLM's proposer builds the draft layers' metadata from one KV-cache group (it asserts
        "All drafting layers should belong to the same kv cache group"), which is the main
        K/V's. Registered before the draft model loads, the ring counts as a target layer:
        vLLM allocates it in the rings' group, each target step's ring blocks address it,
        and the draft's indexer adopts it (`adopt`).
        """
        ring = cls(vllm_config=vllm_config, make_spec=make_spec, prefix=prefix)
        ring.for_draft = True
        return ring

    @staticmethod
    def adopt(vllm_config: VllmConfig, prefix: str) -> "QSASideCache | None":
        """The ring the target model registered for the draft layer at `prefix`, if any."""
        found = vllm_config.compilation_config.static_forward_context.get(prefix)
        return found if isinstance(found, QSASideCache) and found.for_draft else None

    def get_attn_backend(self):
        from .backend import QSACoreBackend

        return QSACoreBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        self.spec = self.make_spec(vllm_config)
        return self.spec

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if self.spec is None:
            raise RuntimeError(f"{self.prefix}: bound before vLLM asked for its KV-cache spec")
        want = (1, self.spec.num_states, self.spec.head_size)
        if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != want or kv_cache.dtype != self.spec.dtype:
            raise ValueError(
                f"{self.prefix}: cache must be [blocks, {want[0]}, {want[1]}, {want[2]}] {self.spec.dtype}, "
                f"got {tuple(kv_cache.shape)} {kv_cache.dtype}"
            )
        self.kv_cache = kv_cache


def bind_layer_cache(
    kv_cache: torch.Tensor, ring: torch.Tensor, config: QSAConfig, index_dtype: torch.dtype, dtype: torch.dtype,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[QSALayerCache, PagedGeometry]:
    """The core's cache views of one QSA layer over vLLM's two bound tensors.

    kv_cache [B, Hkv, page, 2D] (compressed keys behind each page, viewed as index_dtype;
    an fp8 cache's uint8 K/V viewed as the config's float8 dtype, same bytes);
    ring [B, 1, C, Di] (for MRoPE with its rows' positions behind, `ring_positions_view`);
    dtype: the model dtype; k_scale / v_scale: the layer's per-tensor fp8 scales (floats read
    once after loading: the core stores K / k_scale and folds k_scale into the softmax scale).
    Returns the views and the `PagedGeometry` the step metadata must use with them.
    """
    kv_dtype = resolve_dtype(config.kv_cache_dtype, dtype)
    if kv_cache.dtype == torch.uint8 and kv_dtype.itemsize == 1:
        kv_cache = kv_cache.view(kv_dtype)  # vLLM's fp8 storage: the same bytes and strides
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be a positive finite float (the layer's _{name}_float), got {scale!r}")
    page = kv_cache.shape[2]
    compressed = compressed_view(kv_cache, config, index_dtype)
    rows_per_page = page // config.compress_ratio
    if compressed.shape[2] != rows_per_page:
        raise ValueError(
            f"compressed cache must hold page_size / r = {rows_per_page} rows per block, got {compressed.shape[2]}"
        )
    # Core page = vLLM block for all three caches: the views keep vLLM's block strides.
    D = kv_cache.shape[3] // 2
    k, v = kv_cache[..., :D].transpose(1, 2), kv_cache[..., D:].transpose(1, 2)
    C = ring.shape[2]
    geometry = PagedGeometry(compress_ratio=config.compress_ratio, page_size=page, ring_capacity=C)
    positions = ring_positions_view(ring) if config.uses_mrope else None
    cache = QSALayerCache(k=k, v=v, compressed=compressed[:, 0], ring=ring[:, 0], ring_positions=positions,
                          k_scale=k_scale, v_scale=v_scale)
    validate_layer_cache(cache, config, page, ring_capacity=C, dtype=dtype)
    return cache, geometry
