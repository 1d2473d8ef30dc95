"""After `QSAPlanner.warm`, no step an engine can plan compiles anything new, launches included.

A bound launch compiles again where a call's free arguments specialize differently from the
binding's (a chunk's first row `row0`, a tensor's alignment), so the warm-up must cover what
the layer calls pass, not only what they bind. Here, in a fresh process without
TRITON_INTERPRET (the production tiles; `sm90.recording`: an sm_90 GPU of 132 SMs, nothing
compiled or launched), the engines' warm-up runs (static steps, decode query lengths 1 and 4),
then random valid steps are planned, bound and run through the layer's prepare, select and
attention calls with every binding and every call recorded; each one's Triton key
(`sm90.spec_key`) must be one the warm-up compiled. Configurations: the H100 runs' 8K context
/ 2048 rows and 128K / 8192 rows, 256 requests, static steps (CUDA graphs); and eager steps
(`plan(static=False)`) at 8K on the engine's own block tables, sized per step as SGLang's are
(ceil(max_seq_len / page_size) pages: any row stride, 1 included), with the warm-up told so
(`block_table_strides=(1, 16, 17)`). Each process
prints `<name> warm=<variants> seen=<keys> missed=<n>` and a `MISSED <kernel> ...` line per
key the warm-up did not compile.
"""

from __future__ import annotations

import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (max_model_len, max_num_tokens, max_num_reqs, random steps, static: else eager on tables sized per step)
CONFIGS = {"8k": (8192, 2048, 256, 80, True), "128k": (131072, 8192, 256, 50, True),
           "8k-eager": (8192, 2048, 256, 80, False)}


def check(name: str) -> None:
    import torch

    import sm90
    from qsa_core.layer import bind_layer
    from qsa_kernels import launch
    from test_compile_sm90 import _config, _norms, _planner, _random_step

    L, N, R, count, static = CONFIGS[name]
    cfg = _config("bf16", "bf16")
    with sm90.recording() as found:
        planner, caches = _planner(cfg, 2, N, L, R)
        planner.warm(caches, decode_query_lens=(1, 4), static=static, block_table_strides=() if static else (1, 16, 17))
        warmed = {sm90.spec_key(b) for b in found.bindings.values()}
        seen = sm90.Recording()

        class Recorded:
            """A binding whose calls are recorded with their free arguments (launching nothing)."""

            def __init__(self, launcher, grid, values, options, free, checked=(), *, fast_launch=True):
                self.fn, self.values, self.options = launcher.fn, tuple(values), dict(options)
                self.free = [launcher.names.index(n) for n in free]
                seen.add(sm90.Binding(self.fn, self.values, self.options))

            def __call__(self, *free):
                values = list(self.values)
                for i, x in zip(self.free, free):
                    values[i] = x
                seen.add(sm90.Binding(self.fn, tuple(values), self.options))

        launch.BoundLaunch = Recorded  # sm90.recording restores the real one
        rng, norms = random.Random(1), _norms(cfg)
        table = torch.zeros(R, -(-L // 64), dtype=torch.int32)
        for _ in range(count):
            step = _random_step(rng, planner, table, rng.choice([1, 4]))
            if not static:  # the engine's table of this step: ceil(max_seq_len / page_size) pages
                step = _with_table(step, torch.zeros(R, -(-step.max_seq_len // 64), dtype=torch.int32))
            plan = planner.plan(step, static=static)
            T, s = plan.num_tokens, plan.schedule
            proj = [torch.zeros(T, w, dtype=torch.bfloat16) for w in (640, 12288, 512, 512)]
            for cache in caches:
                bind_layer(plan, norms, *proj, cache)
                launches = plan.launches(cache)
                launches.prepare(plan, norms, *proj)
                launches.select(plan, s.q_idx, s.selection)
                gate = proj[1].view(T, cfg.num_heads, 2 * cfg.head_dim)[..., cfg.head_dim:]
                launches.attention(plan, s.q, gate, s.selection, s.attn_out)
    keys = {sm90.spec_key(b): b for b in seen.bindings.values()}
    missed = [b for k, b in keys.items() if k not in warmed]
    for b in missed:
        print(f"MISSED {b.fn.__name__}: a random step bound or called a variant the warm-up did not compile")
    print(f"{name} warm={len(warmed)} seen={len(keys)} missed={len(missed)}")


def _with_table(step, table):
    """`step` (a QSAStepInputs) on another block table."""
    from qsa_core.inputs import QSAStepInputs

    return QSAStepInputs(query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, block_table=table,
                         slot_mapping=step.slot_mapping, ring_index=step.ring_index, num_decodes=step.num_decodes,
                         max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
                         decode_query_len=step.decode_query_len, num_padding_rows=step.num_padding_rows)


def test_random_steps_and_their_calls_compile_nothing_after_warm():
    from sm90 import run_many

    done = run_many([[os.path.abspath(__file__), name] for name in CONFIGS], workers=2, timeout=600)
    for d in done:
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-4000:]
    lines = [x for d in done for x in d.stdout.splitlines()]
    summary = {x.split()[0]: x for x in lines if x.split() and x.split()[0] in CONFIGS}
    assert set(summary) == set(CONFIGS), lines
    assert not [x for x in lines if x.startswith("MISSED")], "\n".join(lines)
    for line in summary.values():
        fields = dict(f.split("=") for f in line.split()[1:])
        assert int(fields["missed"]) == 0 and int(fields["seen"]) > 0 and int(fields["warm"]) > 0, line
    print("\n".join(summary.values()))


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, HERE)
    check(sys.argv[1])
