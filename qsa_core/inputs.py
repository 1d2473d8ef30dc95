"""`QSAStepInputs`: the one definition of what an engine supplies for a forward step.

design.md §3: a few tensors that every engine has in some form, plus the host ints the
engine already knows (no device reads). Page size and ring capacity are engine geometry,
fixed once: they belong to `QSAPlanner`, not to a step.

`validate` checks shapes, dtypes and devices only (microseconds, no tensor reads);
`check_values` reads the tensors: always for CPU tensors (no sync there), on a GPU only with
`QSA_DEBUG=1` (a device sync); there the metadata build's guards make bad rows inert.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def _expect(name: str, t: object, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _first_pair(index: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
    """(index[a], index[b]) of the first a < b with values[a] == values[b] (b smallest)."""
    seen: dict[int, int] = {}
    for i, v in zip(index.tolist(), values.tolist()):
        if v in seen:
            return seen[v], i
        seen[v] = i
    raise ValueError("no repeated value")


@dataclass(frozen=True, kw_only=True, init=False)
class QSAStepInputs:
    """One step as an engine describes it. Rows: decode requests first, then prefills.

    query_start_loc int32 [R+1]: row offsets of each request's query tokens.
    seq_lens int32 [R]: context + this step's tokens per request.
    block_table int32 [>= R, P] (any strides): request page -> physical page, -1 = none.
    slot_mapping int64 [T]: main KV slot per row, -1 = do not write (padding).
    ring_index int32 [R]: per-request base row of the raw-key ring (a planner's null_ring_row:
    a padding request the engine added, its rows inert).
    num_decodes: leading requests that are decodes, each with decode_query_len rows (or 0
    rows: a CUDA-graph padding request). max_query_len / max_seq_len: bounds over the
    requests; max_seq_len is the column bound of selection (a request above it is made inert
    and flagged, never truncated). num_padding_rows: trailing rows past query_start_loc[R].
    rope_positions int64 [T] or [3, T] (MRoPE); None = the logical positions.
    seq_lens_cpu: optional host copy of seq_lens (int32 or int64 [R], CPU) that the engine
    already has; with it the max_seq_len bound is checked on every step, with no device read.
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

    def __init__(
        self, *, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
        slot_mapping: torch.Tensor, ring_index: torch.Tensor, num_decodes: int, max_query_len: int,
        max_seq_len: int, decode_query_len: int = 1, num_padding_rows: int = 0,
        rope_positions: torch.Tensor | None = None, seq_lens_cpu: torch.Tensor | None = None,
    ) -> None:
        # One dict update instead of a frozen dataclass's object.__setattr__ per field: an
        # engine builds one of these every step, on the host's critical path.
        self.__dict__.update(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
            slot_mapping=slot_mapping, ring_index=ring_index, num_decodes=num_decodes,
            max_query_len=max_query_len, max_seq_len=max_seq_len, decode_query_len=decode_query_len,
            num_padding_rows=num_padding_rows, rope_positions=rope_positions, seq_lens_cpu=seq_lens_cpu,
        )

    # Cached: read several times per plan (a frozen dataclass keeps a __dict__ for them).
    @cached_property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @cached_property
    def num_tokens(self) -> int:
        """Rows T, padding rows included."""
        return self.slot_mapping.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.decode_query_len

    def validate(self, device: torch.device) -> None:
        """Shapes, dtypes, devices and host ints (no tensor reads)."""
        if not self._as_expected(device):  # the detailed checks name the field
            self._explain(device)
        R = self.num_reqs
        host = self.seq_lens_cpu
        if host is None:
            return
        if (not isinstance(host, torch.Tensor) or host.dtype not in (torch.int32, torch.int64)
                or host.device.type != "cpu" or tuple(host.shape) != (R,)):
            got = (f"{host.dtype} {tuple(host.shape)} on {host.device}" if isinstance(host, torch.Tensor)
                   else type(host).__name__)
            raise ValueError(f"seq_lens_cpu must be int32 or int64 [num_reqs = {R}] on cpu, got {got}")
        if R and int(host.max()) > self.max_seq_len:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) is below a request's seq_len ({int(host.max())}): it bounds "
                "the groups selection scores, so such a request would be cut off"
            )

    def _explain(self, device: torch.device) -> None:
        """The checks of `validate` one by one: raises naming the first bad field (returns
        when all hold: a non-CUDA device, or rope_positions given)."""
        _expect("query_start_loc", self.query_start_loc, torch.int32, 1, device)
        _expect("seq_lens", self.seq_lens, torch.int32, 1, device)
        _expect("block_table", self.block_table, torch.int32, 2, device)
        _expect("slot_mapping", self.slot_mapping, torch.int64, 1, device)
        _expect("ring_index", self.ring_index, torch.int32, 1, device)
        R, T = self.num_reqs, self.num_tokens
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

    def _as_expected(self, device: torch.device) -> bool:
        """Every check of `validate` but seq_lens_cpu's, in one test of the usual step (CUDA
        tensors, no rope_positions)."""
        if not self._tensors_as_expected(device) or self.rope_positions is not None:
            return False
        d = self.__dict__  # fill the cached num_reqs / num_tokens without their descriptor's call
        R = d["num_reqs"] = self.seq_lens.shape[0]
        T = d["num_tokens"] = self.slot_mapping.shape[0]
        nd, dq = self.num_decodes, self.decode_query_len
        return (
            self.query_start_loc.shape[0] == R + 1 and self.ring_index.shape[0] == R
            and self.block_table.shape[0] >= R and 0 <= nd <= R and dq >= 1 and nd * dq <= T
            and self.max_query_len >= 0 and self.max_seq_len >= 0 and 0 <= self.num_padding_rows <= T
        )

    def _tensors_as_expected(self, device: torch.device) -> bool:
        """The five tensors' dtypes, ranks and CUDA device in one cheap test (other devices
        take the detailed checks)."""
        index = device.index
        if device.type != "cuda" or index is None:
            return False
        q, s, b, m, r = self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping, self.ring_index
        try:
            return (
                q.dtype is torch.int32 and s.dtype is torch.int32 and b.dtype is torch.int32
                and m.dtype is torch.int64 and r.dtype is torch.int32
                and q.dim() == 1 and s.dim() == 1 and b.dim() == 2 and m.dim() == 1 and r.dim() == 1
                and q.get_device() == index and s.get_device() == index and b.get_device() == index
                and m.get_device() == index and r.get_device() == index
            )
        except AttributeError:  # not a tensor
            return False

    def check_values(
        self, page_size: int, num_slots: int | None = None, num_ring_rows: int | None = None,
        null_ring_row: int | None = None,
    ) -> None:
        """Value checks that read the tensors (free for CPU tensors; on a GPU a device sync,
        run only with `QSA_DEBUG=1`). Each error names the field, the entry and what was
        expected. num_slots bounds the live rows' slot_mapping and, as num_slots / page_size
        pages, the block_table pages a request's seq_len uses; num_ring_rows bounds
        ring_index. Live rows write distinct slots (-1 aside) and requests with rows have
        distinct ring_index (prefix caching shares read pages only). A live row's slot, unless
        -1, must be its position's slot through the block table. Requests without rows in the
        step (CUDA-graph padding) are not checked for a ring row of their own, and the engine's
        padding requests on null_ring_row (`QSAPlanner`) not at all: their rows are inert
        whatever their values.
        """
        qsl = self.query_start_loc.cpu().long()
        seq = self.seq_lens.cpu().long()
        qlen = qsl[1:] - qsl[:-1]
        R, T = self.num_reqs, self.num_tokens
        live = T - self.num_padding_rows

        def first(bad: torch.Tensor) -> int:
            return int(bad.nonzero()[0, 0])

        ring = self.ring_index.cpu()
        own = torch.ones(R, dtype=torch.bool) if null_ring_row is None else ring != null_ring_row  # checked

        if int(qsl[0]) != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
        if bool((qlen < 0).any()):
            i = first(qlen < 0)
            raise ValueError(
                f"query_start_loc must be non-decreasing: query_start_loc[{i + 1}] = {int(qsl[i + 1])} < "
                f"query_start_loc[{i}] = {int(qsl[i])}"
            )
        if int(qsl[-1]) != live:
            raise ValueError(
                f"query_start_loc[-1] must equal the number of rows T - num_padding_rows = {T} - "
                f"{self.num_padding_rows} = {live}, got {int(qsl[-1])}"
            )
        if bool((own & (seq < qlen)).any()):
            i = first(own & (seq < qlen))
            raise ValueError(
                f"seq_lens[{i}] = {int(seq[i])} is below request {i}'s query length {int(qlen[i])}: expected "
                f"seq_lens[{i}] >= {int(qlen[i])} (context + this step's rows)"
            )
        dq = qlen[: self.num_decodes]
        bad_dq = own[: self.num_decodes] & (dq != self.decode_query_len) & (dq != 0)
        if self.num_decodes and bool(bad_dq.any()):
            i = first(bad_dq)
            raise ValueError(
                f"decode request {i} has {int(dq[i])} rows: the first num_decodes = {self.num_decodes} requests "
                f"must each have decode_query_len = {self.decode_query_len} rows (or 0: a CUDA-graph padding request)"
            )
        if bool(own.any()) and int(qlen[own].max()) > self.max_query_len:
            raise ValueError(f"max_query_len must be >= every query length ({int(qlen[own].max())}), got "
                             f"{self.max_query_len}")
        if bool(own.any()) and int(seq[own].max()) > self.max_seq_len:
            raise ValueError(f"max_seq_len must be >= every seq_len ({int(seq[own].max())}), got {self.max_seq_len}")
        host = self.seq_lens_cpu
        if host is not None and not torch.equal(host.long(), seq):
            i = first(host.long() != seq)
            raise ValueError(
                f"seq_lens_cpu[{i}] = {int(host[i])} differs from seq_lens[{i}] = {int(seq[i])}: expected a host copy "
                "of seq_lens"
            )
        slots = self.slot_mapping.cpu()[:live]  # padding rows never write (their slot is ignored)
        req = torch.repeat_interleave(torch.arange(R), qlen)  # each live row's request
        rows_checked = own[req]
        if num_slots is not None and bool((rows_checked & ((slots < -1) | (slots >= num_slots))).any()):
            t = first(rows_checked & ((slots < -1) | (slots >= num_slots)))
            raise ValueError(
                f"slot_mapping[{t}] = {int(slots[t])} is outside the cache: expected -1 or a slot in [0, {num_slots})"
            )
        runs = qlen > 0  # requests with rows in this step (a CUDA-graph padding request has none)
        if num_ring_rows is not None and bool((runs & ((ring < 0) | (ring >= num_ring_rows))).any()):
            i = first(runs & ((ring < 0) | (ring >= num_ring_rows)))
            raise ValueError(
                f"ring_index[{i}] = {int(ring[i])} is outside the ring: expected a ring row in [0, {num_ring_rows})"
            )
        owners = runs & own
        live_ring = ring[owners]
        if live_ring.unique().numel() < live_ring.numel():
            i, j = _first_pair(torch.nonzero(owners).flatten(), live_ring)
            raise ValueError(
                f"ring_index[{i}] = ring_index[{j}] = {int(ring[i])}: requests {i} and {j} both have rows in this "
                "step, expected a ring row of its own for each (only requests without rows may share one)"
            )
        if R:
            need = torch.where(owners, (seq + page_size - 1) // page_size, 0)
            P = self.block_table.shape[1]
            if int(need.max()) > P:
                i = first(need > P)
                raise ValueError(
                    f"block_table has {P} columns but request {i} (seq_len {int(seq[i])}) needs "
                    f"ceil({int(seq[i])} / page_size {page_size}) = {int(need[i])} pages"
                )
            table = self.block_table[:R].cpu().long()
            if num_slots is not None:
                num_pages = num_slots // page_size
                used = torch.arange(P)[None, :] < need[:, None]
                bad = used & ((table < 0) | (table >= num_pages))
                if bool(bad.any()):
                    i, j = (int(x) for x in bad.nonzero()[0])
                    raise ValueError(
                        f"block_table[{i}, {j}] = {int(table[i, j])} is outside the cache: request {i} uses its "
                        f"first {int(need[i])} pages, expected pages in [0, {num_pages})"
                    )
            # A live row's slot must be where the attention reads it back, through the block
            # table: else the step writes K/V that no read sees, or over another request's.
            pos = torch.where(rows_checked, (seq - qlen - qsl[:-1])[req] + torch.arange(live), 0)
            page = table[req, pos // page_size]
            want = page * page_size + pos % page_size
            bad = rows_checked & (slots >= 0) & (slots != want)
            if bool(bad.any()):
                t = first(bad)
                q, p, j = int(req[t]), int(pos[t]), int(pos[t]) // page_size
                expected = f"slot {int(want[t])} (or -1)" if int(page[t]) >= 0 else "-1 (no page)"
                raise ValueError(
                    f"slot_mapping[{t}] = {int(slots[t])} disagrees with the block table: row {t} is request {q}'s "
                    f"position {p}, in its page block_table[{q}, {j}] = {int(page[t])}, expected {expected}"
                )
        # Live rows write distinct slots: two requests whose tables share a page would write
        # each other's K/V (prefix caching shares pages a step reads, never those it writes).
        writes = torch.nonzero(rows_checked & (slots >= 0)).flatten()
        if slots[writes].unique().numel() < writes.numel():
            t, u = _first_pair(writes, slots[writes])
            req = torch.searchsorted(qsl[1:], torch.tensor([t, u]), right=True).tolist()
            raise ValueError(
                f"slot_mapping[{t}] = slot_mapping[{u}] = {int(slots[t])}: rows {t} (request {req[0]}) and {u} "
                f"(request {req[1]}) write the same KV slot, expected distinct slots (or -1) for the live rows"
            )
