"""`GuardWatch`: what the device guards flag reaches the log a step later, with no sync.

The guard path runs with the host value checks off (a GPU's default), on both backends (on
CPU tensors in CI; on CUDA in `scripts/test_gpu.sh runner`, through pinned memory and
events): the metadata build flags two requests planted onto one ring row; the watch's poll
after that step copies the flags, the next poll reports them by request.
"""

import torch

from qsa_core import QSAConfig, QSAPlanner, QSAStepInputs
from qsa_core.guard import GuardWatch

from hf_oracle import DEVICE, tiny_config

I32, I64 = torch.int32, torch.int64
CONFIG = QSAConfig.from_hf(tiny_config())
PAGE = 8


def landed() -> None:
    """Let the copies land (the watch itself never waits): a test-only sync on CUDA."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def planner() -> QSAPlanner:
    return QSAPlanner(CONFIG, dtype=torch.float32, page_size=PAGE, ring_capacity=4, max_num_tokens=16,
                      max_model_len=64, device=DEVICE, num_slots=12 * PAGE, num_ring_rows=3, value_checks=False)


def step(rings) -> QSAStepInputs:
    """Two prefills of 4 and 6 rows on pages 4 and 2, on ring rows `rings`."""
    t = dict(query_start_loc=torch.tensor([0, 4, 10], dtype=I32), seq_lens=torch.tensor([4, 6], dtype=I32),
             block_table=torch.tensor([[4], [2]], dtype=I32),
             slot_mapping=torch.tensor([32 + i for i in range(4)] + [16 + i for i in range(6)], dtype=I64),
             ring_index=torch.tensor(rings, dtype=I32))
    return QSAStepInputs(**{k: v.to(DEVICE) for k, v in t.items()}, num_decodes=0, max_query_len=6, max_seq_len=6)


def test_a_flagged_step_is_logged_by_request_at_the_next_poll(backend):
    p, logged = planner(), []
    watch = GuardWatch(log=logged.append)
    p.plan(step([1, 1]))  # both requests on ring row 1: made inert, flagged
    assert watch.poll(p, 2, ["req-a", "req-b"]) == [] and logged == []  # copied, not read yet
    assert int(p.guard) == 0  # the copy took the bits off the device flag
    p.plan(step([0, 1]))
    landed()
    (report,) = watch.poll(p, 2, ["req-c", "req-d"])
    assert logged == ["qsa_core: " + report]
    reason = "a ring_index entry was another request's with rows too"
    assert report.count(reason) == 3 and "request 'req-a'" in report and "request 'req-b'" in report
    assert "req-c" not in report
    p.plan(step([0, 2]))
    landed()
    assert watch.poll(p, 2) == []  # the clean step before it
    p.plan(step([2, 2]))
    watch.poll(p, 2)
    landed()
    (report,) = watch.poll(p, 0)  # without labels: the request's index in its step
    assert "request '#0 of step 4'" in report and "request '#1 of step 4'" in report


def test_copies_in_flight_are_bounded_and_bits_wait_in_the_device_flag(backend):
    """With every copy in flight (a GPU running behind), a step is not copied: its bits stay in
    the device flag and go with the next copy."""
    p = planner()
    watch = GuardWatch(depth=1, log=lambda _: None)
    watch._pending.append(type("InFlight", (), {"event": type("E", (), {"query": lambda self: False})()})())
    p.plan(step([1, 1]))
    assert watch.poll(p, 2) == [] and int(p.guard) != 0  # not copied: the flag keeps its bits
    watch._pending.clear()
    watch.poll(p, 2)
    assert int(p.guard) == 0
    p.plan(step([0, 1]))
    landed()
    (report,) = watch.poll(p, 2)
    assert "ring_index entry was another request's" in report
