"""The plugin: entry point, registration, CLI choice, hooks that pass through, refusals."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from hf_oracle import tiny_config
from qsa_adapters.sglang.checks import check_runner, model_qsa_config
from qsa_adapters.sglang.plugin import create_backend
from qsa_adapters.sglang.caches import check_pool
from qsa_adapters.sglang.hooks import backend_wrapper_around, find_core_backend, self_attention_around
from qsa_adapters.sglang.layer import run_qsa_layer
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_harness import Env, ensure_plugin

FRESH_PROCESS = r"""
import json
from importlib.metadata import entry_points
import sglang.srt.layers.attention.attention_registry as reg
import sglang.srt.model_executor.model_runner_components.attention_backend_setup as setup
before = {"wrapper": reg.attn_backend_wrapper, "qsa": reg.ATTENTION_BACKENDS["qsa"]}
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
from sglang.srt.models.qwen4_exp import Qwen4ExpAttentionDecoderLayer
out = {
    "entry_points": {e.name: e.value for e in entry_points(group="sglang.srt.plugins")},
    "registered": "qsa_core" in reg.ATTENTION_BACKENDS,
    "choice": "qsa_core" in ATTENTION_BACKEND_CHOICES,
    "qsa_unchanged": reg.ATTENTION_BACKENDS["qsa"] is before["qsa"],
    "wrapper_hooked": getattr(reg.attn_backend_wrapper, "__wrapped__", None) is before["wrapper"],
    "setup_sees_hook": setup.attn_backend_wrapper is reg.attn_backend_wrapper,
    "layer_patched": hasattr(Qwen4ExpAttentionDecoderLayer.self_attention, "__wrapped__"),
}
try:
    out["attention_backend"] = prepare_server_args(
        ["--model-path", "/nonexistent", "--attention-backend", "qsa_core"]).attention_backend
except SystemExit as e:
    out["attention_backend"] = f"SystemExit {e.code}"
print("RESULT " + json.dumps(out))
"""


def fresh_process(**env):
    """Run FRESH_PROCESS in a new interpreter (as SGLang spawns its scheduler processes)."""
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=240,
        env={**os.environ, **env},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_entry_point_loads_in_a_fresh_process():
    out = fresh_process()
    assert out["entry_points"].get("qsa_core") == "qsa_adapters.sglang.plugin:register"
    assert out["registered"] and out["choice"]
    assert out["attention_backend"] == "qsa_core"
    assert out["qsa_unchanged"], "the name 'qsa' must keep meaning SGLang's own backend"
    assert out["wrapper_hooked"] and out["setup_sees_hook"]
    assert not out["layer_patched"], "the layer is patched only when a qsa_core backend is built"


def test_sglang_plugins_filter_leaves_sglang_untouched():
    out = fresh_process(SGLANG_PLUGINS="some_other_plugin")
    assert not out["registered"] and not out["choice"]
    assert out["attention_backend"] == "SystemExit 2"  # argparse: invalid choice
    assert not out["wrapper_hooked"] and not out["layer_patched"]


CPU_SETTINGS = r"""
import json, logging, os
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.layers.rotary_embedding.base as rope
from sglang.srt.server_args import prepare_server_args
out = []
for argv in (["--attention-backend", "qsa", "--device", "cpu"],
             ["--attention-backend", "qsa_core", "--device", "cuda"],
             ["--attention-backend", "qsa_core", "--device", "cpu"]):
    prepare_server_args(["--model-path", "dummy"] + argv).resolve_once()  # the launcher's hook point
    out.append({"interpret": os.environ.get("TRITON_INTERPRET"), "rope_cpu": bool(rope._is_cpu)})
