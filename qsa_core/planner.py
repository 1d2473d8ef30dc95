"""`QSAPlanner` / `QSAPlan`: one plan per forward step, FlashInfer style (plan once, run many).

A planner is made once per engine (per model geometry and rank). It holds its options
(`QSAOptions`) and one ops backend object (`qsa_core.backends`, chosen here once), holds the
RoPE table and owns the workspace with its backend: the derived metadata, the prepare outputs, the
selection buffers, the score / top-k scratch and the attention's split-K partials, all
allocated once for `max_num_tokens` rows, so a captured CUDA graph keeps every address.

`plan(inputs)` runs once per step: it validates the `QSAStepInputs` (host ints and tensor
metadata; the values too for CPU tensors or under `QSA_DEBUG=1`), derives the per-row fields
on the device (the backend's metadata build: guards + derivation in one launch, no host read)
and fixes the schedule of every op for this step's shape. The layer halves (`qsa_indexer`,
`qsa_attention`) then only launch what the backend bound: no allocation, no derivation, no
host read.

Column bound: selection scores at most `max_seq_len // r` groups per row (rounded up to a
bucket, so that schedules repeat). Guards: a malformed request (seq_len > max_seq_len or
below its query length, a query length above max_query_len, rows past the live rows, a slot,
ring_index or used block-table page outside the caches, a write slot or ring_index shared with
another live row / request) is never run on bad values: the metadata build makes its rows inert
(as padding: empty selection, output 0, no K/V, ring or compressed-key write) and ORs the
reason into a sticky device flag (`check_guard` names it); with the engine's host copy
(`QSAStepInputs.seq_lens_cpu`) or value checks `plan` refuses the step at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from . import backends
from .backends import LayerLaunches, QSABackend
from .cache import QSALayerCache, check_page_size, ring_store_fuses
from .config import QSAConfig, resolve_dtype
from .inputs import QSAStepInputs
from .metadata import QSAForwardMetadata
from .options import QSAOptions
from .reference import metadata as reference_metadata
from .warmup import aligned_pages

_DERIVED = ("token_to_req", "positions", "visible_blocks", "ring_slot", "compressed_slot", "kv_slot")
_SCHEDULE_CACHE = 512
_LAYER_CACHE = 256  # bound layer caches per schedule


def column_bucket(num_cols: int) -> int:
    """The column bound selection is planned with: num_cols rounded up (a power of two up to
    4096, then a multiple of 4096), so consecutive decode steps share one schedule."""
    n = max(num_cols, 1)
    if n <= 4096:
        return 1 << (n - 1).bit_length()
    return -(-n // 4096) * 4096


@dataclass(frozen=True)
class StepSchedule:
    """Everything of a plan that depends on the step's shape only (cached per shape).

    fuse_ring: prepare stores the ring rows in its first launch (`ring_store_fuses`: no
    request of the step has C - 2 rows or more). Row views [T, ...] of the workspace: the
    derived metadata fields, q_idx, q (prepare outputs; None on the reference), blocks int32
    [T, Kb] (the reference's chosen groups), selection int32 [T, W + 1], attn_out [T, Hq*D];
    the backend's select schedules of the decode rows [:num_decode_tokens] and the prefill
    rows after them (and their views of token_to_req, visible_blocks, blocks: `decode_rows`,
    `prefill_rows`), and its attention schedule (None on the reference backend);
    `meta_fixed`: the metadata fields every step of this shape shares (derived views,
    geometry); `launches`: the backend's layer launches of this shape per layer cache
    (`layer_launches`).
    """

    num_tokens: int
    num_decode_tokens: int
    num_cols: int
    fuse_ring: bool
    derived: dict[str, torch.Tensor]
    q_idx: torch.Tensor | None
    q: torch.Tensor | None
    blocks: torch.Tensor
    selection: torch.Tensor
    attn_out: torch.Tensor
    select_decode: object | None
    select_prefill: object | None
    attention: object | None
    decode_rows: tuple[torch.Tensor, ...]
    prefill_rows: tuple[torch.Tensor, ...]
    meta_fixed: dict = field(default_factory=dict, compare=False, repr=False)
    launches: dict = field(default_factory=dict, compare=False, repr=False)

    def layer_launches(self, backend: QSABackend, plan: "QSAPlan", cache: QSALayerCache) -> LayerLaunches:
        """The layer launches of this shape on one layer cache (`backend.bind`, once).

        Found by the cache object (kept alive by the entry, so its id is never reused while
        cached), else by what the launches bake in (its views' pointers, dtypes, shapes and
        strides, its scales), so an engine that builds a new cache view per call reuses them.
        """
        entry = self.launches.get(id(cache))
        if entry is not None and entry[0] is cache:
            return entry[1]
        by_views = self.launches.setdefault("by_views", {})
        key = _cache_key(cache)
        found = by_views.get(key)
        if found is None:
            if len(by_views) >= _LAYER_CACHE:
                by_views.clear()
            found = by_views[key] = backend.bind(plan, cache)
        if len(self.launches) >= _LAYER_CACHE:
            self.launches.clear()
            self.launches["by_views"] = by_views
        self.launches[id(cache)] = (cache, found)
        return found


def _record(cls: type, fixed: dict | None = None, **fields: object) -> object:
    """An instance of the frozen dataclass `cls` from all its fields (`fixed`, then `fields`),
    without its __init__'s per-field object.__setattr__ (plan makes two per step; neither has
    a __post_init__)."""
    record = object.__new__(cls)
    if fixed:
        record.__dict__.update(fixed)
    record.__dict__.update(fields)
    return record


def _view_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _cache_key(cache: QSALayerCache) -> tuple:
    """What bound launches fix of a layer cache: its views and scales."""
    c = cache
    return (_view_key(c.k), _view_key(c.v), _view_key(c.compressed), _view_key(c.ring), _view_key(c.ring_positions),
            c.k_scale, c.v_scale)


@dataclass(frozen=True)
class QSAPlan:
    """One step, planned: the metadata, the schedules, and what the layer halves need."""

    meta: QSAForwardMetadata
    schedule: StepSchedule
    config: QSAConfig
    backend: QSABackend
    dtype: torch.dtype
    index_dtype: torch.dtype
    inv_freq: torch.Tensor
    rope_axes: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    def launches(self, cache: QSALayerCache) -> LayerLaunches:
        """The backend's layer launches of this plan's step shape on `cache` (bound once)."""
        return self.schedule.layer_launches(self.backend, self, cache)


class QSAPlanner:
    """Plans the steps of one engine for one layer geometry (`config`, this rank's heads).

    dtype: the model (activation) dtype; page_size: tokens per main KV page (a multiple of
    r); ring_capacity: C; max_num_tokens: rows per step (padding included);
    max_model_len: the longest seq_len served (sizes the selection scratch);
    max_num_reqs: requests per step, needed only for `plan(..., static=True)`;
    num_slots / num_ring_rows: bounds of the value checks and device guards (num_slots also
    sizes the guard against two live rows writing one slot, a claim table of int64
    [num_slots + 1] on Triton; without num_slots that guard is off); null_ring_row: a ring
    row no request owns, on which the engine puts requests it pads a step with (vLLM's null
    block 0, which its dummy runs give every request): their rows are inert (output 0, no
    cache write) and flag nothing, where other requests sharing a ring row are flagged; options: the core's
    switches (`QSAOptions`; default `QSAOptions.from_env()`, read here once): the ops
    backend (by device unless set; `backend` is the object made from it, `backend.name`
    "reference" or "triton"), value_checks (read the step's values in `plan` and raise on
    malformed ones; default on for CPU tensors, where it costs no sync), debug (value
    checks everywhere) and the Triton kernels' options (`options.kernel`); backend= /
    value_checks=: shorthands that override those two fields.
    Without value checks the metadata build's device guards make a malformed request's rows
    inert (output 0, no cache write) and flag the reason (`check_guard`).
    """

    def __init__(
        self,
        config: QSAConfig,
        *,
        dtype: torch.dtype,
        page_size: int,
        ring_capacity: int,
        max_num_tokens: int,
        max_model_len: int,
        max_num_reqs: int | None = None,
        device: torch.device | str = "cpu",
        num_slots: int | None = None,
        num_ring_rows: int | None = None,
        null_ring_row: int | None = None,
        options: QSAOptions | None = None,
        backend: str | None = None,
        value_checks: bool | None = None,
    ) -> None:
        check_page_size(page_size, config.compress_ratio)
        if ring_capacity < config.compress_ratio or ring_capacity % config.compress_ratio:
            raise ValueError(
                f"ring_capacity ({ring_capacity}) must be a positive multiple of compress_ratio ({config.compress_ratio})"
            )
        for name, value in (("max_num_tokens", max_num_tokens), ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_slots is not None and max_num_tokens >= 1 << reference_metadata.CLAIM_ROW_BITS:
            raise ValueError(f"max_num_tokens must be < 2**{reference_metadata.CLAIM_ROW_BITS} (the shared-slot "
                             f"guard's row field), got {max_num_tokens}")
        self.config = config
        self.dtype = dtype
        self.page_size = page_size
        self.ring_capacity = ring_capacity
        self.max_num_tokens = max_num_tokens
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // page_size)  # a request's pages at most: a block table's columns
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        if null_ring_row is not None and not 0 <= null_ring_row < (num_ring_rows or 1 << 31):
            raise ValueError(f"null_ring_row must be a ring row in [0, num_ring_rows = {num_ring_rows}), got "
                             f"{null_ring_row}")
        self.num_slots, self.num_ring_rows, self.null_ring_row = num_slots, num_ring_rows, null_ring_row
        options = QSAOptions.from_env() if options is None else options
        if backend is not None or value_checks is not None:
            options = replace(options, backend=backend or options.backend,
                              value_checks=options.value_checks if value_checks is None else value_checks)
        self.options = options
        self.value_checks = self.device.type == "cpu" if options.value_checks is None else options.value_checks
        self._read_values = self.value_checks or options.debug
        self.index_dtype = resolve_dtype(config.index_dtype, dtype)
        # Normal tensors even when built inside torch.inference_mode(): the workspace is
        # written in place by steps that may run outside it.
        with torch.inference_mode(False):
            self.inv_freq = config.inv_freq().to(self.device)
            self.rope_axes = config.rope_axes().to(self.device)
            self._allocate(max_num_reqs)
            self.backend = backends.create(self)
        self._schedules: dict[tuple, StepSchedule] = {}
        self._plan_fixed = dict(config=config, backend=self.backend, dtype=dtype, index_dtype=self.index_dtype,
                                inv_freq=self.inv_freq, rope_axes=self.rope_axes)  # every plan's

    # -- workspace ------------------------------------------------------------------------

    def _allocate(self, max_num_reqs: int | None) -> None:
        """The planner's own buffers (the backend allocates its part after)."""
        cfg, n, dev = self.config, self.max_num_tokens, self.device
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self.derived = dict(
            token_to_req=torch.zeros(n, **i32),
            positions=torch.full((n,), -1, **i64),
            visible_blocks=torch.zeros(n, **i32),
            ring_slot=torch.full((n,), -1, **i64),
            compressed_slot=torch.full((n,), -1, **i64),
            kv_slot=torch.full((n,), -1, **i64),
        )
        # The guard flag, then each request's bits: one buffer, so a watch copies both at once.
        self._flags = torch.zeros(1 + max(max_num_reqs or 0, n), **i32)
        self.guard, self._request_flags = self._flags[:1], self._flags[1:]
        self._blocks = torch.empty(n, cfg.block_topk, **i32)
        self._selection = torch.empty(n, cfg.packed_width, **i32)
        self._attn_out = torch.empty(n, cfg.num_heads * cfg.head_dim, dtype=self.dtype, device=dev)
        self.static: dict[str, torch.Tensor] | None = None
        if max_num_reqs is not None:
            # 16-column aligned: its row stride specializes the kernels as an engine's aligned
            # eager tables do (`warmup.aligned_pages`), whatever max_model_len
            pages = aligned_pages(self.max_pages)
            self.static = dict(
                query_start_loc=torch.zeros(max_num_reqs + 1, **i32),
                seq_lens=torch.zeros(max_num_reqs, **i32),
                block_table=torch.full((max_num_reqs, pages), -1, **i32),
                slot_mapping=torch.full((n,), -1, **i64),
                ring_index=torch.zeros(max_num_reqs, **i32),
                rope_positions=torch.zeros(3 if cfg.uses_mrope else 1, n, **i64),
            )

    def _schedule(self, num_tokens: int, num_decode_tokens: int, num_cols: int,
                  decode_query_len: int, fuse_ring: bool, decode_only: bool) -> StepSchedule:
        key = (num_tokens, num_decode_tokens, num_cols, decode_query_len, fuse_ring, decode_only)
        found = self._schedules.get(key)
        if found is not None:
            return found
        cfg, T, nd = self.config, num_tokens, num_decode_tokens
        kernel = self.backend.schedule(T, nd, num_cols, decode_query_len, decode_only)
        rows = (self.derived["token_to_req"][:T], self.derived["visible_blocks"][:T], self._blocks[:T])
        found = StepSchedule(
            num_tokens=T, num_decode_tokens=nd, num_cols=num_cols, fuse_ring=fuse_ring,
            derived={k: self.derived[k][:T] for k in _DERIVED}, q_idx=kernel.q_idx, q=kernel.q,
            blocks=self._blocks[:T], selection=self._selection[:T], attn_out=self._attn_out[:T],
            select_decode=kernel.select_decode, select_prefill=kernel.select_prefill, attention=kernel.attention,
            decode_rows=tuple(x[:nd] for x in rows), prefill_rows=tuple(x[nd:] for x in rows),
        )
        d = found.derived
        found.meta_fixed.update(
            slot_mapping=d["kv_slot"],  # the guarded one: inert rows write nothing
            compress_ratio=cfg.compress_ratio, page_size=self.page_size, ring_capacity=self.ring_capacity,
            token_to_req=d["token_to_req"], positions=d["positions"], visible_blocks=d["visible_blocks"],
            ring_slot=d["ring_slot"], compressed_slot=d["compressed_slot"],
        )
        if len(self._schedules) >= _SCHEDULE_CACHE:
            self._schedules.clear()
        self._schedules[key] = found
        return found

    # -- per step -------------------------------------------------------------------------

    def _stage(self, inputs: QSAStepInputs) -> tuple[torch.Tensor, ...]:
        """Copy the step's tensors into the planner's static buffers (CUDA-graph addresses);
        returns (query_start_loc, seq_lens, block_table, slot_mapping, ring_index,
        rope_positions or None) as views of them."""
        s = self.static
        if s is None:
            raise ValueError("plan(..., static=True) needs a planner built with max_num_reqs")
        R = inputs.num_reqs
        if R > s["seq_lens"].shape[0]:
            raise ValueError(f"num_reqs ({R}) exceeds the planner's max_num_reqs ({s['seq_lens'].shape[0]})")
        P = inputs.block_table.shape[1]
        if P > self.max_pages:
            raise ValueError(f"block_table has {P} columns, more than ceil(max_model_len / page_size) = {self.max_pages}")
        rp = inputs.rope_positions
        if rp is not None and rp.dim() == 2 and s["rope_positions"].shape[0] != 3:
            raise ValueError("3-axis rope_positions need an MRoPE config (mrope_section)")
        return self.backend.stage(inputs, s)

    def _check_capacity(self, inputs: QSAStepInputs) -> None:
        """The step fits the workspace (host ints only)."""
        T = inputs.num_tokens
        if inputs.num_reqs > self._request_flags.shape[0]:
            raise ValueError(
                f"num_reqs ({inputs.num_reqs}) exceeds the planner's max_num_reqs / max_num_tokens "
                f"({self._request_flags.shape[0]})"
            )
        if T > self.max_num_tokens:
            raise ValueError(f"num_tokens ({T}) exceeds the planner's max_num_tokens ({self.max_num_tokens})")
        if inputs.max_seq_len > self.max_model_len:
            raise ValueError(f"max_seq_len ({inputs.max_seq_len}) exceeds the planner's max_model_len ({self.max_model_len})")

    def plan(self, inputs: QSAStepInputs, *, static: bool = False) -> QSAPlan:
        """Validate, derive (one launch on Triton) and schedule one step; reads nothing back.

        static=True copies the step's tensors into planner-owned buffers first, so a CUDA
        graph captured over `plan` + layers replays on fresh inputs (same shapes and
        max_seq_len bucket => the same schedule).
        """
        inputs.validate(self.device)
        self._check_capacity(inputs)
        T, max_seq_len = inputs.num_tokens, inputs.max_seq_len
        if self._read_values:
            inputs.check_values(self.page_size, self.num_slots, self.num_ring_rows, self.null_ring_row)
        cfg = self.config
        schedule = self._schedule(T, inputs.num_decode_tokens, column_bucket(max_seq_len // cfg.compress_ratio),
                                  inputs.decode_query_len,
                                  ring_store_fuses(inputs.max_query_len, self.ring_capacity, cfg.compress_ratio),
                                  inputs.num_decodes == inputs.num_reqs)
        if static:
            qsl, seq, table, slots, ring, rope = self._stage(inputs)
        else:
            qsl, seq, table, slots, ring, rope = (inputs.query_start_loc, inputs.seq_lens, inputs.block_table,
                                                  inputs.slot_mapping, inputs.ring_index, inputs.rope_positions)
        d = schedule.derived
        # A captured graph replays with any padding: the live-row bound then comes from
        # query_start_loc on the device, never from this step's host int.
        live = -1 if static else T - inputs.num_padding_rows
        self.backend.build_metadata(inputs, (qsl, seq, slots, ring, table), live, d)
        meta = _record(
            QSAForwardMetadata, schedule.meta_fixed, query_start_loc=qsl, seq_lens=seq, block_table=table,
            ring_index=ring, num_decodes=inputs.num_decodes, max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len, decode_query_len=inputs.decode_query_len,
            num_padding_rows=inputs.num_padding_rows,
            rope_positions=d["positions"] if rope is None else rope, seq_lens_cpu=inputs.seq_lens_cpu,
        )
        return _record(QSAPlan, self._plan_fixed, meta=meta, schedule=schedule)

    def warm(self, caches: Iterable[QSALayerCache], *, decode_query_lens: Sequence[int] = (1,),
             static: bool = False, max_num_reqs: int | None = None, workers: int | None = None,
             block_table_strides: Sequence[int] = (), mixed: bool = True) -> list:
        """Compile every kernel specialization this engine's steps can choose, before serving
        (`warmup.warm`: plans each step shape of `warmup.warm_steps`, binds the layer launches
        on each distinct cache layout with compiling deferred, launching none of them, then
        compiles the distinct variants `workers` at a time; the metadata build runs on the
        planner's workspace). Call once the real caches are bound, before CUDA graph capture.
        decode_query_lens: the decode rows per request the engine runs (1, and
        1 + num_speculative_tokens with MTP); static: as the engine's `plan(static=...)`;
        block_table_strides: without static, the row strides the engine's block tables can have;
        mixed=False: no mixed decode + prefill shapes, for engines whose steps are decode-only or
        prefill-only (SGLang). Returns the step shapes planned: none on the reference backend
        (nothing compiles)."""
        from .warmup import warm

        return warm(self, caches, decode_query_lens=decode_query_lens, static=static, max_num_reqs=max_num_reqs,
                    workers=workers, block_table_strides=block_table_strides, mixed=mixed)

    @property
    def request_flags(self) -> torch.Tensor:
        """int32 [>= R] (device): each request's GUARD_* bits in the step planned last."""
        return self._request_flags

    def flags(self, num_reqs: int) -> torch.Tensor:
        """int32 [1 + num_reqs] (device): the guard flag, then `request_flags[:num_reqs]` (one view)."""
        return self._flags[: 1 + num_reqs]

    def check_guard(self, request_ids: Sequence[Hashable] | None = None) -> None:
        """Raise if any step since the last check had a malformed request whose rows the
        metadata build made inert (output 0, no cache writes), naming each reason, and with
        request_ids (the last planned step's requests, in its order) each flagged request.
        Reads the device flag: a sync; then clears it."""
        bits = int(self.guard.item())
        if bits:
            self.guard.zero_()
            flags = [] if request_ids is None else self._request_flags[: len(request_ids)].tolist()
            raise RuntimeError(guard_message(bits, list(zip(request_ids or [], flags))))


def guard_message(bits: int, request_flags: Sequence[tuple[Hashable, int]] = ()) -> str:
    """What a guard flag `bits` (GUARD_* of `qsa_core.reference.metadata`) says, naming each
    (request, its bits) pair with bits set."""
    named = [f"request {rid!r}: {', '.join(t for bit, t in _GUARD_REASONS if f & bit)}"
             for rid, f in request_flags if f]
    reasons = [text for bit, text in _GUARD_REASONS if bits & bit]
    return ("malformed step metadata: the rows of the requests concerned were made inert (output 0, no cache "
            "write) instead of giving a wrong answer: " + "; ".join(reasons)
            + (". Flagged: " + "; ".join(named) if named else ""))


_GUARD_REASONS = (
    (reference_metadata.GUARD_MAX_SEQ_LEN,
     "a seq_len exceeded the step's max_seq_len (the column bound of selection): pass max_seq_len >= every seq_len"),
    (reference_metadata.GUARD_SEQ_LEN, "a seq_lens entry was below its request's query length (expected >= it)"),
    (reference_metadata.GUARD_MAX_QUERY_LEN,
     "a request's query length exceeded the step's max_query_len: pass max_query_len >= every query length"),
    (reference_metadata.GUARD_DECODE_ROWS,
     "a decode request (one of the first num_decodes) had neither decode_query_len nor 0 rows: expected "
     "decode_query_len rows per decode request (0: a CUDA-graph padding request)"),
    (reference_metadata.GUARD_QUERY_START_LOC,
     "query_start_loc[-1] differed from the number of rows (num_tokens - num_padding_rows)"),
    (reference_metadata.GUARD_SLOT, "a slot_mapping entry was outside [-1, num_slots)"),
    (reference_metadata.GUARD_RING_INDEX, "a ring_index entry was outside [0, num_ring_rows)"),
    (reference_metadata.GUARD_PAGE,
     "a block_table page a request uses (its first ceil(seq_len / page_size)) was outside [0, num_pages)"),
    (reference_metadata.GUARD_SHARED_SLOT,
     "a slot_mapping entry (>= 0) of a live row was another live row's too: expected distinct write slots"),
    (reference_metadata.GUARD_SHARED_RING,
     "a ring_index entry was another request's with rows too: expected a ring row per live request"),
    (reference_metadata.GUARD_SLOT_TABLE,
     "a slot_mapping entry (>= 0) of a live row was not its position's slot through its request's block_table "
     "row: expected block_table[req, pos // page_size] * page_size + pos % page_size (or -1)"),
)
