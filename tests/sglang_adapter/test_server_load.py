"""A real SGLang 0.5.23 server with `--attention-backend qsa_core` under load, aborts and hostile requests.

One server (the tiny checkpoint of `test_server.py`: bf16, every layer QSA, 8192 positions;
`sglang_server` flags: 4 running requests, 16384 KV tokens, 1024-token prefill chunks) serves
every test of this module on 127.0.0.1; it is stopped by its pid at teardown, also on failure.
Clients speak `/v1/completions` with token-id prompts (`server_load`) and `/generate`.
"""

from __future__ import annotations

import os

import pytest
import requests
import sglang  # noqa: F401  (the suite fails, never skips, without SGLang in its venv)
from server_load import (Client, assert_together_equals_alone, prompt, run_all, served_alone_and_together,
                         wait_until)
from sglang_server import Server
from tiny_checkpoint import TEXT, VOCAB_SIZE, VOCAB_WORDS, write_checkpoint

CONTEXT = TEXT["max_position_embeddings"]
MAX_RUNNING = 4  # sglang_server's --max-running-requests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_checkpoint(str(tmp_path_factory.mktemp("qwen4_exp_tiny")))
    saved = os.environ.pop("TRITON_INTERPRET", None)  # the plugin sets it for the server itself
    try:
        srv = Server.start(folder, "qsa_core", str(tmp_path_factory.mktemp("load") / "server.log"),
                           {"TORCHDYNAMO_DISABLE": "1"})
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    print(f"\nSGLang server healthy after {srv.start_s:.0f} s")
    try:
        yield srv, Client(srv.url, folder)
    finally:
        srv.stop()


def load(url: str) -> dict:
    """The scheduler's live load (`/v1/loads`: running requests, KV tokens in use)."""
    (snapshot,) = requests.get(url + "/v1/loads", timeout=30).json()["loads"]
    return snapshot


def assert_up(server) -> None:
    srv, client = server
    assert srv.proc.poll() is None, f"server exited with {srv.proc.returncode}:\n{srv.log_tail()}"
    assert len(client.complete(prompt(20, 77, VOCAB_WORDS), 1)) == 1 and client.healthy()


def test_concurrent_mixed_requests_equal_each_served_alone(server):
    _, client = server
    out = served_alone_and_together(client, VOCAB_WORDS, lambda: load(client.url)["num_running_reqs"], deadline_s=900)
    assert_together_equals_alone(out, "SGLang")


def test_closed_streams_free_their_memory(server):
    """Streams closed mid-way are aborted: the scheduler's KV tokens in use return to 0 long
    before the requests could have finished (3000 tokens each), and the next request is served."""
    _, client = server
    prompts = [prompt(100 + 40 * i, 40 + i, VOCAB_WORDS) for i in range(MAX_RUNNING)]
    streams = run_all([lambda p=p: client.start_stream(p, 3000, chunks=2) for p in prompts], MAX_RUNNING, 300)
    try:
        held = wait_until(lambda: (s := load(client.url))["num_running_reqs"] == MAX_RUNNING and s, 60,
                          "the streams running")
        assert held["num_used_tokens"] >= sum(map(len, prompts))
    finally:
        for s in streams:
            s.close()
    wait_until(lambda: (s := load(client.url))["num_running_reqs"] == 0 and s["num_used_tokens"] == 0, 60,
               "KV tokens freed after the clients closed")
    assert_up(server)


OK = prompt(10, 5, VOCAB_WORDS)


def completion(prompt_ids, max_tokens) -> dict:
    return {"prompt": prompt_ids, "max_tokens": max_tokens}


@pytest.mark.parametrize(
    "name, path, body, says",
    [
        ("malformed JSON", "/v1/completions", b'{"model": "m", "prompt": [1, 2', "JSON decode error"),
        ("malformed JSON", "/generate", b'{"input_ids": [1, 2', "JSON decode error"),
        ("prompt longer than the context", "/v1/completions", completion(prompt(CONTEXT + 10, 6, VOCAB_WORDS), 4),
         "longer than the model's context length"),
        ("max_tokens 0", "/v1/completions", completion(OK, 0), "max_tokens must be positive"),
        ("max_tokens negative", "/v1/completions", completion(OK, -3), "max_tokens must be positive"),
        ("max_tokens huge", "/v1/completions", completion(OK, 10**9), "maximum context length"),
        ("max_new_tokens negative", "/generate", {"input_ids": OK, "sampling_params": {"max_new_tokens": -3}},
         "max_new_tokens must be at least 0"),
        ("token id past the vocabulary", "/v1/completions", completion(OK[:4] + [VOCAB_SIZE] + OK[4:], 4),
         f"input_ids[4] = {VOCAB_SIZE} is not a token id of this model: expected an integer in [0, {VOCAB_SIZE})"),
        ("token id past the vocabulary", "/generate", {"input_ids": OK + [10**6], "sampling_params": {"max_new_tokens": 4}},
         f"input_ids[{len(OK)}] = 1000000 is not a token id"),
        ("negative token id", "/generate", {"input_ids": [-1] + OK, "sampling_params": {"max_new_tokens": 4}},
         "input_ids[0] = -1 is not a token id"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_the_server_stays_up(server, name, path, body, says):
    """Each gets a 400 that says what is wrong, and a good request is served after it. Token
    ids outside the vocabulary are the plugin's refusal (`vocab_guard`): unguarded, SGLang
    0.5.23 crashes its scheduler on them and every server process exits."""
    _, client = server
    if isinstance(body, dict) and path == "/v1/completions":
        body = client.body(body["prompt"], body["max_tokens"])
    r = client.post(body, path)
    assert r.status_code == 400, f"{name}: {r.status_code} {r.text[:1000]}"
    assert says in r.text, f"{name}: {r.text[:1000]}"
    assert_up(server)


def test_generate_accepts_max_new_tokens_0_as_a_prefill_only_request(server):
    """SGLang's native /generate takes max_new_tokens 0 (a prefill, no token: used for scoring);
    /v1/completions refuses max_tokens 0 (above). Both answers are deliberate."""
    _, client = server
    r = client.post({"input_ids": OK, "sampling_params": {"max_new_tokens": 0}}, "/generate")
    assert r.status_code == 200, r.text[:1000]
    out = r.json()
    assert out["output_ids"] == [] and out["meta_info"]["prompt_tokens"] == len(OK)
    assert_up(server)
