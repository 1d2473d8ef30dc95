"""Host time of the plan/run split on a CUDA GPU (production geometry, bf16).

- one eager decode layer with the step already planned: the layer halves `qsa_indexer` +
  `qsa_attention` from the projections, and a whole `QSAAttention.forward`;
- planning the step: `QSAStepInputs(...)` + `QSAPlanner.plan`;
- for each step shape: decode requests, or prefill chunks (`--shapes` BATCHxCONTEXTxROWS).

Host time: `time.perf_counter` around many calls with no synchronisation per call (after a
sync, in batches short enough that the launch queue never fills, the garbage collector off and
one collection per case as in `timeit`), so it is the time the CPU spends issuing work. GPU time: CUDA events around the same loop (the GPU's span; when
it is above the host time, the GPU waits on nothing). Kernel launches per call come from the
profiler.
Every case runs with the ordinary Triton launch (`JITFunction.run`, the old path) and with
the thin launcher (`qsa_kernels.launch`, bound launches): one planner each, over the same
caches and weights (`KernelOptions.fast_launch` off and on). The host is shared and noisy: each
figure is the median of `--passes` interleaved passes over all cases (after one warm-up
pass), each pass the median of its rounds.

    python benchmarks/bench_qsa.py host [--out DIR] [--launch both|ordinary|launcher] [--shapes 4x8192,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import triton

from qsa_core import (
    QSAAttention, QSACacheLayout, QSAConfig, QSAOptions, QSAPlanner, QSAStepInputs, qsa_attention,
    qsa_indexer, qsa_prepare, qsa_select,
)
from qsa_kernels.launch import Launcher

CONFIG = QSAConfig(
    hidden_size=2048, num_heads=24, num_kv_heads=2, head_dim=256, index_n_heads=4, index_head_dim=128,
    token_topk=2048, compress_ratio=4, rotary_dim=64, rope_theta=1e7,
)
PAGE = 64
DEV = torch.device("cuda")
BF16 = torch.bfloat16
COUNTED = ("layer halves", "plan", "plan static")  # cases whose kernel launches are counted


def host_and_gpu_us(fn: Callable[[], object], calls: int = 25, rounds: int = 6) -> tuple[float, float, float]:
    """Median over rounds of (host us, host CPU us, GPU us) per call for `calls`
    unsynchronised calls, with Python's garbage collector off during each round and one
    collection before the warm-up (as `timeit` does). Host CPU: this thread's CPU time
    (`time.thread_time`), which leaves out the time the OS ran something else (a shared host's
    noise)."""
    # One collection, none between the rounds (as timeit): a full collection before each
    # 25-call round evicts the host's caches (seen: +30 % on a 23 us plan on a CPU host).
    gc.collect()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, cpu, gpu = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        torch.cuda.synchronize()
        gc.disable()
        try:
            start.record()
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            t1, c1 = time.perf_counter(), time.thread_time()
            end.record()
        finally:
            gc.enable()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6 / calls)
        cpu.append((c1 - c0) * 1e6 / calls)
        gpu.append(start.elapsed_time(end) * 1e3 / calls)
    mid = rounds // 2
    return sorted(host)[mid], sorted(cpu)[mid], sorted(gpu)[mid]


@triton.jit
def _noop_kernel(x_ptr, n):
    pass


def launch_floor() -> dict[str, float]:
    """Host us of one launch of an empty kernel: bound (launcher), ordinary, and a torch op."""
    x = torch.zeros(16, device=DEV)
    bound = Launcher(_noop_kernel).bind((1,), x, 5, free=("x_ptr",))
    cases = {"bound launch": lambda: bound(x), "ordinary launch": lambda: _noop_kernel[(1,)](x, 5),
             "torch x.add_(1)": lambda: x.add_(1)}
    return {name: round(host_and_gpu_us(fn, 200, 9)[0], 2) for name, fn in cases.items()}


def launches(fn: Callable[[], object]) -> int | str:
    """CUDA kernels one call launches (profiler), or why it could not count."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as exc:  # the profiler may be unavailable on the machine
        return f"n/a ({type(exc).__name__})"


