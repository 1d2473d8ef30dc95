"""The `vllm.general_plugins` entry point (runs in every vLLM process, so it is idempotent).

It imports nothing of the model: the backend and the model classes are registered by name
and load when vLLM first asks for them.
"""

from __future__ import annotations

import copyreg
import logging

MODEL_MODULE = "qsa_adapters.vllm.qwen4_exp"
ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP")
OUR_LOGGERS = ("qsa_core", "qsa_kernels", "qsa_adapters")


def _reduce_backend(member):
    from .backend import BACKEND_NAME

    if member.name == BACKEND_NAME:
        return _qsa_core_backend, ()
    return type(member), (member.value,)


def _qsa_core_backend():
    """The QSA_CORE member, registered first where this runs (an unpickling process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .backend import BACKEND_NAME

    register()
    return AttentionBackendEnum[BACKEND_NAME]


class ToEngineLog(logging.Handler):
    """Hands our packages' records to vLLM's `vllm` logger where vLLM configured it (its
    handlers, format and level), else to the root logger as Python would."""

    def emit(self, record: logging.LogRecord) -> None:
        engine = logging.getLogger("vllm")
        target = engine if engine.handlers else logging.getLogger()
        if record.levelno >= target.getEffectiveLevel():
            target.handle(record)


def route_logs() -> None:
    """Our packages' log lines (the warm-up's "QSA: warmed ..." line, guard errors) go where
    vLLM's go (`ToEngineLog`). vLLM configures only its `vllm` logger, in each process when it
    starts (possibly after plugins load), so the hand-over is decided per record; without it
    ours reached Python's last-resort handler, warnings and errors only, and a server never
    showed how long the warm-up took."""
    for name in OUR_LOGGERS:
        ours = logging.getLogger(name)
        if not any(isinstance(h, ToEngineLog) for h in ours.handlers):
            ours.addHandler(ToEngineLog())
            ours.setLevel(logging.DEBUG)
            ours.propagate = False


def register() -> None:
    """Register the QSA_CORE attention backend, the core-backed Qwen4-Exp architectures,
    their config checks (`config_hooks`) and the V1 proposer's MTP width (`spec_decode`), and
    route our log lines through vLLM's (`route_logs`).

    The architectures replace upstream's under the same names; they are upstream's models
    unless QSA_CORE is chosen or the platform is the CPU (`config_hooks.uses_qsa_core`).
    """
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import config_hooks, spec_decode, vocab_guard
    from .backend import BACKEND_NAME

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, "qsa_adapters.vllm.backend.QSACoreBackend")
        # vLLM's spawned engine processes unpickle the config (with `--attention-backend
        # QSA_CORE` in it) before they load plugins, and a backend member added at run time
        # does not exist there yet: pickle that member as "register, then look it up".
        copyreg.pickle(AttentionBackendEnum, _reduce_backend)
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"{MODEL_MODULE}:{arch}")
    config_hooks.install()
    spec_decode.install()
    vocab_guard.install()
    route_logs()
