"""`GuardWatch`: an engine's view of the device guards' flag, with no sync on the hot path.

On a GPU the metadata build makes a malformed request inert (output 0, no cache write) and
ORs the reason into the planner's guard flag; `QSAPlanner.check_guard` reads it back (a sync).
An engine instead calls `poll` once per step, outside any CUDA graph, right after `plan`: it
reports what earlier steps' copies found once their event has completed (never waiting), then
enqueues a non-blocking copy of the flag and the step's per-request flags into pinned host
memory, clears the device flag (stream-ordered after the copy) and records an event. A report
thus names a step's flagged requests a step or more after it ran.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch

from .planner import QSAPlanner, guard_message

logger = logging.getLogger(__name__)

# How every report's log line starts (GPU scripts fail a run whose server log holds one).
REPORT_PREFIX = "qsa_core: malformed step metadata"


def guard_reports(log: str) -> list[str]:
    """The lines of a server log that are guard reports (requests whose rows were made inert)."""
    return [line for line in log.splitlines() if REPORT_PREFIX in line]


class _Copy:
    """One step's flags in pinned host memory (int32 [1 + R]: the guard flag, then each
    request's bits), the event that marks them landed, and the step's request labels."""

    def __init__(self, device: torch.device, num_reqs: int) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(1 + max(num_reqs, 1), dtype=torch.int32, pin_memory=pin)  # guard, request flags
        self.event = torch.cuda.Event() if pin else None
        self.step = 0
        self.labels: Sequence[Hashable] | None = None


class GuardWatch:
    """Watches one engine's planners' guard flags (see the module docstring).

    depth: copies in flight at most; when all are (the GPU runs that far behind), a step is
    not copied and its bits stay in the device flag for the next copy (its requests unnamed).
    log: where reports go (default: this module's logger, at error level).
    """

    def __init__(self, depth: int = 4, log: Callable[[str], None] | None = None) -> None:
        self.depth = depth
        self.log = log or logger.error
        self._pending: deque[_Copy] = deque()
        self._free: list[_Copy] = []
        self._steps = 0

    def poll(self, planner: QSAPlanner, num_reqs: int, labels: Sequence[Hashable] | None = None) -> list[str]:
        """Report (log, and return) each landed copy with a flag set, then copy the flags of the
        step `planner` planned last: num_reqs requests, labelled by labels (that step's request
        ids, in its order; default: their index in the step). One non-blocking copy, one memset
        and an event record; no sync."""
        if planner.guard.is_cuda and torch.cuda.is_current_stream_capturing():
            return []  # a capture replays its copies later: nothing to read back
        reports = []
        while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
            done = self._pending.popleft()
            host = done.host.numpy()  # host memory the copy has landed in: no device read
            bits = int(host[0])
            if bits:
                flags = host[1:].tolist()
                names = done.labels if done.labels is not None else [f"#{i} of step {done.step}"
                                                                      for i in range(len(flags))]
                reports.append(guard_message(bits, list(zip(names, flags))))
                self.log("qsa_core: " + reports[-1])  # starts with REPORT_PREFIX
            self._free.append(done)
        self._steps += 1
        if len(self._pending) < self.depth:
            copy = self._free.pop() if self._free else _Copy(planner.guard.device, num_reqs)
            if copy.host.shape[0] < 1 + num_reqs:
                copy = _Copy(planner.guard.device, num_reqs)
            copy.host[1 + num_reqs :].zero_()  # host memory no copy is writing
            copy.host[: 1 + num_reqs].copy_(planner.flags(num_reqs), non_blocking=True)
            planner.guard.zero_()
            if copy.event is not None:
                copy.event.record()
            copy.step, copy.labels = self._steps, labels
            self._pending.append(copy)
        return reports
