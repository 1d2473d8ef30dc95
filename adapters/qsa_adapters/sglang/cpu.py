"""What SGLang 0.5.23 needs to serve a QSA model on the CPU, applied for `qsa_core` only.

With `--attention-backend qsa_core --device cpu`, the plugin (in the launcher and in every
scheduler process) sets, before the model is built:
- `TRITON_INTERPRET=1`: SGLang's Qwen MoE block runs its own Triton kernel
  (`fused_gate_sigmoid_mul_add`); Triton decides at decoration time whether a kernel is
  interpreted, so the launcher sets it before it spawns the scheduler processes (which
  inherit it). qsa_core's own ops run their PyTorch reference on CPU tensors either way.
- the CPU flag of SGLang's rotary embedding (`rotary_embedding.base._is_cpu`): SGLang
  believes it runs on the CPU only with `SGLANG_USE_CPU_ENGINE=1`, which needs the CPU
  build of `sgl_kernel` (not on PyPI); otherwise RotaryEmbedding imports vLLM's CUDA ops.
  The flag selects RotaryEmbedding's native PyTorch path.
- `SGLANG_NCCL_SO_PATH` to a path that loads no library: SGLang's process groups open a
  PyNccl communicator whenever libnccl loads (the PyPI torch wheel ships one), and that
  communicator needs a CUDA device, so `--tp 2` fails at start-up on the CPU. Without the
  library SGLang disables PyNccl (its own fallback) and all-reduces with torch.distributed
  (gloo). Set in the launcher, so the scheduler processes inherit it.
Speculative decoding needs three more pieces on the CPU (`cpu_speculative`), active in the
processes where these settings were applied. Any other backend or device is left exactly as
SGLang configures it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "qsa_core"
ROPE_MODULE = "sglang.srt.layers.rotary_embedding.base"
_applied = False


def wants_cpu_settings(server_args: Any) -> bool:
    """True when the server runs `qsa_core` on the CPU."""
    device = str(getattr(server_args, "device", None) or "")
    return getattr(server_args, "attention_backend", None) == BACKEND_NAME and device.split(":")[0] == "cpu"


def cpu_settings_applied() -> bool:
    """True in a process where `apply_cpu_settings` ran (`qsa_core` on the CPU)."""
    return _applied


def apply_cpu_settings(server_args: Any) -> None:
    """Set TRITON_INTERPRET, SGLang's rotary CPU flag and SGLANG_NCCL_SO_PATH for `qsa_core` on the CPU (idempotent)."""
    global _applied
    if _applied or not wants_cpu_settings(server_args):
        return
    import importlib

    interpret_before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["SGLANG_NCCL_SO_PATH"] = os.devnull
    rope = importlib.import_module(ROPE_MODULE)
    rope._is_cpu = True
    _applied = True
    logger.info(
        "qsa_core on the CPU: TRITON_INTERPRET=1 (was %r; SGLang's MoE Triton kernel runs in the "
        "interpreter), %s._is_cpu = True (RotaryEmbedding's native path), SGLANG_NCCL_SO_PATH=%s "
        "(no PyNccl: tensor parallelism all-reduces through gloo)",
        interpret_before, ROPE_MODULE, os.devnull,
    )


def after_resolve(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of `ServerArgs.resolve_once` (launcher: before the schedulers are spawned)."""
    apply_cpu_settings(server_args)


def before_load_model(model_runner: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of `ModelRunner.load_model` (scheduler: before any layer is built)."""
    apply_cpu_settings(model_runner.server_args)
