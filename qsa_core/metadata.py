"""`QSAForwardMetadata`: one record per forward step, built once and shared by every QSA layer.

The builder takes the few engine inputs of SPEC.md section 3 and derives everything else on
the inputs' device with the metadata-build op. Validation (shapes, dtypes, devices, the
decode/prefill split) runs once per build and never reads tensor values; value checks run
only with `QSA_DEBUG=1` (they sync the device).
"""

from __future__ import annotations

import os

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import ops


def debug_enabled() -> bool:
    return os.environ.get("QSA_DEBUG", "0") not in ("", "0")


def _expect(name: str, t: torch.Tensor, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


class QSAForwardMetadata(BaseModel):
    """Everything a QSA layer needs about one step. Rows: decodes first, then prefills.

    Engine inputs: query_start_loc int32 [R+1], seq_lens int32 [R] (context + this step),
    block_table int32 [R, P] (any strides), slot_mapping int64 [T] (-1 = no write),
    ring_index int32 [R], rope_positions int64 [T] or [3, T].
    Derived (all [T]): token_to_req int32, positions int64 (logical; -1 = padding),
    visible_blocks int32, ring_slot int64, compressed_slot int64 (-1 = no write).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    compress_ratio: int = Field(ge=2)
    page_size: int = Field(gt=0)
    ring_capacity: int = Field(gt=0)
    num_tokens: int = Field(ge=0, description="rows T, padding included")
    num_padding_rows: int = Field(ge=0)
    num_reqs: int = Field(ge=0)
    num_decodes: int = Field(ge=0)
    decode_query_len: int = Field(ge=1)
    max_query_len: int = Field(ge=0)
    max_seq_len: int = Field(ge=0)

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    ring_index: torch.Tensor
    rope_positions: torch.Tensor

    token_to_req: torch.Tensor
    positions: torch.Tensor
    visible_blocks: torch.Tensor
    ring_slot: torch.Tensor
    compressed_slot: torch.Tensor

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.decode_query_len

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        """Rows after the decode rows (trailing padding rows included)."""
        return self.num_tokens - self.num_decode_tokens

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    @model_validator(mode="after")
    def _check(self) -> "QSAForwardMetadata":
        dev = self.slot_mapping.device
        R, T = self.num_reqs, self.num_tokens
        _expect("query_start_loc", self.query_start_loc, torch.int32, 1, dev)
        _expect("seq_lens", self.seq_lens, torch.int32, 1, dev)
        _expect("block_table", self.block_table, torch.int32, 2, dev)
        _expect("slot_mapping", self.slot_mapping, torch.int64, 1, dev)
        _expect("ring_index", self.ring_index, torch.int32, 1, dev)
        if self.query_start_loc.shape[0] != R + 1:
            raise ValueError(f"query_start_loc must have num_reqs + 1 = {R + 1} entries, got {self.query_start_loc.shape[0]}")
        for name in ("seq_lens", "ring_index"):
            if getattr(self, name).shape[0] != R:
                raise ValueError(f"{name} must have num_reqs = {R} entries, got {getattr(self, name).shape[0]}")
        if self.block_table.shape[0] < R:
            raise ValueError(f"block_table must have >= num_reqs = {R} rows, got {self.block_table.shape[0]}")
        if self.page_size % self.compress_ratio:
            raise ValueError(
                f"page_size ({self.page_size}) must be a multiple of compress_ratio ({self.compress_ratio})"
            )
        rp = self.rope_positions
        if rp.dtype != torch.int64 or rp.device != dev or rp.dim() not in (1, 2) or rp.shape[-1] != T or (
            rp.dim() == 2 and rp.shape[0] != 3
        ):
            raise ValueError(f"rope_positions must be int64 [{T}] or [3, {T}] on {dev}, got {rp.dtype} {tuple(rp.shape)}")
        if self.num_padding_rows > T:
            raise ValueError(f"num_padding_rows ({self.num_padding_rows}) must be <= num_tokens ({T})")
        if self.num_decodes > R:
            raise ValueError(f"num_decodes ({self.num_decodes}) must be <= num_reqs ({R})")
        if self.num_decode_tokens > T:
            raise ValueError(
                f"num_decodes * decode_query_len = {self.num_decode_tokens} exceeds num_tokens ({T})"
            )
        return self

    def check_values(self, num_slots: int | None = None, num_ring_rows: int | None = None) -> None:
        """Value checks that read the tensors (debug only: forces a device sync)."""
        qsl = self.query_start_loc.cpu().long()
        seq = self.seq_lens.cpu().long()
        qlen = qsl[1:] - qsl[:-1]
        if self.num_reqs and int(qsl[0]) != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
        if bool((qlen < 0).any()):
            raise ValueError("query_start_loc must be non-decreasing")
        if int(qsl[-1]) != self.num_tokens - self.num_padding_rows:
            raise ValueError(
                f"query_start_loc[-1] must equal num_tokens - num_padding_rows = "
                f"{self.num_tokens - self.num_padding_rows}, got {int(qsl[-1])}"
            )
        if bool((seq < qlen).any()):
            raise ValueError("seq_lens must be >= each request's query length (positions < seq_len)")
        dq = qlen[: self.num_decodes]
        if self.num_decodes and bool(((dq != self.decode_query_len) & (dq != 0)).any()):
            raise ValueError(
                f"the first num_decodes requests must each have decode_query_len = {self.decode_query_len} rows "
                "(or 0: a CUDA-graph padding request)"
            )
        if self.num_reqs and int(qlen.max()) > self.max_query_len:
            raise ValueError(f"max_query_len ({self.max_query_len}) is below a request's query length")
        if self.num_reqs and int(seq.max()) > self.max_seq_len:
            raise ValueError(f"max_seq_len ({self.max_seq_len}) is below a request's seq_len")
        slots = self.slot_mapping.cpu()
        if num_slots is not None and bool(((slots < -1) | (slots >= num_slots)).any()):
            raise ValueError(f"slot_mapping entries must be -1 or in [0, {num_slots})")
        ring = self.ring_index.cpu()
        if num_ring_rows is not None and bool(((ring < 0) | (ring >= num_ring_rows)).any()):
            raise ValueError(f"ring_index entries must be in [0, {num_ring_rows})")
        if self.num_reqs:
            need_pages = (seq + self.page_size - 1) // self.page_size
            if int(need_pages.max()) > self.block_table.shape[1]:
                raise ValueError("block_table has fewer pages than a request's seq_len needs")


class QSAMetadataBuilder:
    """Builds `QSAForwardMetadata` from engine inputs (vLLM builder / FlashInfer plan style).

    With `max_num_tokens`, the derived fields live in persistent buffers and `build` writes
    into them in place, so a CUDA graph captured on one step replays on the next.
    `num_slots` / `num_ring_rows` bound the slot and ring checks of `QSA_DEBUG=1`.
    """

    def __init__(
        self,
        compress_ratio: int,
        page_size: int,
        ring_capacity: int,
        device: torch.device | str = "cpu",
        max_num_tokens: int | None = None,
        num_slots: int | None = None,
        num_ring_rows: int | None = None,
    ) -> None:
        if page_size % compress_ratio:
            raise ValueError(f"page_size ({page_size}) must be a multiple of compress_ratio ({compress_ratio})")
        self.compress_ratio = compress_ratio
        self.page_size = page_size
        self.ring_capacity = ring_capacity
        self.device = torch.device(device)
        self.num_slots, self.num_ring_rows = num_slots, num_ring_rows
        self._buffers: dict[str, torch.Tensor] | None = None
        if max_num_tokens is not None:
            self._buffers = self._allocate(max_num_tokens)

    def _allocate(self, n: int) -> dict[str, torch.Tensor]:
        i32, i64 = dict(dtype=torch.int32, device=self.device), dict(dtype=torch.int64, device=self.device)
        return dict(
            token_to_req=torch.zeros(n, **i32),
            positions=torch.full((n,), -1, **i64),
            visible_blocks=torch.zeros(n, **i32),
            ring_slot=torch.full((n,), -1, **i64),
            compressed_slot=torch.full((n,), -1, **i64),
        )

    def build(
        self,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        ring_index: torch.Tensor,
        rope_positions: torch.Tensor | None = None,
        num_decodes: int,
        decode_query_len: int = 1,
        max_query_len: int,
        max_seq_len: int,
        num_padding_rows: int = 0,
    ) -> QSAForwardMetadata:
        """Derive and validate. Host ints come from the engine (no device reads here)."""
        T = slot_mapping.shape[0]
        if self._buffers is None:
            derived = self._allocate(T)
        else:
            cap = self._buffers["positions"].shape[0]
            if T > cap:
                raise ValueError(f"num_tokens ({T}) exceeds the builder's max_num_tokens ({cap})")
            derived = {k: v[:T] for k, v in self._buffers.items()}
        if rope_positions is None:
            rope_positions = derived["positions"]
        meta = QSAForwardMetadata(
            compress_ratio=self.compress_ratio,
            page_size=self.page_size,
            ring_capacity=self.ring_capacity,
            num_tokens=T,
            num_padding_rows=num_padding_rows,
            num_reqs=query_start_loc.shape[0] - 1,
            num_decodes=num_decodes,
            decode_query_len=decode_query_len,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            ring_index=ring_index,
            rope_positions=rope_positions,
            **derived,
        )
        ops.build_metadata(
            query_start_loc, seq_lens, slot_mapping, ring_index, self.compress_ratio, self.ring_capacity,
            derived["token_to_req"], derived["positions"], derived["visible_blocks"],
            derived["ring_slot"], derived["compressed_slot"],
        )
        if debug_enabled():
            meta.check_values(self.num_slots, self.num_ring_rows)
        return meta