print("RESULT " + json.dumps(out))
"""


def test_cpu_settings_only_for_qsa_core_on_the_cpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CPU_SETTINGS], capture_output=True, text=True, timeout=240, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    untouched = {"interpret": None, "rope_cpu": False}
    assert json.loads(lines[-1][len("RESULT ") :]) == [untouched, untouched, {"interpret": "1", "rope_cpu": True}]
    assert proc.stderr.count("qsa_core on the CPU: TRITON_INTERPRET=1") == 1


@pytest.fixture(scope="module")
def env():
    ensure_plugin()
    return Env()


class FakeHybrid:
    """Stands for HybridLinearAttnBackend: (full, linear, full layer ids)."""

    def __init__(self, full, linear, layers):
        self.full_attn_backend, self.linear_attn_backend, self.full_attn_layers = full, linear, layers


def test_wrapper_hook_keeps_other_backends_and_swaps_in_ours(env):
    def original(runner, full):
        return FakeHybrid("QwenSparseAttnBackend", "gdn", [3, 7]) if full is env.backend else ("sglang", full)

    other = object()
    assert backend_wrapper_around(original, env.runner, other) == ("sglang", other)
    rebuilt = backend_wrapper_around(original, env.runner, env.backend)
    assert isinstance(rebuilt, FakeHybrid) and rebuilt.full_attn_backend is env.backend
    assert (rebuilt.linear_attn_backend, rebuilt.full_attn_layers) == ("gdn", [3, 7])
    assert find_core_backend(rebuilt) is env.backend and find_core_backend(FakeHybrid(other, None, [])) is None


def test_layer_hook_runs_the_original_unless_qsa_core_is_active(env):
    calls = []

    def original(layer, positions, hidden_states, forward_batch):
        calls.append((layer, positions, hidden_states, forward_batch))
        return "original"

    layer = types.SimpleNamespace(is_qsa=True)
    args = (layer, "positions", "hidden", "batch")
    assert self_attention_around(original, *args) == "original"  # no forward context
    with forward_context(ForwardContext(attn_backend=FakeHybrid(object(), object(), [3]))):
        assert self_attention_around(original, *args) == "original"  # another backend
    not_qsa = types.SimpleNamespace(is_qsa=False)
    with forward_context(ForwardContext(attn_backend=FakeHybrid(env.backend, object(), [3]))):
        assert self_attention_around(original, not_qsa, "p", "h", "b") == "original"
    assert calls == [args, args, (not_qsa, "p", "h", "b")]


def test_draft_runner_gets_sglang_qsa_and_split_backends_are_refused(env):
    """A speculative draft runner (the MTP layer) is served by SGLang's own QSA backend; the
    target runner, speculating or not, by qsa_core."""
    from sglang.srt.layers.attention.qwen_sparse_attn_backend import QwenSparseAttnBackend

    draft = types.SimpleNamespace(**{**vars(env.runner), "is_draft_worker": True})
    assert type(create_backend(draft)) is QwenSparseAttnBackend
    eagle = types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"))
    check_runner(eagle)  # speculation is refused by the launcher on the CPU only (test_startup.py)
    split = types.SimpleNamespace(prefill_attention_backend_str="qsa_core", decode_attention_backend_str="fa3")
    with pytest.raises(ValueError, match="decode='fa3'"):
        check_runner(split)
    # a runner built without the launcher's refusal (test_startup.py) for two batches in flight
    check_runner(types.SimpleNamespace(server_args=ServerArgs(model_path="dummy")))
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        overlapped = types.SimpleNamespace(server_args=ServerArgs(model_path="dummy", **{flag: True}))
        with pytest.raises(ValueError, match=f"^qsa_core: --{flag.replace('_', '-')}: qsa_core does not serve two"):
            check_runner(overlapped)


def test_refuses_models_and_pools_it_cannot_serve(env):
    cfg = tiny_config()
    for k in ("indexer_n_heads", "indexer_budget"):
        setattr(cfg, k, None)
    plain = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=cfg, hf_config=cfg), token_to_kv_pool=env.pool
    )
    with pytest.raises(ValueError, match="QSA profile"):
        model_qsa_config(plain)
    config = model_qsa_config(env.runner)
    with pytest.raises(TypeError, match="QSATokenToKVPool"):
        check_pool(object(), config, torch.bfloat16)
    page = env.pool.page_size
    try:
        env.pool.page_size = 66
        with pytest.raises(ValueError, match="page_size to be a multiple of indexer_compress_ratio"):
            check_pool(env.pool, config, torch.bfloat16)
    finally:
        env.pool.page_size = page
    with pytest.raises(ValueError, match="qsa_token_topk must be 32"):
        check_pool(env.pool, config.model_copy(update={"token_topk": 32}), torch.bfloat16)
    with pytest.raises(ValueError, match=r"ring's dtype torch.bfloat16 only.*launch with --dtype bfloat16, got model "
                                         r"dtype torch.float16"):
        check_pool(env.pool, config, torch.float16)


def test_config_takes_the_cache_dtypes_of_the_pool(env, monkeypatch):
    """The core checks each cache's dtype against the config when it binds the pool's views:
    the pool's K/V dtype (fp8 under --kv-cache-dtype) and compressed-key dtype
    (--qsa-indexer-dtype) become kv_cache_dtype and index_dtype."""
    config = model_qsa_config(env.runner)
    assert (config.kv_cache_dtype, config.index_dtype) == ("bf16", "bf16")
    monkeypatch.setattr(env.pool, "dtype", torch.float8_e5m2)
    monkeypatch.setattr(env.pool, "qsa_compressed_dtype", torch.float8_e4m3fn)
    config = model_qsa_config(env.runner)
    assert (config.kv_cache_dtype, config.index_dtype) == ("fp8_e5m2", "fp8_e4m3")


def test_backend_refuses_unhooked_calls_prefill_graphs_and_context_parallel(env):
    env.admit("unhooked")
    fb = env.extend({"unhooked": 5})
    env.backend.init_forward_metadata(fb)
    q = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="without qsa_inputs"):
        env.backend.forward_extend(q, q, q, types.SimpleNamespace(layer_id=3), fb)
    env.backend.init_cuda_graph_state(4, 8)
    with pytest.raises(NotImplementedError, match="decode CUDA graphs only"):
        env.backend.init_forward_metadata_out_graph(fb, in_capture=True)
    cp = types.SimpleNamespace(attn_cp_metadata=object(), forward_mode=ForwardMode.EXTEND)
    with pytest.raises(NotImplementedError, match="prefill context parallelism"):
        run_qsa_layer(types.SimpleNamespace(layer_id=3), torch.zeros(1, 256), cp)
