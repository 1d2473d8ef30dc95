"""Refuse extends whose cached prefix leaves an open group the raw-key ring does not hold.

SGLang's ring keeps only the open group's raw keys of a request, so an extend whose prefix
ends inside a group (prefix % r != 0) is served correctly only when that prefix was computed
by the same request in an earlier step (a chunked-prefill continuation, or a running decode
folded into a MIXED step). A prefix reused from the radix cache that ends inside a group
has no ring behind it and is refused. SGLang's paged radix cache matches whole pages and
`page_size` is a multiple of r, so this only fires on a misconfiguration.

Host lists only (`rids`, `extend_prefix_lens_cpu`, `extend_seq_lens_cpu`): no device reads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from sglang.srt.model_executor.forward_batch_info import ForwardMode


class RingContinuity:
    """Remembers, per request id, the length its last extend left in the ring."""

    def __init__(self, compress_ratio: int, capacity: int) -> None:
        self.r = compress_ratio
        self.capacity = capacity
        self._filled: OrderedDict[str, int] = OrderedDict()

    def check(self, forward_batch: Any) -> None:
        """Validate an EXTEND / MIXED step, then record where each request ends."""
        prefixes = forward_batch.extend_prefix_lens_cpu
        lens = forward_batch.extend_seq_lens_cpu
        if prefixes is None or lens is None:
            raise ValueError(
                f"{forward_batch.forward_mode.name} needs forward_batch.extend_prefix_lens_cpu and "
                "extend_seq_lens_cpu (host lists) to check cached prefixes"
            )
        rids = forward_batch.rids or [None] * len(lens)
        mixed = forward_batch.forward_mode == ForwardMode.MIXED
        for rid, prefix, n in zip(rids, prefixes, lens):
            prefix, n = int(prefix), int(n)
            if prefix % self.r:
                self._check_open_group(rid, prefix, running_decode=mixed and n == 1)
            if rid is not None:
                self._record(rid, prefix + n)

    def _check_open_group(self, rid: Any, prefix: int, running_decode: bool) -> None:
        if not (running_decode or (rid is not None and self._filled.get(rid) == prefix)):
            raise ValueError(
                f"request {rid!r}: cached prefix of {prefix} tokens ends inside a group of "
                f"{self.r} (prefix % indexer_compress_ratio = {prefix % self.r}) and was not computed "
                "by this request, so the raw-key ring does not hold the open group; qsa_core needs "
                "reused prefixes to end on a group boundary (page_size a multiple of the ratio)"
            )

    def _record(self, rid: str, length: int) -> None:
        self._filled[rid] = length
        self._filled.move_to_end(rid)
        while len(self._filled) > self.capacity:
            self._filled.popitem(last=False)
