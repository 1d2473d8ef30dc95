"""`QSAConfig`: the geometry of one QSA layer (design.md §1), validated once at load."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Literal

from typing import NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

IndexDType = Literal["auto", "bf16", "fp8_e4m3"]
KVDType = Literal["auto", "bf16", "fp8_e4m3", "fp8_e5m2"]

_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


# Where `from_hf` reads each field: errors name the HF field the user set.
HF_FIELDS = {
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "index_n_heads": "indexer_n_heads",
    "index_kv_heads": "indexer_kv_heads",
    "index_head_dim": "indexer_head_dim",
    "token_topk": "indexer_budget",
    "compress_ratio": "indexer_compress_ratio",
    "rotary_dim": "head_dim * rope_parameters.partial_rotary_factor",
    "rope_theta": "rope_parameters.rope_theta",
    "mrope_section": "rope_parameters.mrope_section",
    "rms_norm_eps": "rms_norm_eps",
    "attention_bias": "attention_bias",
}


def _field_name(field: str, info: ValidationInfo | None) -> str:
    """`field`, or `hf_name [field]` when validating a config read by `from_hf`."""
    names = (info.context or {}).get("hf_fields", {}) if info is not None else {}
    return f"{names[field]} [{field}]" if field in names else field


class QSAHeadShard(NamedTuple):
    """The model's heads one tensor-parallel rank holds: query heads and KV heads (ranges of
    the model's head indices; KV heads are shared by `tp_size / num_kv_heads` ranks when
    tp_size > num_kv_heads)."""

    query_heads: range
    kv_heads: range


def resolve_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map a cache dtype name ("auto" = the model dtype) to a torch dtype."""
    return model_dtype if name == "auto" else _TORCH_DTYPES[name]


