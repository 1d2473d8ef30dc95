"""Serving checks shared by the SGLang and vLLM server suites, through `/v1/completions`.

Both engines take token-id prompts there and return the generated ids (`return_token_ids`),
streamed or not. Every call is bounded: `requests` timeouts bound each read, and each
thread pool is waited on with a deadline. The suites start their server (one per suite, on
127.0.0.1, stopped by its pid) and call these functions with its URL.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import requests

# 12 requests of mixed lengths (50 to 3000 tokens); every third one streams.
# One long prompt and eleven short ones: the SGLang server prefills ~100 tokens/s on 2 CPU cores,
# and every prompt is served twice.
LOAD_LENGTHS = (50, 3000, 55, 60, 70, 80, 100, 120, 150, 200, 250, 300)
LOAD_NEW_TOKENS = 6
READ_TIMEOUT_S = 300  # bound on each socket read of one request


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    """A deterministic token-id prompt over the first `vocab` ids."""
    return [(seed * 7919 + i * (seed + 13) * 104729 + i * i) % vocab for i in range(length)]


@dataclass
class Client:
    url: str
    model: str

    def body(self, prompt: list[int], max_tokens, stream: bool = False) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": stream}

    def post(self, body: dict | bytes, path: str = "/v1/completions") -> requests.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return requests.post(self.url + path, data=data, headers={"Content-Type": "application/json"},
                             timeout=READ_TIMEOUT_S)

    def complete(self, prompt: list[int], max_tokens: int, stream: bool = False) -> list[int]:
        """Greedy ids of one request (streamed chunks joined when `stream`)."""
        body = self.body(prompt, max_tokens, stream)
        if not stream:
            r = self.post(body)
            assert r.status_code == 200, r.text[:2000]
            return r.json()["choices"][0]["token_ids"]
        ids: list[int] = []
        with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=READ_TIMEOUT_S) as r:
            assert r.status_code == 200, r.text[:2000]
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return ids

    def start_stream(self, prompt: list[int], max_tokens: int, chunks: int) -> "Stream":
        """Open a streamed request and read until `chunks` chunks with tokens arrived; the caller closes it."""
        r = requests.post(self.url + "/v1/completions", json=self.body(prompt, max_tokens, True), stream=True,
                          timeout=READ_TIMEOUT_S)
        assert r.status_code == 200, r.text[:2000]
        stream = Stream(r, r.iter_lines())  # the line iterator must stay alive: dropping it ends the read
        seen = 0
        for line in stream.lines:
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                seen += bool(json.loads(line[6:])["choices"][0].get("token_ids"))
                if seen >= chunks:
                    return stream
        raise AssertionError(f"the stream ended after {seen} chunks, before {chunks}")

    def healthy(self) -> bool:
        return requests.get(self.url + "/health", timeout=30).status_code == 200


@dataclass
class Stream:
    """An open streamed response, partly read."""

    response: requests.Response
    lines: Iterator[bytes]

    def close(self) -> None:
        self.response.close()


def run_all(jobs: list, workers: int, deadline_s: float) -> list:
    """Run the callables concurrently and return their results in order; raise past the deadline."""
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(job) for job in jobs]
        end = time.monotonic() + deadline_s
        return [f.result(timeout=max(1.0, end - time.monotonic())) for f in futures]


def load_prompts(vocab: int) -> list[list[int]]:
    return [prompt(n, seed, vocab) for seed, n in enumerate(LOAD_LENGTHS)]


def served_alone_and_together(client: Client, vocab: int, running: Callable[[], int], deadline_s: float) -> dict:
    """Every load prompt alone (one at a time), then all 12 at once (every third streamed).

    `running()` is the server's count of running requests; it is polled while the 12 run
    ("max_running": the most seen, to show they were batched).
    """
    prompts = load_prompts(vocab)
    t0 = time.monotonic()
    alone = [client.complete(p, LOAD_NEW_TOKENS) for p in prompts]
    t1 = time.monotonic()
    jobs = [lambda p=p, s=(i % 3 == 0): client.complete(p, LOAD_NEW_TOKENS, stream=s) for i, p in enumerate(prompts)]
    seen = [0]
    errors: list[BaseException] = []
    done = threading.Event()

    def poll() -> None:
        try:
            while not done.wait(0.05):
                seen[0] = max(seen[0], running())
        except BaseException as err:  # re-raised in the test's thread below
            errors.append(err)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        together = run_all(jobs, len(jobs), deadline_s)
    finally:
        done.set()
        poller.join(timeout=60)
    if errors:
        raise errors[0]
    return {"alone": alone, "together": together, "alone_s": t1 - t0, "together_s": time.monotonic() - t1,
            "max_running": seen[0]}


def assert_together_equals_alone(out: dict, engine: str) -> None:
    """`served_alone_and_together`'s result: every request got its tokens, the 12 ran batched
    (at least 2 at once), and each gave batched what it gave alone."""
    assert [len(ids) for ids in out["alone"]] == [LOAD_NEW_TOKENS] * len(LOAD_LENGTHS)
    assert out["max_running"] >= 2, "the concurrent requests never ran together"
    for i, (alone, together) in enumerate(zip(out["alone"], out["together"])):
        assert together == alone, f"request {i} ({LOAD_LENGTHS[i]} tokens): batched {together}, alone {alone}"
    print(f"\n{engine} load: alone {out['alone_s']:.1f} s, 12 concurrent {out['together_s']:.1f} s, "
          f"at most {out['max_running']} running")


def wait_until(probe, deadline_s: float, what: str, poll_s: float = 0.5):
    """Poll `probe()` until it returns a truthy value; raise with `what` and the last value past the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not reached within {deadline_s} s (last: {value!r})")
        time.sleep(poll_s)
