"""Ask a running `vllm serve` of the tiny QSA model for greedy tokens (token ids in and out).

Usage: python examples/vllm/query.py [--url http://127.0.0.1:8000] [--length 60] [--max-tokens 8]
A prompt longer than the budget (16 tokens) makes every step select its tokens.
"""

import argparse
import json
import random
import urllib.request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--length", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with urllib.request.urlopen(f"{args.url}/v1/models") as r:
        model = json.load(r)["data"][0]["id"]
    prompt = [random.Random(0).randrange(384) for _ in range(args.length)]
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(f"{args.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        choice = json.load(r)["choices"][0]
    print(f"prompt: {len(prompt)} token ids; generated: {choice['token_ids']}")


if __name__ == "__main__":
    main()
