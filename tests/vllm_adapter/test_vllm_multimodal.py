"""vLLM's OpenAI server serves `Qwen4ExpForConditionalGeneration` with MRoPE in multimodal mode
(QSA layers on qsa_core): real image requests, greedy tokens equal to transformers'.

The checkpoint is `tiny_vl_config` (a one-block vision tower, interleaved MRoPE (11, 11, 10),
budget 16) with its processor saved beside it (`save_vl_processor`). Each prompt puts an image
of 4 x 5 merged patches (20 image tokens, all three MRoPE axes apart) across group boundaries.
Served alone, the first prompt's first prefill chunk (CHUNK = 42 tokens) ends inside the image,
inside a group: that group's key is rotated at the 3-axis position of its first token, an
image token of the step before, which only the ring's stored positions have. The text after
the image runs at MRoPE positions behind the logical ones. Then the first prompt is served
while the second decodes (mixed prefill / decode steps of two image requests). The server is
stopped by its pid at teardown.

Budget 16, not the production 2048: every row past 16 tokens selects, so the image's group
keys decide selections all through these short prompts. At 2048 only rows past 2051 tokens
select, and the oracle is too slow for CI: transformers took 58 s and 95 s for two 2.1K-token
image prompts (4 new tokens) on a shared 2-core machine, and 245 of 252 of its selections had
an exact 0.0 tie at the boundary. The production budget runs text-only in test_vllm_e2e.py. HF's top-k ties (exact
ReLU zeros) are broken by design.md §2.7, as the core breaks them (`spec_order_boundaries`).
"""

from __future__ import annotations

import base64
import io
import json
import re
import string
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
from hf_reference import spec_order_boundaries
from PIL import Image
from qwen4_checkpoint import save_vl_processor, tiny_vl_config, write_checkpoint
from server_process import ServerProcess

R = 4  # tiny_vl_config's compress ratio
BUDGET = 16
CHUNK = 42  # max_num_batched_tokens: the first prompt's first chunk ends inside a group of its image
MAX_TOKENS = 24  # greedy tokens compared with HF's
MIN_GAP = 1e-4  # relative top-k boundary margin: 10x the ~1e-5 relative fp32 drift of hidden states
# (letters before the image, image height x width in pixels, letters after it)
PROMPTS = [(29, (128, 160), 25), (14, (160, 128), 40)]
START_TIMEOUT_S = 300
MAX_MODEL_LEN = 256


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random RGB image (height, width), round-tripped through PNG as the server gets it."""
    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    return Image.open(io.BytesIO(png.getvalue())).convert("RGB")


def png_url(img: Image.Image) -> str:
    png = io.BytesIO()
    img.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def messages(seed: int, before: int, after: int, img: Image.Image | None) -> list[dict]:
    """One user message: `before` letters, the image (an image_url part, or the bare `image`
    part transformers' chat template takes when img is None), `after` letters (one token each)."""
    g = torch.Generator().manual_seed(seed)
    letters = string.ascii_letters
    text = ["".join(letters[i] for i in torch.randint(0, len(letters), (n,), generator=g).tolist())
            for n in (before, after)]
    picture = {"type": "image"} if img is None else {"type": "image_url", "image_url": {"url": png_url(img)}}
    parts = [{"type": "text", "text": text[0]}, picture, {"type": "text", "text": text[1]}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, fp32 HF `Qwen4ExpForConditionalGeneration`, its processor)."""
    from transformers import AutoProcessor

    folder = tmp_path_factory.mktemp("qwen4_vl_mm")
    config = tiny_vl_config()
    model = write_checkpoint(folder, config, seed=4)
    save_vl_processor(folder, config)
    return str(folder), model, AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf_runs(checkpoint):
    """Per prompt: HF's prompt ids, MRoPE positions int64 [3, L] and greedy tokens (HF's top-k
    ties broken by design.md §2.7); and the top-k boundary of every selection HF made."""
    _, model, processor = checkpoint
    runs = []
    with spec_order_boundaries() as bounds, torch.no_grad():
        for seed, (before, size, after) in enumerate(PROMPTS):
            text = processor.apply_chat_template(messages(seed, before, after, None), tokenize=False)
            inputs = processor(text=[text], images=[image(seed, size)], return_tensors="pt")
            ids = inputs["input_ids"]
            positions, _ = model.model.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                                      attention_mask=inputs["attention_mask"])
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
            runs.append((ids[0].tolist(), positions[:, 0], out[0, ids.shape[1]:].tolist()))
    return runs, bounds


def test_prompts_put_images_across_groups_and_chunks(checkpoint, hf_runs):
    """What the served requests exercise (checked on HF's own inputs): prompts past the budget;
    an image span crossing group boundaries, with a prefill chunk ending inside a group whose
    first token is an image token; all three MRoPE axes apart over the image; the text after
    it at positions behind the logical ones. Every selection's top-k boundary has a clear gap or
    is an exact ReLU tie at 0.0 (decided by the group index in HF, as wrapped, and in the core)."""
    folder, model, _ = checkpoint
    runs, bounds = hf_runs
    image_id = model.config.image_token_id
    for ids, positions, _ in runs:
        span = [i for i, t in enumerate(ids) if t == image_id]
        first, last = span[0], span[-1]
        assert len(ids) > BUDGET and span == list(range(first, last + 1)) and len(span) == 20
        assert any(first < g * R <= last for g in range(len(ids) // R))  # the span crosses a group boundary
        img = positions[:, first:last + 1]
        assert len({tuple(img[a].tolist()) for a in range(3)}) == 3  # t, h, w all differ
        tail = positions[:, last + 1:]
        assert (tail[0] == tail[1]).all() and (tail[0] == tail[2]).all()
        assert (tail[0] < torch.arange(last + 1, len(ids))).all()
    ids = runs[0][0]  # alone, its first chunk is tokens [0, CHUNK): the group it ends in starts on an image token
    assert CHUNK % R and ids[CHUNK - CHUNK % R] == image_id and ids[CHUNK] == image_id
    ties = [b for b in bounds if b[0] == b[1] == 0.0]
    close = [b for b in bounds if b not in ties and b[0] - b[1] <= MIN_GAP * b[2]]
    assert len(bounds) > 50 and not close, close[:5]
    print(f"\n{len(bounds)} HF selections past the budget, {len(ties)} with an exact 0.0 tie at the boundary")


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    """The OpenAI server of the multimodal checkpoint: QSA_CORE, fp32, chunked prefill of CHUNK
    tokens, images only (`--limit-mm-per-prompt`: videos need torchvision)."""
    folder = checkpoint[0]
    log = tmp_path_factory.mktemp("vllm_mm_server") / "server.log"
    command = lambda port: [  # noqa: E731
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--attention-backend", "QSA_CORE", "--enforce-eager", "--no-enable-prefix-caching",
        "--enable-chunked-prefill", "--block-size", "16", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "3", "--max-num-batched-tokens", str(CHUNK),
        "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}),
        "--kv-cache-memory-bytes", str(64 << 20)]
    served = ServerProcess.launch(command, str(log), timeout_s=START_TIMEOUT_S)
    try:
        print(f"\nvLLM OpenAI server (multimodal) healthy after {served.start_s:.0f} s")
        yield served.url, folder
    finally:
        served.stop()  # the launcher's process group: engine and workers


def running_requests(url: str) -> int:
    """vLLM's `vllm:num_requests_running` gauge (one engine)."""
    text = requests.get(url + "/metrics", timeout=30).text
    return int(float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1)))


