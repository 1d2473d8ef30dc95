"""vLLM's OpenAI server (QSA layers on qsa_core) under load, aborts and hostile requests.

One `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (a free port) serves every test
of this module; it is stopped by its pid (its process group) at teardown, also on failure, and
every wait is bounded. The checkpoint is the suite's tiny fp32 model with 4096 positions and a
word tokenizer saved beside it (without a tokenizer, `--skip-tokenizer-init`, vLLM 0.32.0 does
not check prompt ids against the vocabulary: one id outside it kills the engine, see NOTES.md).
"""

from __future__ import annotations

import re
import sys

import pytest
import requests
from qwen4_checkpoint import tiny_config, write_checkpoint
from server_load import (Client, assert_together_equals_alone, prompt, run_all, served_alone_and_together,
                         wait_until)
from server_process import ServerProcess

VOCAB = 512
CONTEXT = 4096
MAX_SEQS = 4
START_TIMEOUT_S = 300


def save_word_tokenizer(folder: str) -> None:
    """A tokenizer whose words "w0" .. "w511" are the token ids 0 .. 511."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(folder)


def metrics(url: str) -> dict[str, float]:
    """The unlabelled-name -> value map of vLLM's Prometheus gauges (one engine)."""
    text = requests.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(vllm:\w+)\{[^}]*\} (\S+)$", text, re.M)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen4_served"))
    write_checkpoint(folder, tiny_config(max_position_embeddings=CONTEXT, vocab_size=VOCAB), seed=0)
    save_word_tokenizer(folder)
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    command = lambda port: [  # noqa: E731
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--attention-backend", "QSA_CORE", "--enforce-eager", "--no-enable-prefix-caching",
        "--enable-chunked-prefill", "--block-size", "16", "--max-model-len", str(CONTEXT),
        "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", "512",
        "--kv-cache-memory-bytes", str(64 << 20)]
    served = ServerProcess.launch(command, str(log), timeout_s=START_TIMEOUT_S)
    try:
        print(f"\nvLLM OpenAI server healthy after {served.start_s:.0f} s")
        yield Client(served.url, folder), served.proc, log
    finally:
        served.stop()  # the launcher's process group: engine and workers


def assert_up(server) -> None:
    client, proc, log = server
    assert proc.poll() is None, f"server exited:\n{log.read_text()[-6000:]}"
    assert len(client.complete(prompt(20, 77, VOCAB), 1)) == 1 and client.healthy()


def test_concurrent_mixed_requests_equal_each_served_alone(server):
    client, _, _ = server
    out = served_alone_and_together(client, VOCAB, lambda: int(metrics(client.url)["vllm:num_requests_running"]),
                                    deadline_s=600)
    assert_together_equals_alone(out, "vLLM")


def test_closed_streams_free_their_memory(server):
    """Streams closed mid-way are aborted: their KV blocks return (vLLM's kv_cache_usage_perc
    gauge, 0 when no block is held) long before they could have finished, and the next request
    is served."""
    client, _, _ = server
    prompts = [prompt(300 + 50 * i, 40 + i, VOCAB) for i in range(MAX_SEQS)]
    streams = run_all([lambda p=p: client.start_stream(p, 3000, chunks=2) for p in prompts], MAX_SEQS, 300)
    try:
        held = wait_until(lambda: (m := metrics(client.url))["vllm:num_requests_running"] == MAX_SEQS and m, 60,
                          "the streams running")
        assert held["vllm:kv_cache_usage_perc"] > 0
    finally:
        for s in streams:
            s.close()
    # 3000 tokens each would take minutes; an aborted request frees its blocks at once.
    wait_until(lambda: (m := metrics(client.url))["vllm:num_requests_running"] == 0
               and m["vllm:kv_cache_usage_perc"] == 0.0, 60, "blocks freed after the clients closed")
    assert_up(server)


BAD_OK = prompt(10, 5, VOCAB)


@pytest.mark.parametrize(
    "name, body, says",
    [
        ("malformed JSON", b'{"model": "m", "prompt": [1, 2', "JSON"),
        ("prompt longer than the context", dict(prompt=prompt(CONTEXT + 10, 6, VOCAB), max_tokens=4), "context length"),
        ("max_tokens 0", dict(prompt=BAD_OK, max_tokens=0), "max_tokens"),
        ("max_tokens negative", dict(prompt=BAD_OK, max_tokens=-3), "max_tokens"),
        ("max_tokens huge", dict(prompt=BAD_OK, max_tokens=10**9), "max_tokens"),
        ("token id outside the vocabulary", dict(prompt=BAD_OK + [VOCAB + 1000], max_tokens=4), "out of vocabulary"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_the_server_stays_up(server, name, body, says):
    """vLLM refuses each with a 400 naming the problem (max_tokens 0 included: vLLM wants at
    least 1 on /v1/completions, as a serving engineer would); a good request follows."""
    client, _, _ = server
    if isinstance(body, dict):
        body = client.body(body["prompt"], body["max_tokens"])
    r = client.post(body)
    assert r.status_code == 400, f"{name}: {r.status_code} {r.text[:1000]}"
    assert says in r.json()["error"]["message"], f"{name}: {r.text[:1000]}"
    assert_up(server)
