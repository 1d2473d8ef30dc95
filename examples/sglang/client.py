"""One request to a running SGLang server (examples/sglang/launch.sh), greedy decoding.

    python examples/sglang/client.py [--url http://localhost:30000] [--prompt-file FILE]

Uses SGLang's native /generate endpoint; the OpenAI-compatible /v1/completions works too.
A prompt longer than the QSA budget (2048 tokens) makes the indexer's selection matter.
"""

import argparse
import json
import urllib.request

DEFAULT_PROMPT = "Summarise the rules of chess in three sentences."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:30000")
    parser.add_argument("--prompt-file", help="a text file to use as the prompt (e.g. a long document)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    prompt = DEFAULT_PROMPT
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompt = f.read() + "\n\nSummarise the text above in three sentences."
    body = {"text": prompt, "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}}
    req = urllib.request.Request(
        f"{args.url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.load(resp)
    meta = out.get("meta_info", {})
    print(out["text"])
    print(f"\nprompt tokens: {meta.get('prompt_tokens')}, completion tokens: {meta.get('completion_tokens')}")


if __name__ == "__main__":
    main()
