"""`Runner`: the embedded default engine. Owns paged caches and runs QSA layers with no engine.

It describes each step as `QSAStepInputs` and plans it with the same `QSAPlanner` the
adapters use, so a standalone run exercises exactly the path an engine integration takes.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .cache import QSACacheLayout, QSALayerCache
from .inputs import QSAStepInputs
from .layer import QSAAttention
from .metadata import QSAForwardMetadata
from .planner import QSAPlan, QSAPlanner
from .warmup import aligned_pages


@dataclass
class _Request:
    ring: int
    pages: list[int] = field(default_factory=list)
    seq_len: int = 0


class Runner:
    """Runs a stack of `QSAAttention` layers (output of layer i feeds layer i + 1).

    A layer may also be any module with `.config: QSAConfig` and
    `forward(hidden, plan, cache) -> hidden` (e.g. a decoder block around a `QSAAttention`).

    `step({request_id: hidden [n, hidden_size]})` runs one mixed step: new and continuing
    requests, any chunk length. Requests whose chunk has `1 + num_speculative_tokens` rows
    and that already hold context are decodes and go first; the rest are prefills.
    value_checks: the planner's (default: on for CPU tensors; off on a GPU, where the device
    guards stand in and a step they flag raises after it ran).
    """

    def __init__(
        self,
        layers: Sequence[QSAAttention | nn.Module],
        *,
        page_size: int,
        num_pages: int,
        max_requests: int,
        num_speculative_tokens: int = 0,
        shuffle_pages: bool = False,
        seed: int = 0,
        value_checks: bool | None = None,
    ) -> None:
        if not layers:
            raise ValueError("layers must hold at least one QSAAttention")
        self.layers = list(layers)
        self.config = self.layers[0].config
        for i, layer in enumerate(self.layers):
            if layer.config != self.config:
                raise ValueError(f"layers[{i}] has a different QSAConfig than layers[0]")
        p = next(self.layers[0].parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layout = QSACacheLayout(
            num_layers=len(self.layers),
            page_size=page_size,
            num_pages=num_pages,
            ring_rows=max_requests,
            num_speculative_tokens=num_speculative_tokens,
        )
        self.caches: list[QSALayerCache] = self.layout.allocate(self.config, self.dtype, self.device)
        self.max_requests = max_requests
        self.value_checks = value_checks
        self.planner = self._planner(max_num_tokens=256)
        self.decode_query_len = 1 + num_speculative_tokens
        self._free_pages = list(range(num_pages))
        if shuffle_pages:
            random.Random(seed).shuffle(self._free_pages)
        self._free_rings = list(range(max_requests))
        self._requests: dict[Hashable, _Request] = {}
        self._freed: set[Hashable] = set()
        self.last_plan: QSAPlan | None = None
        self.last_padding_output: torch.Tensor | None = None

    def _planner(self, max_num_tokens: int) -> QSAPlanner:
        return QSAPlanner(
            self.config, dtype=self.dtype, page_size=self.page_size,
            ring_capacity=self.layout.ring_capacity(self.config), max_num_tokens=max_num_tokens,
            max_model_len=self.layout.num_slots, device=self.device,
            num_slots=self.layout.num_slots, num_ring_rows=self.max_requests, value_checks=self.value_checks,
        )

    @property
    def last_metadata(self) -> QSAForwardMetadata | None:
        return None if self.last_plan is None else self.last_plan.meta

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def request_ids(self) -> list[Hashable]:
        """Requests that hold pages and a ring row, in admission order."""
        return list(self._requests)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_ring_rows(self) -> int:
        return len(self._free_rings)

    def _request(self, request_id: Hashable) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            if request_id in self._freed:
                raise KeyError(f"request {request_id!r} was already freed")
            raise KeyError(f"unknown request {request_id!r}: it never ran a step")
        return req

    def seq_len(self, request_id: Hashable) -> int:
        return self._request(request_id).seq_len

    def free(self, request_id: Hashable) -> None:
        """Release a request's pages and ring row for reuse; its id cannot run again."""
        req = self._request(request_id)
        del self._requests[request_id]
        self._freed.add(request_id)
        self._free_pages.extend(req.pages)
        self._free_rings.append(req.ring)

    def truncate(self, request_id: Hashable, seq_len: int) -> None:
        """Drop tokens past `seq_len` (rejected speculative drafts); pages stay allocated."""
        req = self._request(request_id)
        if not 0 <= seq_len <= req.seq_len:
            raise ValueError(f"seq_len must be in [0, {req.seq_len}], got {seq_len}")
        req.seq_len = seq_len

    def _check_step(
        self, chunks: Mapping[Hashable, torch.Tensor], rope_positions: Mapping[Hashable, torch.Tensor]
    ) -> None:
        if not chunks:
            raise ValueError("a step needs at least one request (chunks is empty)")
        H = self.config.hidden_size
        for rid, x in chunks.items():
            if rid in self._freed:
                raise ValueError(f"request {rid!r} was freed: a new request needs a new id")
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] == 0 or x.shape[1] != H:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"chunk of request {rid!r} must be [n >= 1, hidden_size = {H}], got {got}")
        stray = [rid for rid in rope_positions if rid not in chunks]
        if stray:
            raise ValueError(f"rope_positions name requests not in this step: {stray}")
        for rid, rp in rope_positions.items():
            n = chunks[rid].shape[0]
            if rp.dim() not in (1, 2) or rp.shape[-1] != n or (rp.dim() == 2 and rp.shape[0] != 3) or (
                rp.dtype.is_floating_point or rp.dtype == torch.bool
            ):
                raise ValueError(
                    f"rope_positions of request {rid!r} must be int64 [{n}] or [3, {n}], got {rp.dtype} {tuple(rp.shape)}"
                )

    def _reserve(self, order: list[Hashable], new_lens: list[int]) -> tuple[list[_Request], dict[Hashable, list[int]]]:
        """The step's requests (new ones not yet admitted) and the pages each must take.

        Nothing is taken here: a step that cannot run fails before any state changes.
        """
        new = [rid for rid in order if rid not in self._requests]
        if len(new) > len(self._free_rings):
            raise RuntimeError(
                f"no free ring row: the step adds {len(new)} requests, {len(self._free_rings)} ring rows are "
                "free; raise max_requests or free a request"
            )
        rings = iter(self._free_rings)
        reqs = [self._requests[rid] if rid in self._requests else _Request(ring=next(rings)) for rid in order]
        grow: dict[Hashable, list[int]] = {}
        taken = 0
        for rid, req, n in zip(order, reqs, new_lens):
            need = max(0, -(-n // self.page_size) - len(req.pages))
            grow[rid] = self._free_pages[taken : taken + need]
            taken += need
        if taken > len(self._free_pages):
            raise RuntimeError(f"out of KV pages: the step needs {taken}, {len(self._free_pages)} are free")
        return reqs, grow

    def _commit(
        self, order: list[Hashable], reqs: list[_Request], grow: dict[Hashable, list[int]], new_lens: list[int]
    ) -> None:
        """The step ran: admit its new requests and hand them the pages `_reserve` chose."""
        num_new = sum(rid not in self._requests for rid in order)
        del self._free_rings[:num_new]
        del self._free_pages[: sum(len(g) for g in grow.values())]
        for rid, req, n in zip(order, reqs, new_lens):
            self._requests.setdefault(rid, req)
            req.pages.extend(grow[rid])
            req.seq_len = n

    def _save_rings(self, rings: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Copies of the ring rows (and MRoPE ring positions) `rings` of every layer's cache."""
        index = torch.tensor(rings, dtype=torch.int64, device=self.device)
        return [tuple(t[index].clone() for t in (c.ring, c.ring_positions) if t is not None) for c in self.caches]

    def _restore_rings(self, rings: list[int], saved: list[tuple[torch.Tensor, ...]]) -> None:
        index = torch.tensor(rings, dtype=torch.int64, device=self.device)
        for cache, copies in zip(self.caches, saved):
            for t, copy in zip((t for t in (cache.ring, cache.ring_positions) if t is not None), copies):
                t[index] = copy

    def step(
        self,
        chunks: Mapping[Hashable, torch.Tensor],
        rope_positions: Mapping[Hashable, torch.Tensor] | None = None,
        padding: torch.Tensor | None = None,
    ) -> dict[Hashable, torch.Tensor]:
        """Run one step; returns {request_id: output [n, hidden_size]}.

        rope_positions: optional per-request int64 [n] or [3, n] (MRoPE); default logical.
        padding: optional [k, hidden_size] rows appended as inert CUDA-graph-style padding.
        Transactional: a step that fails (bad input, out of pages or ring rows, an error in
        a layer, a request the device guards flagged: RuntimeError naming it and why) admits
        no request, takes no page and advances no request. The ring rows of its continuing
        requests that it overwrote are restored (a retry pools their open groups from them);
        its other writes (K/V, compressed keys) lie past every request's seq_len, where a
        retry rewrites them before reading.
        """
        rope_positions = rope_positions or {}
        self._check_step(chunks, rope_positions)
        H = self.config.hidden_size
        if padding is not None and (padding.dim() != 2 or padding.shape[1] != H):
            raise ValueError(f"padding must be [k, hidden_size = {H}], got {tuple(padding.shape)}")
        ids = list(chunks)
        is_decode = {
            rid: rid in self._requests
            and self._requests[rid].seq_len > 0
            and chunks[rid].shape[0] == self.decode_query_len
            for rid in ids
        }
        order = [rid for rid in ids if is_decode[rid]] + [rid for rid in ids if not is_decode[rid]]
        qlens = [chunks[rid].shape[0] for rid in order]
        current = [self._requests[rid].seq_len if rid in self._requests else 0 for rid in order]
        new_lens = [c + n for c, n in zip(current, qlens)]
        reqs, grow = self._reserve(order, new_lens)
        pages_of = [req.pages + grow[rid] for rid, req in zip(order, reqs)]

        ps = self.page_size
        slots, positions = [], []
        for start, n, owned in zip(current, qlens, pages_of):
            pos = torch.arange(start, start + n)
            pages = torch.tensor(owned, dtype=torch.int64)
            slots.append(pages[pos // ps] * ps + pos % ps)
            positions.append(pos)
        num_pad = 0 if padding is None else padding.shape[0]
        slots.append(torch.full((num_pad,), -1, dtype=torch.int64))
        # 16-column aligned: every step's table specializes the kernels alike (fewer compiles)
        max_pages = aligned_pages(max([len(p) for p in pages_of] + [1]))
        table = torch.full((len(reqs), max_pages), -1, dtype=torch.int32)
        for i, owned in enumerate(pages_of):
            table[i, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)

        mrope = any(rope_positions.get(rid, torch.empty(0)).dim() == 2 for rid in order)
        rope_rows = []
        for rid, pos in zip(order, positions):
            given = rope_positions.get(rid)
            rp = pos if given is None else given.to(torch.int64)
            rope_rows.append(rp.expand(3, -1) if mrope and rp.dim() == 1 else rp)
        pad_pos = torch.zeros((3, num_pad) if mrope else (num_pad,), dtype=torch.int64)
        rope = torch.cat(rope_rows + [pad_pos], dim=-1)

        dev = self.device
        seq_lens = torch.tensor(new_lens, dtype=torch.int32)
        inputs = QSAStepInputs(
            query_start_loc=qsl.to(dev),
            seq_lens=seq_lens.to(dev),
            block_table=table.to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            ring_index=torch.tensor([r.ring for r in reqs], dtype=torch.int32, device=dev),
            rope_positions=rope.to(dev),
            num_decodes=sum(is_decode.values()),
            decode_query_len=self.decode_query_len,
            max_query_len=max(qlens),
            max_seq_len=max(new_lens),
            num_padding_rows=num_pad,
            seq_lens_cpu=seq_lens,
        )
        if inputs.num_tokens > self.planner.max_num_tokens:
            self.planner = self._planner(max(inputs.num_tokens, 2 * self.planner.max_num_tokens))
        plan = self.planner.plan(inputs)
        self.last_plan = plan
        hidden = [chunks[rid].to(device=dev, dtype=self.dtype) for rid in order]
        if padding is not None:
            hidden.append(padding.to(device=dev, dtype=self.dtype))
        x = torch.cat(hidden)
        # A continuing request's open group (k = seq_len % r raw keys in its ring) is pooled
        # from ring rows that the step's own last C rows overwrite once it has more than C - k.
        ratio, C = self.config.compress_ratio, self.layout.ring_capacity(self.config)
        rings = [req.ring for rid, req, n in zip(order, reqs, qlens)
                 if rid in self._requests and req.seq_len % ratio and n > C - req.seq_len % ratio]
        saved = self._save_rings(rings) if rings else []
        try:
            with torch.no_grad():
                for layer, cache in zip(self.layers, self.caches):
                    x = layer(x, plan, cache)
            self.planner.check_guard(order)  # a sync: the device guards' flag of this step
        except BaseException:
            if rings:
                self._restore_rings(rings, saved)
            raise
        self._commit(order, reqs, grow, new_lens)
        out, start = {}, 0
        for rid, n in zip(order, qlens):
            out[rid] = x[start : start + n]
            start += n
        self.last_padding_output = x[start:]
        return out
