"""`QSAStepInputs`: the one definition of what an engine supplies for a forward step.

SPEC.md section 3: a few tensors that every engine has in some form, plus the host ints the
engine already knows (no device reads). Page size and ring capacity are engine geometry,
fixed once: they belong to `QSAPlanner`, not to a step.

`validate` checks shapes, dtypes and devices only (microseconds, no tensor reads);
`check_values` reads the tensors (a device sync) and runs only with `QSA_DEBUG=1`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def debug_enabled() -> bool:
    """`QSA_DEBUG=1`: run the value checks of every step (they sync the device)."""
    return os.environ.get("QSA_DEBUG", "0") not in ("", "0")


def _expect(name: str, t: object, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


@dataclass(frozen=True, kw_only=True)
class QSAStepInputs:
    """One step as an engine describes it. Rows: decode requests first, then prefills.

    query_start_loc int32 [R+1]: row offsets of each request's query tokens.
    seq_lens int32 [R]: context + this step's tokens per request.
    block_table int32 [>= R, P] (any strides): request page -> physical page, -1 = none.
    slot_mapping int64 [T]: main KV slot per row, -1 = do not write (padding).
    ring_index int32 [R]: per-request base row of the raw-key ring.
    num_decodes: leading requests that are decodes, each with decode_query_len rows (or 0
    rows: a CUDA-graph padding request). max_query_len / max_seq_len: bounds over the
    requests; max_seq_len is the column bound of selection (a request above it is made inert
    and flagged, never truncated). num_padding_rows: trailing rows past query_start_loc[R].
    rope_positions int64 [T] or [3, T] (MRoPE); None = the logical positions.
    seq_lens_cpu: optional host copy of seq_lens (int [R], CPU) that the engine already has;
    with it the max_seq_len bound is checked on every step, with no device read.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    ring_index: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    decode_query_len: int = 1
    num_padding_rows: int = 0
    rope_positions: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        """Rows T, padding rows included."""
        return self.slot_mapping.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.decode_query_len

    def validate(self, device: torch.device) -> None:
        """Shapes, dtypes, devices and host ints (no tensor reads)."""
        R, T = self.num_reqs, self.num_tokens
        _expect("query_start_loc", self.query_start_loc, torch.int32, 1, device)
        _expect("seq_lens", self.seq_lens, torch.int32, 1, device)
        _expect("block_table", self.block_table, torch.int32, 2, device)
        _expect("slot_mapping", self.slot_mapping, torch.int64, 1, device)
        _expect("ring_index", self.ring_index, torch.int32, 1, device)
        if self.query_start_loc.shape[0] != R + 1:
            raise ValueError(
                f"query_start_loc must have num_reqs + 1 = {R + 1} entries, got {self.query_start_loc.shape[0]}"
            )
        if self.ring_index.shape[0] != R:
            raise ValueError(f"ring_index must have num_reqs = {R} entries, got {self.ring_index.shape[0]}")
        if self.block_table.shape[0] < R:
            raise ValueError(f"block_table must have >= num_reqs = {R} rows, got {self.block_table.shape[0]}")
        rp = self.rope_positions
        if rp is not None and (
            not isinstance(rp, torch.Tensor) or rp.dtype != torch.int64 or rp.device != device
            or rp.dim() not in (1, 2) or rp.shape[-1] != T or (rp.dim() == 2 and rp.shape[0] != 3)
        ):
            got = f"{rp.dtype} {tuple(rp.shape)} on {rp.device}" if isinstance(rp, torch.Tensor) else type(rp).__name__
            raise ValueError(f"rope_positions must be int64 [{T}] or [3, {T}] on {device}, got {got}")
        for name in ("num_decodes", "max_query_len", "max_seq_len", "num_padding_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_query_len < 1:
            raise ValueError(f"decode_query_len must be >= 1, got {self.decode_query_len}")
        if self.num_padding_rows > T:
            raise ValueError(f"num_padding_rows ({self.num_padding_rows}) must be <= num_tokens ({T})")
        if self.num_decodes > R:
            raise ValueError(f"num_decodes ({self.num_decodes}) must be <= num_reqs ({R})")
        if self.num_decode_tokens > T:
            raise ValueError(f"num_decodes * decode_query_len = {self.num_decode_tokens} exceeds num_tokens ({T})")
        host = self.seq_lens_cpu
        if host is not None and R and int(host.max()) > self.max_seq_len:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) is below a request's seq_len ({int(host.max())}): it bounds "
                "the groups selection scores, so such a request would be cut off"
            )

    def check_values(self, page_size: int, num_slots: int | None = None, num_ring_rows: int | None = None) -> None:
        """Value checks that read the tensors (debug only: forces a device sync)."""
        qsl = self.query_start_loc.cpu().long()
        seq = self.seq_lens.cpu().long()
        qlen = qsl[1:] - qsl[:-1]
        T = self.num_tokens
        if self.num_reqs and int(qsl[0]) != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
        if bool((qlen < 0).any()):
            raise ValueError("query_start_loc must be non-decreasing")
        if int(qsl[-1]) != T - self.num_padding_rows:
            raise ValueError(
                f"query_start_loc[-1] must equal num_tokens - num_padding_rows = "
                f"{T - self.num_padding_rows}, got {int(qsl[-1])}"
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
            need_pages = (seq + page_size - 1) // page_size
            if int(need_pages.max()) > self.block_table.shape[1]:
                raise ValueError("block_table has fewer pages than a request's seq_len needs")
