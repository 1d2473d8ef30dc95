"""`QSAConfig`: the geometry of one QSA layer (SPEC.md section 1), validated once at load."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

IndexDType = Literal["auto", "bf16", "fp8_e4m3"]
KVDType = Literal["auto", "bf16", "fp8_e4m3", "fp8_e5m2"]

_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map a cache dtype name ("auto" = the model dtype) to a torch dtype."""
    return model_dtype if name == "auto" else _TORCH_DTYPES[name]


class QSAConfig(BaseModel):
    """Geometry of a QSA layer. Field names follow SPEC.md; `from_hf` reads a HF config."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0, description="main query heads Hq")
    num_kv_heads: int = Field(gt=0, description="main KV heads Hkv")
    head_dim: int = Field(gt=0, description="main head dim D")
    index_n_heads: int = Field(gt=0, description="indexer query heads Hi")
    index_kv_heads: int = Field(1, description="indexer key heads; QSA requires 1")
    index_head_dim: int = Field(gt=0, description="indexer head dim Di")
    token_topk: int = Field(gt=0, description="token budget K (indexer_budget)")
    compress_ratio: int = Field(description="tokens per group r (indexer_compress_ratio)")
    rotary_dim: int = Field(gt=0, description="leading dims that get NeoX RoPE (Rd)")
    rope_theta: float = Field(gt=0)
    mrope_section: tuple[int, int, int] | None = Field(
        None, description="interleaved MRoPE sections (T, H, W) in frequency pairs"
    )
    rms_norm_eps: float = Field(1e-6, gt=0)
    attention_bias: bool = False
    index_dtype: IndexDType = Field("auto", description="compressed-key / indexer-query dtype")
    kv_cache_dtype: KVDType = Field("auto", description="main KV cache dtype")

    @model_validator(mode="after")
    def _check(self) -> "QSAConfig":
        if self.compress_ratio < 2:
            raise ValueError(f"compress_ratio must be >= 2, got {self.compress_ratio}")
        if self.token_topk % self.compress_ratio:
            raise ValueError(
                f"token_topk ({self.token_topk}) must be divisible by compress_ratio "
                f"({self.compress_ratio})"
            )
        if self.index_kv_heads != 1:
            raise ValueError(f"index_kv_heads must be 1 for QSA, got {self.index_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")
        if self.rotary_dim > self.index_head_dim:
            raise ValueError(
                f"rotary_dim ({self.rotary_dim}) must be <= index_head_dim ({self.index_head_dim})"
            )
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be <= head_dim ({self.head_dim})")
        if self.mrope_section is not None and min(self.mrope_section) < 0:
            raise ValueError(f"mrope_section must be non-negative, got {self.mrope_section}")
        return self

    @property
    def block_topk(self) -> int:
        """Kb = K / r: groups chosen per query row."""
        return self.token_topk // self.compress_ratio

    @property
    def selection_width(self) -> int:
        """W = K + r - 1: token columns of a selection row."""
        return self.token_topk + self.compress_ratio - 1

    @property
    def packed_width(self) -> int:
        """W + 1: selection columns plus the trailing count column."""
        return self.selection_width + 1

    @property
    def uses_mrope(self) -> bool:
        return self.mrope_section is not None

    def inv_freq(self) -> torch.Tensor:
        """[Rd/2] fp32 inverse frequencies of the default RoPE."""
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        return 1.0 / (self.rope_theta**exponent)

    def rope_axes(self) -> torch.Tensor:
        """[Rd/2] int32: which position axis (0 T, 1 H, 2 W) drives each frequency.

        Interleaved MRoPE as in the HF reference: frequency j < 3*sec[1] with j % 3 == 1 uses
        H, j < 3*sec[2] with j % 3 == 2 uses W, every other frequency uses T.
        """
        j = torch.arange(self.rotary_dim // 2)
        axes = torch.zeros_like(j)
        if self.mrope_section is not None:
            axes[(j % 3 == 1) & (j < 3 * self.mrope_section[1])] = 1
            axes[(j % 3 == 2) & (j < 3 * self.mrope_section[2])] = 2
        return axes.to(torch.int32)

    @classmethod
    def from_hf(cls, config: Any, **overrides: Any) -> "QSAConfig":
        """Build from a transformers `Qwen4ExpTextConfig`, its dict, or a config.json path.

        A composite `Qwen4ExpConfig` (or dict with `text_config`) is unwrapped. `overrides`
        set the cache dtypes (`index_dtype`, `kv_cache_dtype`), which HF does not carry.
        """
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        if not isinstance(config, dict):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        if "text_config" in config and "indexer_n_heads" not in config:
            config = config["text_config"]
            if not isinstance(config, dict):
                config = config.to_dict()
        missing = [
            k
            for k in ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
            if config.get(k) is None
        ]
        if missing:
            raise ValueError(f"config has no QSA profile: missing {missing}")
        rope = dict(config.get("rope_parameters") or {})
        if "rope_theta" not in rope and "rope_theta" in config:
            rope["rope_theta"] = config["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type must be 'default', got {rope_type!r}")
        num_heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // num_heads
        rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        section = rope.get("mrope_section")
        fields: dict[str, Any] = dict(
            hidden_size=int(config["hidden_size"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            index_n_heads=int(config["indexer_n_heads"]),
            index_kv_heads=int(config.get("indexer_kv_heads") or 1),
            index_head_dim=int(config["indexer_head_dim"]),
            token_topk=int(config["indexer_budget"]),
            compress_ratio=int(config["indexer_compress_ratio"]),
            rotary_dim=rotary_dim,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            mrope_section=tuple(int(s) for s in section) if section else None,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(config.get("attention_bias", False)),
        )
        fields.update(overrides)
        return cls(**fields)

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)
