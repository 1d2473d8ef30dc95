"""One greedy request to a running SGLang server (examples/sglang/launch.sh).

    python examples/sglang/client.py [--url http://localhost:30000] [--prompt-file FILE] [--openai]

Default: SGLang's native /generate; --openai: the `openai` client on /v1/completions.
A prompt longer than the QSA budget (2048 tokens) makes the indexer's selection matter.
"""

import argparse
import json
import urllib.request

DEFAULT_PROMPT = "Summarise the rules of chess in three sentences."


def generate(url: str, prompt: str, max_new_tokens: int) -> tuple[str, dict]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    req = urllib.request.Request(
        f"{url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.load(resp)
    return out["text"], out.get("meta_info", {})


def complete(url: str, prompt: str, max_new_tokens: int) -> tuple[str, dict]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_new_tokens, temperature=0.0)
    usage = {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens}
    return out.choices[0].text, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:30000")
    parser.add_argument("--prompt-file", help="a text file to use as the prompt (e.g. a long document)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--openai", action="store_true", help="use the openai client on /v1/completions")
    args = parser.parse_args()
    prompt = DEFAULT_PROMPT
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompt = f.read() + "\n\nSummarise the text above in three sentences."
    text, meta = (complete if args.openai else generate)(args.url, prompt, args.max_new_tokens)
    print(text)
    print(f"\nprompt tokens: {meta.get('prompt_tokens')}, completion tokens: {meta.get('completion_tokens')}")


if __name__ == "__main__":
    main()
