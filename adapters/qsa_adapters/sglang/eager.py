"""The eager planner's size: the most rows one step SGLang runs eagerly can hold.

SGLang runs every prefill (EXTEND, MIXED) eagerly, and decode / TARGET_VERIFY steps its CUDA
graphs do not cover (batches above the largest graph, or `--disable-cuda-graph`). The backend
builds its eager planner once at this bound and warms it at start-up, so no step in normal
operation rebuilds it or compiles a kernel (a step above the bound still grows it).

Bounds (SGLang 0.5.23's `PrefillAdder`, `Scheduler.get_new_batch_prefill`):

- chunked prefill on (`chunked_prefill_size` > 0): every admitted extend (page-rounded, or raw
  under exact chunk fill) and, in a mixed step (`--enable-mixed-chunk`), each running decode's
  one row are charged against `chunked_prefill_size`, and a request that does not fit is cut to
  what is left: rows <= chunked_prefill_size. (`max_prefill_tokens` only stops admission there.)
- chunked prefill off: a further request is admitted only while its page-rounded input is
  below what is left of `max_prefill_tokens`, but the first one whole at any length: rows <=
  max_prefill_tokens except for a step of one prompt longer than that (the planner grows).
- decode / target verify: 1 + speculative draft tokens rows per running request, and every
  running request holds a row of `req_to_token` (`ReqToTokenPool.size` of them). Speculative
  decoding disables mixed chunks; draft-extend steps run on the draft runner's own backend.
"""

from __future__ import annotations


def eager_max_tokens(*, chunked_prefill_size: int | None, max_prefill_tokens: int, num_request_slots: int,
                     speculative_tokens: int) -> int:
    """Rows per eager step (module docstring): max(prefill bound, num_request_slots *
    (1 + speculative_tokens)); chunked_prefill_size None or <= 0: chunked prefill off."""
    for name, value in (("max_prefill_tokens", max_prefill_tokens), ("num_request_slots", num_request_slots)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if speculative_tokens < 0:
        raise ValueError(f"speculative_tokens must be >= 0, got {speculative_tokens}")
    chunked = chunked_prefill_size is not None and chunked_prefill_size > 0
    prefill = chunked_prefill_size if chunked else max_prefill_tokens
    return max(prefill, num_request_slots * (1 + speculative_tokens))


def schedule_bounds() -> tuple[int | None, int]:
    """(chunked_prefill_size, max_prefill_tokens) of this scheduler process: SGLang's published
    schedule config, as its scheduler reads them (chunked_prefill_size None or <= 0: off)."""
    from sglang.srt.runtime_context import get_schedule

    schedule = get_schedule()
    return schedule.chunked_prefill_size, int(schedule.max_prefill_tokens)
