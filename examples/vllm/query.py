"""Ask a running vLLM OpenAI server (examples/vllm/serve.sh) for a greedy completion.

Usage: python examples/vllm/query.py [--url http://127.0.0.1:8000] [--length 60] [--max-tokens 8]
Sends token ids (works with --skip-tokenizer-init) and prints the generated ids; on an error
it prints the server's own error text.
"""

import argparse
import random
import sys

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--length", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="none", timeout=300, max_retries=0)
    try:
        model = client.models.list().data[0].id
        prompt = [random.Random(0).randrange(256) for _ in range(args.length)]
        choice = client.completions.create(
            model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    except openai.APIStatusError as e:
        sys.exit(f"server answered {e.status_code}: {e.response.text}")
    except openai.APIConnectionError as e:
        sys.exit(f"no server at {args.url}: {e}")
    print(f"prompt: {len(prompt)} token ids; generated: {choice.token_ids}")


if __name__ == "__main__":
    main()
