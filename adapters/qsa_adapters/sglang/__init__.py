"""SGLang 0.5.23 adapter: `--attention-backend qsa_core` runs Qwen4-Exp's QSA layers on `qsa_core`.

Loaded by SGLang through the `sglang.srt.plugins` entry point (`plugin.register`) in the
launcher and in every scheduler process. Modules: `plugin` (registration, backend factory),
`checks` (refusals), `hooks` (the two SGLang hooks), `layer` (a QSA layer on the core),
`backend` (the attention-backend interface), `batch_map` (ForwardBatch -> step metadata
inputs), `cuda_graph` (static metadata buffers), `caches` (views over QSATokenToKVPool),
`ring_guard` (cached-prefix refusal). Importing this package imports no SGLang module.
"""
