"""The `sglang.srt.plugins` entry point: registers `--attention-backend qsa_core`.

`register()` runs in SGLang's launcher and in every scheduler process (`load_plugins`); it
registers the backend factory, adds the name to the `--attention-backend` choices and hooks
`attn_backend_wrapper`. The name `qsa` keeps meaning SGLang's own QSA backend.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "qsa_core"


def create_backend(runner: Any):
    """The factory SGLang calls with its ModelRunner when `qsa_core` is chosen."""
    from .backend import QSACoreBackend
    from .checks import check_runner
    from .hooks import install_layer_hook

    check_runner(runner)
    backend = QSACoreBackend(runner)
    install_layer_hook()
    return backend


def register() -> None:
    """Register the backend name, its CLI choice and the backend-wrapper hook (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    from .hooks import WRAPPER_TARGET, backend_wrapper_around

    if BACKEND_NAME in ATTENTION_BACKENDS:
        return
    register_attention_backend(BACKEND_NAME)(create_backend)
    add_attention_backend_choices([BACKEND_NAME])
    HookRegistry.register(WRAPPER_TARGET, backend_wrapper_around, HookType.AROUND)
