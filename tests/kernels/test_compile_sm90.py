"""Every kernel specialization the planner can choose compiles for sm_90 (H100 / H200).

The interpreter accepts code the compiler rejects, and the GPU suite reaches only the variants
its steps choose: a variant nobody compiled fails on a user's server (the unscored radix emit
did, at max_num_batched_tokens 2048). Here, in fresh processes without TRITON_INTERPRET (the
production tiles), `QSAPlanner.warm` — the engines' start-up warm-up, so the two cannot drift —
runs on CPU tensors with every `Launcher.bind` recorded instead of compiled (`sm90.recording`:
an sm_90 GPU of 132 SMs, PDL and the L2 warm on), and each distinct variant (Triton's own
specialization of the recorded arguments) is compiled for sm_90. Then random valid steps
(several requests of random lengths, padding rows, static or not) must choose no variant the
warm-up missed.

Matrix: the production geometry (24 / 2 heads of 256, indexer 4 x 128, budget 2048, r 4) at
1M context, 8192 rows per step, 256 requests, decode query lengths 1 and 4 (MTP), with index /
KV dtypes bf16 / bf16 and fp8_e4m3 / fp8_e4m3, and with QSA_DECODE_SAMPLES=0 (the route it
leaves: radix decode of long rows); the other dtype pairs (fp8_e5m2 KV too) at 64K context and
2048 rows (the one kernel that reads both dtypes, prepare, has no column-dependent variant).
Each process prints `<name> routes=... bindings=... variants=... compiled=... <kernel>=<n> ...`
and `FAIL ...` per variant that does not compile.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROUTES = {"prefill", "dsamp", "topk-short", "fused", "radix"}
# name: (index dtype, KV dtype, max_model_len, max_num_tokens, max_num_reqs, QSA_DECODE_SAMPLES)
CONFIGS = {
    "bf16": ("bf16", "bf16", 1 << 20, 8192, 256, "auto"),
    "fp8": ("fp8_e4m3", "fp8_e4m3", 1 << 20, 8192, 256, "auto"),
    "bf16-nodsamp": ("bf16", "bf16", 1 << 20, 4096, 256, "0"),
    "mixed": (None, None, 1 << 16, 2048, 64, "auto"),
}
MIXED = (("bf16", "fp8_e4m3"), ("fp8_e4m3", "bf16"), ("bf16", "fp8_e5m2"))
RANDOM_STEPS = 120
# Each phase's bound (s): the compile phase took 330 s on two free cores, and CI's cores are
# shared with the engine environments' installs.
COMPILE_TIMEOUT = 1800
RANDOM_CONFIG = "bf16"


def _config(index_dtype: str, kv_dtype: str):
    from qsa_core import QSAConfig

    return QSAConfig(hidden_size=2048, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4,
                     index_head_dim=128, token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7,
                     index_dtype=index_dtype, kv_cache_dtype=kv_dtype)


def _planner(cfg, num_layers: int, max_num_tokens: int, max_model_len: int, max_num_reqs: int):
    """(planner, caches) of the production geometry: page 64, a ring of 8 rows per request
    (3 MTP tokens), Triton backend without value checks, the caches of `num_layers` layers."""
    import torch
    from qsa_core.cache import QSACacheLayout
    from qsa_core.planner import QSAPlanner

    layout = QSACacheLayout(num_layers=num_layers, page_size=64, num_pages=64, ring_rows=max_num_reqs,
                            num_speculative_tokens=3)
    planner = QSAPlanner(cfg, dtype=torch.bfloat16, page_size=64, ring_capacity=8, max_num_tokens=max_num_tokens,
                         max_model_len=max_model_len, max_num_reqs=max_num_reqs, backend="triton",
                         value_checks=False, num_slots=layout.num_slots, num_ring_rows=max_num_reqs)
    return planner, layout.allocate(cfg, torch.bfloat16)


def _random_step(rng: random.Random, planner, block_table, dql: int):
    """A valid random step: decode requests of dql rows, then prefills, then padding rows."""
    import torch

    from qsa_core.inputs import QSAStepInputs

    N, L = planner.max_num_tokens, planner.max_model_len
    reqs = block_table.shape[0]
    nd = rng.choice([0, rng.randint(1, 8), rng.randint(1, reqs)])
    nd = min(nd, (N - 1) // dql, reqs - 1)
    lens = [dql] * nd
    while rng.random() < 0.6 and sum(lens) < N and len(lens) < reqs:
        lens.append(rng.randint(1, min(N - sum(lens), rng.choice([8, 512, N]))))
    if not lens:
        lens = [rng.randint(1, N)]
    pad = rng.choice([0, 0, rng.randint(0, N - sum(lens))])
    long = rng.choice([64, 4096, 65536, L])
    seq = [rng.randint(q, max(q, min(L, long))) for q in lens]
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return QSAStepInputs(query_start_loc=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32), block_table=block_table,
                         slot_mapping=torch.full((sum(lens) + pad,), -1, dtype=torch.int64),
                         ring_index=torch.arange(len(lens), dtype=torch.int32), num_decodes=nd,
                         max_query_len=max(lens), max_seq_len=max(seq), decode_query_len=dql, num_padding_rows=pad)


def record(name: str) -> dict:
    """Warm the planners of config `name` under `sm90.recording`, as an engine does (static):
    {"variants": {Triton key: `sm90.portable` binding}, "routes": routes planned as
    'route/scored/decode', "bindings": how many, "problems": random-step variants the warm-up
    missed, "seconds": the warm-ups' wall time}."""
    import torch

    import sm90
    from qsa_core.layer import bind_layer
    from qsa_kernels import select

    idx, kv, L, N, R, dsamp = CONFIGS[name]
    os.environ["QSA_DECODE_SAMPLES"] = dsamp
    routes: set[str] = set()
    plan_select = select.plan_select

    def planned(*args, **kwargs):
        s = plan_select(*args, **kwargs)
        routes.add(f"{s.route}/{'scored' if s.scored else 'unscored'}/{'decode' if s.decode else 'prefill'}"
                   f"{'-mtp' if kwargs.get('rows_per_request', 1) > 1 else ''}")
        return s

    select.plan_select = planned
    variants: dict = {}
    count, problems, seconds = 0, [], 0.0
    try:
        for index_dtype, kv_dtype in MIXED if idx is None else ((idx, kv),):
            cfg = _config(index_dtype, kv_dtype)
            with sm90.recording() as found:
                planner, caches = _planner(cfg, 1, N, L, R)
                t0 = time.perf_counter()
                planner.warm(caches, decode_query_lens=(1, 4), static=True)
                seconds += time.perf_counter() - t0
                warmed = dict(found.bindings)
                if name == RANDOM_CONFIG:  # random steps choose nothing the warm-up missed
                    rng = random.Random(0)
                    table = torch.zeros(R, -(-L // 64), dtype=torch.int32)
                    for _ in range(RANDOM_STEPS):
                        step = _random_step(rng, planner, table, rng.choice([1, 4]))
                        plan = planner.plan(step, static=True)
                        proj = [torch.zeros(plan.num_tokens, w, dtype=torch.bfloat16) for w in (640, 12288, 512, 512)]
                        bind_layer(plan, _norms(cfg), *proj, caches[0])
            count += found.count
            keys = {sm90.spec_key(b): b for b in warmed.values()}
            variants.update((k, sm90.portable(b)) for k, b in keys.items())
            for qk, b in found.bindings.items():
                if qk not in warmed and sm90.spec_key(b) not in keys:
                    problems.append(f"MISSED {b.fn.__name__}: a random step bound a variant the warm-up did not")
    finally:
        select.plan_select = plan_select
    return dict(variants=variants, routes=sorted(routes), bindings=count, problems=problems, seconds=seconds)


def _norms(cfg):
    """Zero norm weights of the layer (bf16)."""
    import torch

    from qsa_core.layer import QSANormWeights

    Di, D = cfg.index_head_dim, cfg.head_dim
    return QSANormWeights(*(torch.zeros(d, dtype=torch.bfloat16) for d in (Di, Di, D, D)))


def record_main(name: str, out: str) -> None:
    """Record config `name` into the pickle `out` (`record`'s dict) and print its summary line."""
    found = record(name)
    with open(out, "wb") as f:
        pickle.dump(found, f)
    print(f"{name} routes={','.join(found['routes'])} bindings={found['bindings']} variants={len(found['variants'])} "
          f"warm={found['seconds']:.1f}s problems={len(found['problems'])}")


def compile_main(path: str, worker: int, workers: int) -> None:
    """Compile for sm_90 every variant of the pickled list `path` whose index % workers == worker;
    print `compiled <kernel>=<n> ...` and a `FAIL ...` line per variant that does not compile."""
    import collections

    import sm90

    with open(path, "rb") as f:
        todo = pickle.load(f)[worker::workers]
    compiled = collections.Counter()
    for data in todo:
        b = sm90.restore(data)
        try:
            sm90.compile_binding(b)
            compiled[b.fn.__name__] += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported, the test fails on any
            first = str(e).strip().splitlines()
            print(f"FAIL {b.fn.__name__}: {' | '.join(first[-3:])[:600]}")
    print("compiled " + " ".join(f"{k}={v}" for k, v in sorted(compiled.items())))


@pytest.mark.sm90
def test_every_planned_variant_compiles_for_sm90(tmp_path):
    import collections

    from sm90 import run_many

    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    t0 = time.perf_counter()
    done = run_many([[os.path.abspath(__file__), "record", name, str(tmp_path / f"{name}.pkl")] for name in CONFIGS],
                    workers=2, timeout=COMPILE_TIMEOUT, env=env)
    for d in done:
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-4000:]
    lines = {x.split()[0]: x for d in done for x in d.stdout.splitlines() if x.split() and x.split()[0] in CONFIGS}
    assert set(lines) == set(CONFIGS), lines
    found = {}
    for name in CONFIGS:
        with open(tmp_path / f"{name}.pkl", "rb") as f:
            found[name] = pickle.load(f)
    problems = [p for f in found.values() for p in f["problems"]]
    assert not problems, problems
    # One compile per distinct variant over every config; each config's new ones reported.
    variants: dict = {}
    for name, f in found.items():
        new = {k: v for k, v in f["variants"].items() if k not in variants}
        variants.update(new)
        print(f"{lines[name]} new={len(new)}")
        assert f["variants"], lines[name]
    with open(tmp_path / "variants.pkl", "wb") as fh:
        pickle.dump(list(variants.values()), fh)
    t1 = time.perf_counter()
    done = run_many([[os.path.abspath(__file__), "compile", str(tmp_path / "variants.pkl"), str(i), "2"]
                     for i in range(2)], workers=2, timeout=COMPILE_TIMEOUT, env=env)
    out = "\n".join(d.stdout for d in done)
    for d in done:
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-4000:]
    assert not [x for x in out.splitlines() if x.startswith("FAIL")], out
    compiled = collections.Counter()
    for x in out.splitlines():
        if x.startswith("compiled"):
            compiled.update({k: int(v) for k, v in (f.split("=") for f in x.split()[1:])})
    print(f"variants={len(variants)} record={t1 - t0:.0f}s compile={time.perf_counter() - t1:.0f}s "
          + " ".join(f"{k}={v}" for k, v in sorted(compiled.items())))
    assert sum(compiled.values()) == len(variants), (compiled, len(variants))
    planned = set().union(*(f["routes"] for f in found.values()))
    assert {r.split("/")[0] for r in planned} == ROUTES, planned
    for kind in ("scored/decode", "unscored/decode", "scored/prefill", "unscored/prefill", "scored/decode-mtp"):
        assert any(r.endswith(kind) for r in planned), (kind, planned)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, HERE)
    if sys.argv[1] == "record":
        record_main(sys.argv[2], sys.argv[3])
    else:
        compile_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
