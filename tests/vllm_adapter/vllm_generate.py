"""Greedy generation with `vllm.LLM` from token ids (no tokenizer); run as a script.

python vllm_generate.py REQUEST_JSON OUT_JSON
REQUEST_JSON: {"llm": {LLM keyword arguments}, "prompts": [[ids]], "max_tokens": [n per prompt],
"prompt_logprobs": bool, "logprobs": k, "record_steps": path, "rank_selections": bool, "repeat": n,
"spec_metrics": bool} (the LLM keyword arguments default to skip_tokenizer_init and enforce_eager;
"repeat" runs the batch n times and reports the last round's outputs).
OUT_JSON: {"tokens": [[ids]], "cached_tokens": [prompt tokens served from the prefix cache],
"prompt_logprobs": [[log-prob of each prompt token after the first]] (when asked),
"init_seconds": the LLM's construction, "generate_seconds": [wall time of each round],
"logprobs": [[{token: log-prob} of the k most likely tokens at each generated position]] (with k)}.
With "record_steps" the model runs in this process and every step's vLLM metadata (the main
group's `CommonAttentionMetadata` fields, the ring group's block table) and the adapter's
core record (the plan's metadata) are saved there (torch.save, a list of dicts).
With "rank_selections" every worker (one per tensor-parallel rank) records a digest of each
selection its QSA indexers make; OUT_JSON then has "ranks": per worker, its "selections"
([layer prefix, rows, skip_topk (an MTP step reusing step 0's selection), sha256 of the int32
rows, rows past the budget] per call, in order) and
its QSA layers' "heads" ([query heads, KV heads, main K/V cache shape] per layer) and
"kv_caches" ([vLLM's main K/V page dtype, the core's K and V view dtypes, k_scale, v_scale] per layer).
"""

import json
import os
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    request_path, out_path = sys.argv[1:3]
    with open(request_path) as f:
        request = json.load(f)
    steps: list[dict] = []
    if request.get("record_steps"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        request["llm"]["distributed_executor_backend"] = "uni"
        record_steps(steps)
    if request.get("rank_selections"):  # the probes are functions sent to the workers (cloudpickle)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if request.get("spec_metrics"):
        request["llm"]["disable_log_stats"] = False
    start = time.monotonic()
    llm = LLM(**{"skip_tokenizer_init": True, "enforce_eager": True, **request["llm"]})
    init_seconds = time.monotonic() - start
    if request.get("rank_selections"):
        llm.collective_rpc(install_selection_probe, timeout=60)
    want_logprobs = request.get("prompt_logprobs", False)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False,
                       prompt_logprobs=0 if want_logprobs else None, logprobs=request.get("logprobs"))
        for n in request["max_tokens"]
    ]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    seconds = []
    for _ in range(request.get("repeat", 1)):  # later rounds: warm kernels (and prefix cache hits)
        start = time.monotonic()
        outputs = llm.generate(prompts, params)
        seconds.append(time.monotonic() - start)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "cached_tokens": [o.num_cached_tokens for o in outputs],
              "init_seconds": init_seconds, "generate_seconds": seconds}
    if want_logprobs:
        result["prompt_logprobs"] = [
            [entry[tok].logprob for entry, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            for o in outputs
        ]
    if request.get("logprobs"):
        result["logprobs"] = [[{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                              for o in outputs]
    if request.get("rank_selections"):
        result["ranks"] = llm.collective_rpc(selection_records, timeout=60)
    if request.get("spec_metrics"):  # speculative decoding's counters: drafts, draft tokens, accepted
        names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        result["spec_decode"] = {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
                                 if m.name.removeprefix("vllm:spec_decode_") in names}
    with open(out_path, "w") as f:
        json.dump(result, f)
    if request.get("record_steps"):
        import torch

        torch.save(steps, request["record_steps"])


def install_selection_probe(worker) -> None:
    """(In each worker; sent by `collective_rpc`) Record a digest of every selection made."""
    import hashlib

    from qsa_adapters.vllm.indexer import QSAIndexer

    forward, records = QSAIndexer.forward, []

    def probe(self, *args, **kwargs):
        selection, indexed = forward(self, *args, **kwargs)
        if indexed is not None:  # a step with metadata (not a profiling run)
            rows = selection.cpu().contiguous()
            digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()
            past = int((rows[:, -1] > self.qsa_config.token_topk).sum())
            records.append([self.prefix, rows.shape[0], self.skip_topk, digest, past])
        return selection, indexed

    QSAIndexer.forward = probe
    QSAIndexer.probe_records = records


def selection_records(worker) -> dict:
    """(In each worker) The probe's records and the worker's QSA layers' heads and caches."""
    from qsa_adapters.vllm.indexer import QSAIndexer
    from qsa_adapters.vllm.qwen4_exp import QSACoreAttention

    layers = [m for m in worker.get_model().modules() if isinstance(m, QSACoreAttention)]
    heads = [[m.num_heads, m.num_kv_heads, list(m.kv_cache.shape)] for m in layers]
    bound = [m.indexer.layer_cache(m.kv_cache, m._k_scale_float, m._v_scale_float)[0] for m in layers]
    kv_caches = [[str(m.kv_cache.dtype), str(c.k.dtype), str(c.v.dtype), c.k_scale, c.v_scale]
                 for m, c in zip(layers, bound)]
    return {"selections": QSAIndexer.probe_records, "heads": heads, "kv_caches": kv_caches}


def record_steps(steps: list[dict]) -> None:
    """Wrap the backend's step pairing so each completed step is appended to `steps`."""
    from qsa_adapters.vllm.backend import QSAStepPairing

    add = QSAStepPairing.add
    last: list = [None]

    def recording(self, common, *, is_ring):
        step = add(self, common, is_ring=is_ring)
        if step.records and step is not last[0]:
            last[0] = step
            main = step.main
            (geometry, plan), = step.records.items()
            meta = plan.meta
            steps.append({
                "common": {k: (v.clone() if hasattr(v, "clone") else v) for k, v in {
                    "query_start_loc_cpu": main.query_start_loc_cpu, "seq_lens": main.seq_lens,
                    "num_reqs": main.num_reqs, "num_actual_tokens": main.num_actual_tokens,
                    "block_table": main.block_table_tensor, "slot_mapping": main.slot_mapping,
                    "positions": main.positions, "max_query_len": main.max_query_len,
                    "max_seq_len": main.max_seq_len}.items()},
                "ring_block_table": step.ring_block_table.clone(),
                "geometry": geometry.__dict__,
                "meta": {**{k: (v.clone() if hasattr(v, "clone") else v) for k, v in meta.__dict__.items()},
                         "num_tokens": meta.num_tokens, "num_reqs": meta.num_reqs},
            })
        return step

    QSAStepPairing.add = recording


if __name__ == "__main__":  # vLLM spawns its engine processes
    main()
