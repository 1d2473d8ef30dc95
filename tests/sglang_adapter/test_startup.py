"""Start-up refusals of `--attention-backend qsa_core`: in the launcher, exit code 1, one line.

Three real `python -m sglang.launch_server` launches on the CPU (the flags of the server tests,
127.0.0.1, a free port): a split decode backend (`--decode-attention-backend triton`),
two-batch overlap (`--enable-two-batch-overlap`) and a float32 checkpoint without `--dtype`
(SGLang resolves `auto` to float16 for it). Each must end in the
launcher before any scheduler process starts: exit code 1, the refusal as the last line of the
output, no traceback, no model loaded. The rules themselves are checked on resolved arguments.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import types

import pytest
import torch
from ports import free_port
from qsa_adapters.sglang.startup import (
    after_resolve_refuse,
    dtype_refusal,
    overlap_refusal,
    parallel_refusal,
    speculative_refusal,
    split_backend_refusal,
    startup_refusal,
)
from sglang_server import launch_command
from tiny_checkpoint import write_checkpoint

LAUNCH_TIMEOUT_S = 240
# What the launcher logs only once a scheduler process builds the model.
SCHEDULER_MARKERS = ("Load weight begin", "QSA layers run on qsa_core")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("qwen4_exp_tiny")))


@pytest.fixture(scope="module")
def fp32_checkpoint(checkpoint, tmp_path_factory):
    """The same checkpoint, its config saying float32 (the weights are never read)."""
    folder = tmp_path_factory.mktemp("qwen4_exp_fp32")
    for name in os.listdir(checkpoint):
        if name != "config.json":
            os.symlink(os.path.join(checkpoint, name), folder / name)
    config = json.load(open(os.path.join(checkpoint, "config.json")))
    config["dtype"] = config["text_config"]["dtype"] = "float32"
    json.dump(config, open(folder / "config.json", "w"))
    return str(folder)


def launch(model: str, *extra: str) -> types.SimpleNamespace:
    """Run the launcher until it exits (bounded; its process group is killed by pid on timeout)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        launch_command(model, "qsa_core", free_port(), extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the launcher did not exit within {LAUNCH_TIMEOUT_S} s:\n{out[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    print(f"launcher exit {proc.returncode} after {time.monotonic() - t0:.1f} s: {lines[-1] if lines else ''}")
    return types.SimpleNamespace(rc=proc.returncode, out=out, last=lines[-1] if lines else "")


def assert_refused_in_launcher(run: types.SimpleNamespace, line: str) -> None:
    assert run.rc == 1, run.out[-3000:]
    assert run.last == line, run.out[-3000:]
    assert "Traceback" not in run.out, run.out[-3000:]
    started = [m for m in SCHEDULER_MARKERS if m in run.out]
    assert not started, f"a scheduler started before the refusal ({started})"


@pytest.mark.parametrize("flags, rule, start", [
    (("--decode-attention-backend", "triton"),
     lambda: split_backend_refusal(resolved(decode_attention_backend="triton")),
     "qsa_core: --decode-attention-backend triton: qsa_core must run both"),
    # refused before SGLang's own check of the flag (which asks for attention DP or an EP backend)
    (("--enable-two-batch-overlap",), lambda: overlap_refusal(resolved(enable_two_batch_overlap=True)),
     "qsa_core: --enable-two-batch-overlap: qsa_core does not serve two batches in flight"),
], ids=["split_decode_backend", "two_batch_overlap"])
def test_launcher_refuses_by_name(checkpoint, flags, rule, start):
    run = launch(checkpoint, *flags)
    assert_refused_in_launcher(run, "qsa_core: " + rule())
    assert run.last.startswith(start)


def test_launcher_refuses_a_float32_model(fp32_checkpoint):
    run = launch(fp32_checkpoint, "--dtype", "auto")  # the last --dtype wins: SGLang's auto
    assert_refused_in_launcher(run, "qsa_core: " + dtype_refusal(torch.float16))
    assert run.last.endswith("launch with --dtype bfloat16") and "would run in float16" in run.last


def resolved(**fields) -> types.SimpleNamespace:
    """Resolved server arguments as the rules read them (SGLang's defaults otherwise)."""
    base = dict(attention_backend="qsa_core", device="cuda", speculative_algorithm=None, speculative_eagle_topk=None,
                attn_cp_size=1, dcp_size=1, enable_prefill_cp=False, prefill_attention_backend=None,
                decode_attention_backend=None, enable_two_batch_overlap=False, enable_single_batch_overlap=False,
                enable_pdmux=False)
    return types.SimpleNamespace(**{**base, **fields})


def test_rules_name_the_flag():
    spec = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1)
    assert speculative_refusal(resolved(), None) is None
    assert speculative_refusal(resolved(**spec), "NEXTN") is None  # chain drafts, GPU or CPU
    assert speculative_refusal(resolved(**spec, device="cpu"), "NEXTN") is None
    assert speculative_refusal(resolved(**{**spec, "speculative_eagle_topk": 4}), "EAGLE") == (
        "--speculative-eagle-topk must be 1 with --speculative-algorithm EAGLE (qsa_core verifies chain drafts "
        "only), got 4")
    assert parallel_refusal(resolved()) is None
    assert parallel_refusal(resolved(attn_cp_size=2)).startswith("--attn-cp-size 2: ")
    assert parallel_refusal(resolved(dcp_size=4)).startswith("--dcp-size 4: ")
    assert parallel_refusal(resolved(enable_prefill_cp=True)).startswith("--enable-prefill-cp: ")
    assert overlap_refusal(resolved()) is None
    assert overlap_refusal(resolved(enable_two_batch_overlap=True)).startswith("--enable-two-batch-overlap: ")
    assert overlap_refusal(resolved(enable_pdmux=True)) == (
        "--enable-pdmux: qsa_core does not serve two batches in flight on separate attention backends (each keeps "
        "its own plan and raw-key ring); drop --enable-pdmux")
    assert overlap_refusal(resolved(enable_single_batch_overlap=True)) is None  # MoE streams, one batch
    assert split_backend_refusal(resolved(prefill_attention_backend="qsa_core")) is None
    assert split_backend_refusal(resolved(decode_attention_backend="fa3")).startswith(
        "--decode-attention-backend fa3: qsa_core must run both prefill and decode")
    assert dtype_refusal(torch.bfloat16) is None and dtype_refusal("bfloat16") is None
    assert dtype_refusal(torch.float32).endswith("launch with --dtype bfloat16")


def test_other_backends_are_never_refused(monkeypatch):
    import sglang.srt.arg_groups.overrides as overrides

    monkeypatch.setattr(overrides, "resolving_view", lambda args: args)
    args = resolved(attention_backend="qsa", device="cpu", speculative_algorithm="EAGLE", dcp_size=2)
    assert startup_refusal(args) is None
    with pytest.raises(SystemExit) as err:
        after_resolve_refuse(None, resolved(**{**vars(args), "attention_backend": "qsa_core"}))
    assert err.value.code.startswith("qsa_core: --dcp-size 2: ")
