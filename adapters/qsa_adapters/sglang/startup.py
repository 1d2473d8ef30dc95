"""What `--attention-backend qsa_core` refuses, decided in the launcher before any scheduler starts.

The plugin hooks AFTER `ServerArgs.resolve_once`, which SGLang's launcher (and `Engine`) runs
before it spawns the scheduler processes: a refusal there ends the launcher with exit code 1
and one line naming the flag, instead of a scheduler traceback 20-40 s later. The values are
the resolved ones (`--speculative-algorithm NEXTN` reads EAGLE, `--dtype auto` the model's
dtype as SGLang's `ModelConfig` resolves it). The scheduler keeps backstops for callers that
build a ModelRunner without the launcher: split backends and overlapped batches
(`checks.check_runner`), the pool's dtype (`caches.check_pool`), draft trees (`batch_map`).
"""

from __future__ import annotations

from typing import Any

from .cpu import BACKEND_NAME

BF16 = "bfloat16"
NO_MODEL = ("none", "dummy")  # SGLang's placeholder model paths: no config to resolve `--dtype auto` from


class StartupRefusal(SystemExit):
    """Ends the launcher with exit code 1 and the message as its one line on stderr."""

    def __init__(self, message: str) -> None:
        super().__init__(f"qsa_core: {message}")


def speculative_refusal(cfg: Any, algorithm: str | None) -> str | None:
    """Speculative decoding (`algorithm` as the user named it): chain drafts only."""
    if getattr(cfg, "speculative_algorithm", None) is None:
        return None
    topk = getattr(cfg, "speculative_eagle_topk", None)
    if topk not in (None, 1):
        return (
            f"--speculative-eagle-topk must be 1 with --speculative-algorithm {algorithm} "
            f"(qsa_core verifies chain drafts only), got {topk}"
        )
    return None


def parallel_refusal(cfg: Any) -> str | None:
    """Context parallelism (prefill or decode) is not served."""
    for name, flag in (("attn_cp_size", "--attn-cp-size"), ("dcp_size", "--dcp-size")):
        size = getattr(cfg, name, 1) or 1
        if int(size) > 1:
            return f"{flag} {size}: qsa_core does not serve context parallelism; use tensor parallelism (--tp)"
    if getattr(cfg, "enable_prefill_cp", False):
        return "--enable-prefill-cp: qsa_core does not serve prefill context parallelism; drop the flag"
    return None


def overlap_refusal(cfg: Any) -> str | None:
    """Two batches in flight at once on separate backend objects: not served.

    Two-batch overlap builds a primary backend and two children (`TboAttnBackend`) and
    PD-multiplexing a prefill backend and a decode backend per stream; each `QSACoreBackend`
    owns its planner and its raw-key ring, so a request's ring history would split between
    objects. Qwen4-Exp's decoder layer has no TBO operation strategy in SGLang either.
    """
    for name, flag in (("enable_two_batch_overlap", "--enable-two-batch-overlap"), ("enable_pdmux", "--enable-pdmux")):
        if getattr(cfg, name, False):
            return (
                f"{flag}: qsa_core does not serve two batches in flight on separate attention backends (each "
                f"keeps its own plan and raw-key ring); drop {flag}"
            )
    return None


def split_backend_refusal(cfg: Any) -> str | None:
    """qsa_core writes its own caches, so it must run prefill and decode."""
    for name in ("prefill_attention_backend", "decode_attention_backend"):
        chosen = getattr(cfg, name, None)
        if chosen not in (None, BACKEND_NAME):
            flag = "--" + name.replace("_", "-")
            return (
                f"{flag} {chosen}: qsa_core must run both prefill and decode (the caches it writes are its own); "
                f"drop {flag}"
            )
    return None


def dtype_refusal(model_dtype: Any) -> str | None:
    """SGLang's QSA pool keeps the raw-key ring in bf16: bf16 models only."""
    name = str(model_dtype).removeprefix("torch.")
    if name == BF16:
        return None
    return (
        f"the model would run in {name}, but SGLang's QSA cache pool keeps raw keys in bfloat16 and "
        f"qsa_core serves bfloat16 models only: launch with --dtype {BF16}"
    )


def startup_refusal(server_args: Any) -> str | None:
    """The reason (one line, naming the flag) `qsa_core` cannot serve `server_args`, or None.

    `server_args` has been resolved; any other backend is never refused.
    """
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if getattr(cfg, "attention_backend", None) != BACKEND_NAME:
        return None
    reason = (
        speculative_refusal(cfg, getattr(server_args, "speculative_algorithm", None))
        or parallel_refusal(cfg)
        or overlap_refusal(cfg)
        or split_backend_refusal(cfg)
    )
    if reason is not None:
        return reason
    if str(cfg.model_path).lower() in NO_MODEL:
        return dtype_refusal(cfg.dtype) if cfg.dtype != "auto" else None
    from sglang.srt.arg_groups.model_override_base import model_config_of

    return dtype_refusal(model_config_of(server_args).dtype)


CHECKED = "_qsa_core_startup_checked"  # set on the record; pickled with it into the schedulers


def after_resolve_refuse(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of `ServerArgs.resolve_once`: end the launcher on a refusal (once per record)."""
    if getattr(server_args, CHECKED, False):
        return
    reason = startup_refusal(server_args)
    if reason is not None:
        raise StartupRefusal(reason)
    setattr(server_args, CHECKED, True)
