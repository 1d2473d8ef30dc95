"""SGLang 0.5.23 adapter: `--attention-backend qsa_core` runs Qwen4-Exp's QSA layers on `qsa_core`.

Loaded by SGLang through the `sglang.srt.plugins` entry point (`plugin.register`) in the
launcher and in every scheduler process. Modules: `plugin` (registration, backend factory),
`startup` (refusals at server start, in the launcher), `cpu` (what SGLang needs on the CPU,
for qsa_core only), `checks` (scheduler-side refusals), `hooks` (the two model hooks), `layer`
(a QSA layer's projections), `backend` (the attention-backend interface; the core's
`qsa_indexer` / `qsa_attention` calls), `batch_map` (ForwardBatch -> `QSAStepInputs`),
`cuda_graph` (static metadata buffers), `caches` (views over QSATokenToKVPool), `ring` (the
adapter's raw-key ring, room for draft rows), `ring_guard` (cached-prefix refusal), `vocab_guard` (token ids outside the vocabulary,
refused in the launcher for every backend). Importing this package imports no
SGLang module.
"""
