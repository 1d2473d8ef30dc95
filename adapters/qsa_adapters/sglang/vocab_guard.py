"""Refuse a request whose token ids fall outside the vocabulary before it reaches the scheduler.

SGLang 0.5.23 hands a request's `input_ids` (`/generate`, or a token-list prompt on
`/v1/completions`) to the scheduler unchecked: an id outside [0, vocab_size) raises IndexError
in the scheduler's embedding lookup and every server process exits, whatever the attention
backend (its own `qsa` included). The plugin hooks (BEFORE) `TokenizerManager._validate_one_request`,
which the launcher's tokenizer manager calls for every generate / embedding request once its
ids are known; a ValueError there is SGLang's own path to a 400 answer that carries the message.
Requests with multimodal data or `input_embeds` are left to SGLang: their ids are the
processor's, with placeholders that need not be vocabulary ids.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def bad_token_id(input_ids: Sequence[Any], vocab_size: int) -> tuple[int, Any] | None:
    """(index, value) of the first entry that is not an integer in [0, vocab_size), or None."""
    if all(type(t) is int for t in input_ids) and (not input_ids or 0 <= min(input_ids) and max(input_ids) < vocab_size):
        return None
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
            return i, t
    return None


def check_token_ids(input_ids: Sequence[Any] | None, vocab_size: int) -> None:
    """Raise ValueError naming `input_ids[i]` and the expected range where an id is not a token id."""
    if input_ids is None:
        return
    bad = bad_token_id(input_ids, vocab_size)
    if bad is not None:
        i, t = bad
        raise ValueError(
            f"input_ids[{i}] = {t!r} is not a token id of this model: expected an integer in "
            f"[0, {vocab_size}) (the model's vocab_size is {vocab_size})"
        )


def before_validate_one_request(manager: Any, obj: Any, input_ids: Sequence[Any] | None, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of `TokenizerManager._validate_one_request` (launcher process)."""
    if obj.contains_mm_input() or getattr(obj, "input_embeds", None) is not None:
        return
    check_token_ids(input_ids, manager.model_config.vocab_size)