def test_image_requests_equal_transformers(server, hf_runs):
    """Image chat requests, the first alone, then both together: the second streams, held
    running past HF's MAX_TOKENS up to the model length, and the first is sent once the second
    decodes (the two seen running at once). vLLM's prompt ids are HF's processor's, and its
    greedy tokens equal HF `generate`'s, token for token (the held request's first MAX_TOKENS:
    greedy tokens do not depend on how many follow)."""
    url, folder = server
    runs, _ = hf_runs

    def body(i: int, max_tokens: int, stream: bool) -> dict:
        before, size, after = PROMPTS[i]
        return {"model": folder, "messages": messages(i, before, after, image(i, size)), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}

    def chat(i: int) -> tuple[list[int], list[int]]:
        r = requests.post(f"{url}/v1/chat/completions", json=body(i, MAX_TOKENS, False), timeout=300)
        assert r.status_code == 200, r.text[:2000]
        answer = r.json()
        return answer["prompt_token_ids"], answer["choices"][0]["token_ids"]

    alone = chat(0)
    seen, done = [0], threading.Event()

    def poll() -> None:
        while not done.wait(0.02):
            seen[0] = max(seen[0], running_requests(url))

    held = MAX_MODEL_LEN - len(runs[1][0])  # the second request decodes to the model length
    prompt_ids, ids = [], []
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body(1, held, True), stream=True, timeout=300) as r:
            assert r.status_code == 200, r.text[:2000]
            lines = r.iter_lines()
            for line in lines:
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = json.loads(line[6:])
                    prompt_ids += chunk.get("prompt_token_ids") or []
                    ids += (chunk["choices"] or [{}])[0].get("token_ids") or []
                    if ids:
                        break
            first = chat(0)  # while the second request decodes
            for line in lines:
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    ids += (json.loads(line[6:])["choices"] or [{}])[0].get("token_ids") or []
    finally:
        done.set()
        poller.join(timeout=60)
    assert alone == (runs[0][0], runs[0][2])
    assert first == alone
    assert len(ids) == held and (prompt_ids, ids[:MAX_TOKENS]) == (runs[1][0], runs[1][2])
    assert seen[0] == len(PROMPTS), f"the two requests never ran together (at most {seen[0]})"
