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
(`plan(static=False)`) at 8K on an engine's own block tables sized per step
(ceil(max_seq_len / page_size) pages: any row stride, 1 included), with the warm-up told so
(`block_table_strides=(1, 16, 17)`). SGLang's steps never mix decodes and prefills, so its
warm-ups leave the mixed shapes out (`mixed=False`): the "sglang" configurations warm so and
plan only SGLang-shaped random steps, eager on tables of that width rounded up to a multiple of
16 as its adapter sizes them (`aligned_pages`, warmed with `block_table_strides=(16,)`:
decode-only DECODE / TARGET_VERIFY, or
prefill-only EXTEND / MIXED with the running decodes' 1-row requests among the prefills) and
of its decode CUDA graphs (static, decode-only, padded requests last with no rows). Each process
prints `<name> warm=<variants> seen=<keys> missed=<n>` and a `MISSED <kernel> ...` line per
key the warm-up did not compile.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (max_model_len, max_num_tokens, max_num_reqs, random steps, static: else eager on tables sized per
# step, sglang: warm with mixed=False and plan SGLang-shaped steps only)
CONFIGS = {"8k": (8192, 2048, 256, 80, True, False), "128k": (131072, 8192, 256, 50, True, False),
           "8k-eager": (8192, 2048, 256, 80, False, False), "8k-sglang-eager": (8192, 2048, 256, 80, False, True),
           "8k-sglang-graph": (8192, 512, 128, 40, True, True)}


def check(name: str) -> None:
    import torch

    import sm90
    from qsa_core.layer import bind_layer
    from qsa_core.warmup import aligned_pages
    from qsa_kernels import launch
    from test_compile_sm90 import _config, _norms, _planner, _random_step

    L, N, R, count, static, sglang = CONFIGS[name]
    cfg = _config("bf16", "bf16")
    with sm90.recording() as found:
        planner, caches = _planner(cfg, 2, N, L, R)
        strides = () if static else (16,) if sglang else (1, 16, 17)
        planner.warm(caches, decode_query_lens=(1, 4), static=static, block_table_strides=strides, mixed=not sglang)
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
            if sglang:
                step = _sglang_step(rng, planner, table, rng.choice([1, 4]), static)
            else:
                step = _random_step(rng, planner, table, rng.choice([1, 4]))
            if not static:  # the engine's table of this step: ceil(max_seq_len / page_size) pages (SGLang: aligned)
                pages = -(-step.max_seq_len // 64)
                step = _with_table(step, torch.zeros(R, aligned_pages(pages) if sglang else pages, dtype=torch.int32))
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


def _sglang_step(rng: random.Random, planner, block_table, dql: int, graph: bool):
    """A random step as SGLang's adapter maps one (`batch_map.step_inputs`): never decodes and
    prefills together. graph: a decode CUDA graph's (DECODE / TARGET_VERIFY of dql rows a
    request, the padded requests last with no rows, seq_len 1, max_seq_len the context bound);
    else eager, half decode-only and half prefill-only (EXTEND, or MIXED: the running decodes'
    1-row requests after the extends; decode_query_len 1)."""
    import torch

    from qsa_core.inputs import QSAStepInputs

    N, L = planner.max_num_tokens, planner.max_model_len
    reqs = block_table.shape[0]
    long = rng.choice([64, 4096, L])
    pad_reqs = 0
    if graph or rng.random() < 0.5:
        nd = min(rng.choice([rng.randint(1, 8), rng.randint(1, reqs)]), N // dql, reqs)
        if graph:
            pad_reqs = rng.choice([0, rng.randint(0, nd - 1)])
        lens = [dql] * (nd - pad_reqs) + [0] * pad_reqs
    else:
        nd, dql, lens = 0, 1, []
        while not lens or (rng.random() < 0.5 and sum(lens) < N and len(lens) < reqs):
            lens.append(rng.randint(1, min(N - sum(lens), rng.choice([8, 512, N]))))
        lens += [1] * rng.randint(0, min(N - sum(lens), reqs - len(lens), rng.choice([4, reqs])))
    seq = [rng.randint(max(q, 1), max(q, 1, min(L, long))) if q else 1 for q in lens]
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    T = sum(lens) + pad_reqs * dql
    return QSAStepInputs(query_start_loc=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32),
                         block_table=block_table[: len(lens)], slot_mapping=torch.full((T,), -1, dtype=torch.int64),
                         ring_index=torch.arange(len(lens), dtype=torch.int32), num_decodes=nd,
                         max_query_len=max(lens), max_seq_len=L if graph else max(seq), decode_query_len=dql,
                         num_padding_rows=pad_reqs * dql)


def _with_table(step, table):
    """`step` (a QSAStepInputs) on another block table."""
    from qsa_core.inputs import QSAStepInputs

    return QSAStepInputs(query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, block_table=table,
                         slot_mapping=step.slot_mapping, ring_index=step.ring_index, num_decodes=step.num_decodes,
                         max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
                         decode_query_len=step.decode_query_len, num_padding_rows=step.num_padding_rows)


@pytest.mark.sm90
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
