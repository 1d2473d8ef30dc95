"""Token ids outside the vocabulary get a 400 also without a tokenizer.

vLLM 0.32 checks a prompt's ids only through its tokenizer (`BaseRenderer.validate_token_ids`
returns at once under `--skip-tokenizer-init`): an id past the vocabulary then reaches the
embedding, raises IndexError in the worker and kills the engine core, and every later request
gets a 500. vLLM 0.33 bounds the ids by the model's vocabulary itself. The plugin wraps the
method (every backend, as the crash is vLLM's) so that without a tokenizer an id outside
[0, vocab_size) raises vLLM's own validation error, which the server answers with a 400.
"""

from __future__ import annotations

from collections.abc import Sequence


def install() -> None:
    """Wrap `BaseRenderer.validate_token_ids` once (idempotent: the plugin runs in every process)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.base import BaseRenderer

    original = BaseRenderer.validate_token_ids
    if getattr(original, "qsa_vocab_guard", False):
        return

    def validate_token_ids(self, token_ids: Sequence[int], *, parameter: str | None = None) -> None:
        original(self, token_ids, parameter=parameter)
        if token_ids and self.tokenizer is None:
            vocab = self.model_config.get_vocab_size()
            for i, t in enumerate(token_ids):
                if not 0 <= t < vocab:
                    raise VLLMValidationError(
                        f"Token id {t} (prompt position {i}) is out of vocabulary: expected an id in [0, {vocab})",
                        parameter=parameter)

    validate_token_ids.qsa_vocab_guard = True
    BaseRenderer.validate_token_ids = validate_token_ids