class QSAConfig(BaseModel):
    """Geometry of a QSA layer. Field names follow design.md; `from_hf` reads a HF config."""

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
    def _check(self, info: ValidationInfo) -> "QSAConfig":
        n = lambda field: _field_name(field, info)  # noqa: E731
        if self.compress_ratio < 2:
            raise ValueError(f"{n('compress_ratio')} must be >= 2, got {self.compress_ratio}")
        if self.token_topk % self.compress_ratio:
            raise ValueError(
                f"{n('token_topk')} ({self.token_topk}) must be divisible by {n('compress_ratio')} "
                f"({self.compress_ratio})"
            )
        if self.index_kv_heads != 1:
            raise ValueError(f"{n('index_kv_heads')} must be 1 for QSA, got {self.index_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{n('num_heads')} ({self.num_heads}) must be divisible by {n('num_kv_heads')} "
                f"({self.num_kv_heads})"
            )
        if self.rotary_dim % 2:
            raise ValueError(f"{n('rotary_dim')} must be even, got {self.rotary_dim}")
        if self.rotary_dim > self.index_head_dim:
            raise ValueError(
                f"{n('rotary_dim')} ({self.rotary_dim}) must be <= {n('index_head_dim')} ({self.index_head_dim})"
            )
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"{n('rotary_dim')} ({self.rotary_dim}) must be <= {n('head_dim')} ({self.head_dim})")
        if self.mrope_section is not None and min(self.mrope_section) < 0:
            raise ValueError(f"{n('mrope_section')} must be non-negative, got {self.mrope_section}")
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

    def head_shard(self, tp_size: int, rank: int) -> QSAHeadShard:
        """The heads of rank `rank` of `tp_size`, split as vLLM's and SGLang's QKVParallelLinear
        split them: query heads in contiguous blocks of Hq / tp; KV heads in blocks of Hkv / tp
        when tp <= Hkv, else one KV head per rank, head rank // (tp / Hkv) (each KV head
        replicated on tp / Hkv consecutive ranks). The indexer is not split: its projection,
        norms and one key head are whole on every rank, so every rank selects the same tokens.
        """
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < tp_size:
            raise ValueError(f"rank must be in [0, tp_size = {tp_size}), got {rank!r}")
        Hq, Hkv = self.num_heads, self.num_kv_heads
        if Hq % tp_size:
            raise ValueError(f"num_heads ({Hq}) must be divisible by tp_size ({tp_size})")
        if Hkv >= tp_size and Hkv % tp_size:
            raise ValueError(f"num_kv_heads ({Hkv}) must be divisible by tp_size ({tp_size})")
        if Hkv < tp_size and tp_size % Hkv:
            raise ValueError(
                f"tp_size ({tp_size}) must be divisible by num_kv_heads ({Hkv}) to replicate KV heads"
            )
        q = Hq // tp_size
        if Hkv >= tp_size:
            kv = Hkv // tp_size
            kv_heads = range(rank * kv, (rank + 1) * kv)
        else:
            head = rank // (tp_size // Hkv)
            kv_heads = range(head, head + 1)
        return QSAHeadShard(range(rank * q, (rank + 1) * q), kv_heads)

    def for_rank(self, tp_size: int, rank: int) -> "QSAConfig":
        """The geometry of rank `rank` of `tp_size` (`head_shard`'s head counts, the rest
        unchanged): what a rank's `QSAPlanner`, caches and layer are built from. Each of its
        query heads reads the same KV head as in the model."""
        shard = self.head_shard(tp_size, rank)
        if tp_size == 1:
            return self
        return QSAConfig(**{**self.model_dump(), "num_heads": len(shard.query_heads), "num_kv_heads": len(shard.kv_heads)})

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
        absent = [k for k in ("hidden_size", "num_attention_heads") if config.get(k) is None]
        if absent:
            raise ValueError(f"config is missing required fields {absent}")
        rope = dict(config.get("rope_parameters") or {})
        if "rope_theta" not in rope and "rope_theta" in config:
            rope["rope_theta"] = config["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type must be 'default', got {rope_type!r}")
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim is None:
            if not isinstance(config["hidden_size"], int) or not isinstance(num_heads, int) or num_heads <= 0:
                raise ValueError(
                    "head_dim is not set and hidden_size / num_attention_heads must then be positive "
                    f"integers, got {config['hidden_size']!r} / {num_heads!r}"
                )
            head_dim = config["hidden_size"] // num_heads
        factor = rope.get("partial_rotary_factor", 1.0)
        rotary = head_dim * factor if isinstance(head_dim, int) and isinstance(factor, (int, float)) else None
        if rotary is None or rotary != int(rotary):
            raise ValueError(
                f"rope_parameters.partial_rotary_factor ({factor!r}) * head_dim ({head_dim!r}) must be a "
                f"whole number of rotary dims, got {rotary!r}"
            )
        section = rope.get("mrope_section")
        fields: dict[str, Any] = dict(
            hidden_size=config["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            index_n_heads=config["indexer_n_heads"],
            index_kv_heads=config.get("indexer_kv_heads") or 1,
            index_head_dim=config["indexer_head_dim"],
            token_topk=config["indexer_budget"],
            compress_ratio=config["indexer_compress_ratio"],
            rotary_dim=int(rotary),
            rope_theta=rope.get("rope_theta", 10000.0),
            mrope_section=tuple(section) if section else None,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            attention_bias=config.get("attention_bias", False),
        )
        fields.update(overrides)
        hf_fields = {k: v for k, v in HF_FIELDS.items() if k not in overrides}
        try:
            return cls.model_validate(fields, context={"hf_fields": hf_fields})
        except ValidationError as e:
            raise ValueError(f"invalid QSA geometry in the HF config: {_describe(e, hf_fields)}") from None

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def _describe(error: ValidationError, hf_fields: dict[str, str]) -> str:
    """One line per pydantic error, each naming the HF field (and the QSAConfig field)."""
    parts = []
    for err in error.errors(include_url=False):
        msg = err["msg"].removeprefix("Value error, ")
        if err["loc"]:
            field = str(err["loc"][0])
            name = f"{hf_fields[field]} [{field}]" if field in hf_fields else field
            msg = f"{name}: {msg} (value {err['input']!r})"
        parts.append(msg)
    return "; ".join(parts)
