"""The `sglang.srt.plugins` entry point: registers `--attention-backend qsa_core`.

`register()` runs in SGLang's launcher and in every scheduler process (`load_plugins`); it
registers the backend factory, adds the name to the `--attention-backend` choices, hooks
`attn_backend_wrapper`, hooks `ServerArgs.resolve_once` (launcher) for the start-up refusals
of `startup`, hooks the two points where `cpu.apply_cpu_settings` prepares SGLang for
`qsa_core` on the CPU (`ServerArgs.resolve_once` in the launcher, `ModelRunner.load_model` in
the scheduler), and the three SGLang functions speculative decoding needs on the CPU
(`cpu_speculative`, pass-through elsewhere), and the tokenizer manager's request validation so
that a token id outside the vocabulary is answered with a 400 instead of killing the server
(`vocab_guard`, every backend). The name `qsa` keeps meaning SGLang's own QSA backend.
"""

from __future__ import annotations

import logging
from typing import Any

from .cpu import BACKEND_NAME

logger = logging.getLogger(__name__)
SGLANG_QSA = "qsa"  # SGLang's own QSA backend

RESOLVE_TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"
LOAD_MODEL_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"


def create_backend(runner: Any):
    """The factory SGLang calls with its ModelRunner when `qsa_core` is chosen.

    The target model's QSA layers run on `QSACoreBackend`. A speculative draft runner (the MTP
    layer of NEXTN / EAGLE) gets SGLang's own QSA backend, as SGLang's draft backends are: its
    draft steps share one selection (SGLang's MTP index sharing) and only propose tokens, which
    the target's TARGET_VERIFY step on qsa_core accepts or rejects.
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from .backend import QSACoreBackend
    from .checks import check_runner
    from .hooks import install_layer_hook

    if getattr(runner, "is_draft_worker", False):
        logger.info("qsa_core: the speculative draft model runs on SGLang's own QSA backend (%s)", SGLANG_QSA)
        return ATTENTION_BACKENDS[SGLANG_QSA](runner)
    check_runner(runner)
    backend = QSACoreBackend(runner)
    install_layer_hook()
    return backend


def register() -> None:
    """Register the backend name, its CLI choice, the backend-wrapper hook, the start-up
    refusals, the two CPU settings hooks, the CPU speculative hooks and the token-id guard
    (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    from .cpu import after_resolve, before_load_model
    from .cpu_speculative import HOOKS as CPU_SPECULATIVE_HOOKS
    from .hooks import WRAPPER_TARGET, backend_wrapper_around
    from .startup import after_resolve_refuse
    from .vocab_guard import VALIDATE_TARGET, before_validate_one_request

    if BACKEND_NAME in ATTENTION_BACKENDS:
        return
    register_attention_backend(BACKEND_NAME)(create_backend)
    add_attention_backend_choices([BACKEND_NAME])
    HookRegistry.register(WRAPPER_TARGET, backend_wrapper_around, HookType.AROUND)
    HookRegistry.register(RESOLVE_TARGET, after_resolve_refuse, HookType.AFTER)
    HookRegistry.register(RESOLVE_TARGET, after_resolve, HookType.AFTER)
    HookRegistry.register(LOAD_MODEL_TARGET, before_load_model, HookType.BEFORE)
    for target, around in CPU_SPECULATIVE_HOOKS:
        HookRegistry.register(target, around, HookType.AROUND)
    HookRegistry.register(VALIDATE_TARGET, before_validate_one_request, HookType.BEFORE)