class Step:
    """`batch` requests of `rows` rows each (1: decodes; more: prefill chunks) ending at
    `context` tokens, over random paged caches, planned once."""

    def __init__(self, batch: int, context: int, rows: int = 1, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.batch, self.context, self.rows = batch, context, rows
        T = batch * rows
        pages_per_req = -(-context // PAGE)
        layout = QSACacheLayout(num_layers=1, page_size=PAGE, num_pages=batch * pages_per_req + 1, ring_rows=batch)
        self.cache = layout.allocate(CONFIG, BF16, DEV)[0]
        for name in ("k", "v", "compressed", "ring"):
            t = getattr(self.cache, name)
            t.copy_(torch.randn(t.shape, device=DEV).to(t.dtype))
        pages = torch.randperm(batch * pages_per_req, device=DEV).view(batch, pages_per_req) + 1
        req = torch.arange(batch, device=DEV).repeat_interleave(rows)
        pos = (context - rows + torch.arange(rows, device=DEV)).repeat(batch)
        self.tensors = dict(
            query_start_loc=torch.arange(batch + 1, device=DEV, dtype=torch.int32) * rows,
            seq_lens=torch.full((batch,), context, device=DEV, dtype=torch.int32),
            block_table=pages.to(torch.int32),
            slot_mapping=pages[req, pos // PAGE] * PAGE + pos % PAGE,
            ring_index=torch.arange(batch, device=DEV, dtype=torch.int32),
        )
        options = QSAOptions.from_env()
        self.planners = {mode: QSAPlanner(
            CONFIG, dtype=BF16, page_size=PAGE, ring_capacity=layout.ring_capacity(CONFIG), max_num_tokens=T,
            max_model_len=pages_per_req * PAGE, max_num_reqs=batch, device=DEV,
            options=replace(options, kernel=replace(options.kernel, fast_launch=mode == "launcher")),
        ) for mode in ("ordinary", "launcher")}
        self.plans = {mode: planner.plan(self.step_inputs()) for mode, planner in self.planners.items()}
        self.use("launcher")
        self.layer = QSAAttention(CONFIG).to(DEV, BF16)
        for p in self.layer.parameters():
            p.data.normal_(0, 0.02 if p.dim() == 2 else 0.3)
        self.hidden = torch.randn(T, CONFIG.hidden_size, device=DEV, dtype=BF16)
        with torch.no_grad():
            x, layer = self.hidden, self.layer
            self.projections = (layer.indexer.index_qk_proj(x), layer.q_proj(x), layer.k_proj(x), layer.v_proj(x))
        self.norms = self.layer.norm_weights()
        self.out = torch.empty(T, CONFIG.num_heads * CONFIG.head_dim, device=DEV, dtype=BF16)

    def use(self, mode: str) -> None:
        """Run the cases with the planner (and its plan) of launch path `mode`."""
        self.mode, self.planner, self.plan = mode, self.planners[mode], self.plans[mode]

    def step_inputs(self) -> QSAStepInputs:
        return QSAStepInputs(**self.tensors, num_decodes=self.batch if self.rows == 1 else 0, max_query_len=self.rows,
                             max_seq_len=self.context)

    def make_plan(self, static: bool = False):
        """What an adapter does per step: describe it, plan it."""
        return self.planner.plan(self.step_inputs(), static=static)

    def halves(self) -> torch.Tensor:
        with torch.no_grad():
            indexed = qsa_indexer(self.plan, self.norms, *self.projections, self.cache)
            return qsa_attention(self.plan, indexed, self.cache, out=self.out)

    def prepare(self):
        with torch.no_grad():
            return qsa_prepare(self.plan, self.norms, *self.projections, self.cache)

    def ops_alone(self) -> dict[str, Callable[[], object]]:
        """The layer's parts one by one (the split of the halves' host time), each on the plan
        of the launch path in use (`use`)."""
        ready = {}
        for mode in self.planners:
            self.use(mode)
            with torch.no_grad():
                ready[mode] = (qsa_indexer(self.plan, self.norms, *self.projections, self.cache), self.prepare()[0])
        self.use("launcher")
        return {
            "  prepare": self.prepare,
            "  select+expand": lambda: qsa_select(self.plan, ready[self.mode][1], self.cache),
            "  attention": lambda: qsa_attention(self.plan, ready[self.mode][0], self.cache, out=self.out),
        }

    def outputs(self) -> list[torch.Tensor]:
        """What a layer call writes: gated output, selection, caches (for comparing paths)."""
        out = self.halves()
        torch.cuda.synchronize()
        c = self.cache
        return [t.clone() for t in (out, self.plan.schedule.selection, c.k, c.v, c.compressed, c.ring)]

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.layer(self.hidden, self.plan, self.cache)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_qsa.py host", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for host.json")
    parser.add_argument("--launch", choices=("both", "ordinary", "launcher"), default="both",
                        help="Triton launch path(s) to measure (default: both, old then new)")
    parser.add_argument("--calls", type=int, default=25, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per pass (their median)")
    parser.add_argument("--passes", type=int, default=3, help="interleaved passes over all cases (their median)")
    parser.add_argument("--shapes", default="4x8192,64x8192,64x131072",
                        help="BATCHxCONTEXT decode steps, or BATCHxCONTEXTxROWS steps of prefill chunks of ROWS rows "
                             "(e.g. 1x131072x8192: vLLM's server step on an H100 at the end of a 128K prompt), "
                             "comma separated")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False): it times kernel launches")
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    modes = ("ordinary", "launcher") if args.launch == "both" else (args.launch,)
    rows, same = [], []
    timed: list[tuple[dict, Callable[[], object], str]] = []
    for batch, context, *rows in shapes:
        step = Step(batch, context, *rows)
        if len(modes) == 2:  # the two paths write the same bits
            try:
                step.use("ordinary")
                ordinary = step.outputs()
                step.use("launcher")
                equal = all(torch.equal(a, b) for a, b in zip(ordinary, step.outputs()))
            except Exception as exc:  # report it with the figures
                equal = f"{type(exc).__name__}: {exc}"[:120]
            same.append(f"B{batch} {context}: {equal}")
        cases = [("layer halves", step.halves), *step.ops_alone().items(), ("QSAAttention.forward", step.forward),
                 ("plan", step.make_plan), ("plan static", lambda step=step: step.make_plan(static=True))]
        for name, fn in cases:
            for mode in modes:
                row = dict(case=name, launch=mode, batch=batch, context=context, rows=step.rows, host_passes=[],
                           cpu_passes=[], gpu_passes=[])
                rows.append(row)
                timed.append((row, fn, mode, step))
    for p in range(args.passes + 1):  # pass 0 warms up
        for row, fn, mode, step in timed:
            if "error" in row:
                continue
            step.use(mode)
            try:
                host, cpu, gpu = host_and_gpu_us(fn, args.calls, args.rounds)
            except Exception as exc:  # report the failure of one case and go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:80]
                continue
            if p:
                row["host_passes"].append(round(host, 1))
                row["cpu_passes"].append(round(cpu, 1))
                row["gpu_passes"].append(round(gpu, 1))
    for row, fn, mode, step in timed:
        step.use(mode)
        if "error" in row:
            row.update(host_us="error", cpu_us="-", gpu_us="-", launches=row["error"])
        else:
            # Both paths launch the same kernels: count them once, for the whole cases.
            count = launches(fn) if mode == modes[-1] and row["case"] in COUNTED else "-"
            mid = len(row["host_passes"]) // 2
            row.update({f"{k}_us": sorted(row[f"{k}_passes"])[mid] for k in ("host", "cpu", "gpu")}, launches=count)
        print(row, flush=True)
    floor = launch_floor()
    head = (f"{'case':<22}{'launch':>10}{'batch':>6}{'context':>9}{'rows':>6}{'host us':>10}{'cpu us':>10}"
            f"{'gpu us':>10}{'launches':>10}")
    lines = [head] + [f"{r['case']:<22}{r['launch']:>10}{r['batch']:>6}{r['context']:>9}{r['rows']:>6}"
                      f"{r['host_us']:>10}{r['cpu_us']:>10}{r['gpu_us']:>10}{str(r['launches']):>10}" for r in rows]
    if same:
        lines.append("launcher outputs == ordinary outputs (bitwise): " + "; ".join(same))
    lines.append("host us of one empty-kernel launch: " + ", ".join(f"{k} {v}" for k, v in floor.items()))
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host.json").write_text(json.dumps(dict(rows=rows, launcher_equals_ordinary=same,
                                                            launch_floor_us=floor), indent=1))
