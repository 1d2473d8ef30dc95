"""Greedy generation with `vllm.LLM` from token ids (no tokenizer); run as a script.

python vllm_generate.py MODEL_DIR REQUEST_JSON OUT_JSON
REQUEST_JSON: {"prompts": [[ids]], "max_tokens": [n per prompt]};
OUT_JSON: {"tokens": [[ids]], "cached_tokens": [prompt tokens served from the prefix cache]}.
Small batches on purpose (max_num_seqs 3, 32 tokens per step): chunked prefills, decodes
beside prefills, finished requests' blocks and rings reused by waiting ones, and prefix-cache
hits for waiting prompts that share a finished one's first blocks.
"""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    model_dir, request_path, out_path = sys.argv[1:4]
    with open(request_path) as f:
        request = json.load(f)
    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=16, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32,
        enable_chunked_prefill=True, enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in request["max_tokens"]]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params)
    with open(out_path, "w") as f:
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                   "cached_tokens": [o.num_cached_tokens for o in outputs]}, f)


if __name__ == "__main__":  # vLLM spawns its engine processes
    main()
