"""Greedy generation with `vllm.LLM` from token ids (no tokenizer); run as a script.

python vllm_generate.py REQUEST_JSON OUT_JSON
REQUEST_JSON: {"llm": {LLM keyword arguments}, "prompts": [[ids]], "max_tokens": [n per prompt],
"prompt_logprobs": bool}.
OUT_JSON: {"tokens": [[ids]], "cached_tokens": [prompt tokens served from the prefix cache],
"prompt_logprobs": [[log-prob of each prompt token after the first]] (when asked)}.
"""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    request_path, out_path = sys.argv[1:3]
    with open(request_path) as f:
        request = json.load(f)
    llm = LLM(skip_tokenizer_init=True, enforce_eager=True, **request["llm"])
    want_logprobs = request.get("prompt_logprobs", False)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False,
                       prompt_logprobs=0 if want_logprobs else None)
        for n in request["max_tokens"]
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "cached_tokens": [o.num_cached_tokens for o in outputs]}
    if want_logprobs:
        result["prompt_logprobs"] = [
            [entry[tok].logprob for entry, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            for o in outputs
        ]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine processes
    main()
