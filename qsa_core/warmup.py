"""Start-up warm-up: bind every kernel specialization an engine's steps can choose, so no
Triton compile happens while serving.

A launch's compiled variant depends on the step's shape only (its row counts, its column
bucket, decode query length, whether the ring store fuses) and on the dtypes, strides and
alignment of what it binds. `warm_steps` lists step shapes that reach every variant the
planner can choose within an engine's sizes: every column bucket up to max_model_len; row
counts 1, 2 and 2^k - 1, 2^k, 2^k + 1 up to the bound (every threshold of the routes and
tiles is a power of two, and a runtime int specializes on == 1 and % 16 only); decode-only
steps for each decode query length, one prefill request alone, and mixed steps of both
(left out with mixed=False, for an engine whose steps never mix: SGLang's). `warm` plans each
(the metadata build runs on the planner's own workspace) and binds the layer launches for each
distinct cache layout without launching them (`layer.bind_layer`):
on a GPU binding compiles; on the interpreter it only binds; on the reference backend there
is nothing to compile. tests/kernels/test_compile_sm90.py compiles for sm_90 exactly what
`warm` binds (a kernel that cannot compile fails CI), and checks that random steps choose
nothing it missed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from .cache import QSALayerCache
from .inputs import QSAStepInputs

if TYPE_CHECKING:
    from .planner import QSAPlanner


class WarmStep(NamedTuple):
    """One step shape: num_decodes requests of decode_query_len rows, then (prefill_rows > 0)
    one prefill request of prefill_rows rows; every request of seq_len max_seq_len."""

    num_decodes: int
    decode_query_len: int
    prefill_rows: int
    max_seq_len: int


def row_counts(bound: int) -> list[int]:
    """1, 2 and 2^k - 1, 2^k, 2^k + 1 up to bound, and bound itself (ascending)."""
    counts = {1, 2, bound}
    k = 4
    while k // 2 <= bound:
        counts |= {k - 1, k, k + 1}
        k *= 2
    return sorted(c for c in counts if 1 <= c <= bound)


def column_buckets(max_model_len: int, compress_ratio: int) -> list[int]:
    """Every `planner.column_bucket` a step of seq_len <= max_model_len can take."""
    from .planner import column_bucket

    top = column_bucket(max_model_len // compress_ratio)
    powers = [1 << i for i in range(13) if 1 << i <= min(top, 4096)]
    return powers + list(range(8192, top + 1, 4096))


def warm_steps(compress_ratio: int, *, max_num_tokens: int, max_model_len: int, max_num_reqs: int | None,
               decode_query_lens: Sequence[int] = (1,), mixed: bool = True) -> list[WarmStep]:
    """The step shapes `warm` plans (module docstring) for an engine's sizes: rows per step
    <= max_num_tokens, requests <= max_num_reqs (None: unbounded), seq_len <= max_model_len.
    mixed=False leaves out the mixed decode + prefill shapes, for engines whose steps are
    decode-only or prefill-only (SGLang)."""
    reqs = max_num_reqs or max_num_tokens
    steps: list[WarmStep] = []
    for cols in column_buckets(max_model_len, compress_ratio):
        seq = min(cols * compress_ratio, max_model_len)
        for dql in sorted(set(decode_query_lens)):
            if dql > seq:
                continue
            decodes = row_counts(min(reqs, max_num_tokens // dql))
            steps += [WarmStep(n, dql, 0, seq) for n in decodes]
            # mixed: each decode count with one prefill row, and the converse
            if mixed and reqs > 1 and max_num_tokens > dql:
                steps += [WarmStep(n, dql, 1, seq) for n in decodes if n < reqs and n * dql < max_num_tokens]
                steps += [WarmStep(1, dql, n, seq) for n in row_counts(min(max_num_tokens - dql, seq)) if n > 1]
        steps += [WarmStep(0, 1, n, seq) for n in row_counts(min(max_num_tokens, seq))]
    return steps


def step_inputs(step: WarmStep, block_table: torch.Tensor) -> QSAStepInputs:
    """A valid step of this shape that writes nothing: every slot -1, request i on ring row i
    (requests with rows never share one), every request's pages the first entries of
    block_table (int32 [>= requests, >= pages])."""
    dev = block_table.device
    R = step.num_decodes + (step.prefill_rows > 0)
    lens = [step.decode_query_len] * step.num_decodes + ([step.prefill_rows] if step.prefill_rows else [])
    qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    T = int(qsl[-1])
    return QSAStepInputs(
        query_start_loc=qsl.to(dev), seq_lens=torch.full((R,), step.max_seq_len, dtype=torch.int32, device=dev),
        block_table=block_table, slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev),
        ring_index=torch.arange(R, dtype=torch.int32, device=dev), num_decodes=step.num_decodes,
        max_query_len=max(lens), max_seq_len=step.max_seq_len, decode_query_len=step.decode_query_len,
    )


def _layout_key(cache: QSALayerCache) -> tuple:
    """What a cache contributes to a compiled variant: its views' dtypes, shapes, strides and
    16-byte alignment (distinct layers of one layout share their variants)."""
    views = (cache.k, cache.v, cache.compressed, cache.ring, cache.ring_positions)
    return tuple(None if t is None else (t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % 16) for t in views)


def compile_workers() -> int:
    """Compiles `warm` runs at once: this process's CPUs, at most 16."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cpus))


def stride_class(row_stride: int) -> int:
    """The smallest row stride a kernel specializes as `row_stride` (== 1, % 16 == 0, neither):
    1, 0 or 3."""
    return 1 if row_stride == 1 else 0 if row_stride % 16 == 0 else 3


def aligned_pages(pages: int) -> int:
    """pages rounded up to a multiple of 16: the width of a block table the core or an adapter
    sizes (a planner's static table, SGLang's eager tables, the Runner's). Every such table's
    row stride specializes the kernels alike (`stride_class` 0), so a start-up warm-up covers
    them with block_table_strides=(16,): one class of the
    stride-specialized variants (scores, top-k, attention) instead of three for tables of
    ceil(max_seq_len / page_size) columns (8192 rows / 128K context: 73 variants against 111)."""
    return -(-pages // 16) * 16


def warm_block_table(rows: int, pages: int, row_stride: int, device: torch.device) -> torch.Tensor:
    """A block table int32 [rows, pages] of zeros (every request's pages page 0) whose row
    stride specializes as `row_stride` does (`stride_class`: all a kernel's variant depends on)
    without rows x row_stride elements: rows overlap (nothing writes it)."""
    stride = stride_class(row_stride)
    return torch.zeros((rows - 1) * stride + pages, dtype=torch.int32, device=device).as_strided((rows, pages),
                                                                                                 (stride, 1))


def warm(planner: "QSAPlanner", caches: Iterable[QSALayerCache], *, decode_query_lens: Sequence[int] = (1,),
         static: bool = False, max_num_reqs: int | None = None, workers: int | None = None,
         block_table_strides: Sequence[int] = (), mixed: bool = True) -> list[WarmStep]:
    """Plan every `warm_steps` shape, bind the layer launches on one cache of each distinct
    layout with compiling deferred (`launch.deferred_binds`: each binding's specialization key
    computed, none compiled), then compile the distinct variants, `workers` at a time (default
    `compile_workers()`; `launch.compile_bindings`); returns the steps planned (none on the
    reference backend, which compiles nothing). The per-shape cost is host Python only; the
    compiles scale with the distinct variants. static: plan as the engine does
    (`plan(static=True)`); block_table_strides: without static, the row strides the engine's
    block tables can have (a free argument the score, attention and top-k kernels specialize
    on: each `stride_class` is warmed, one plan and bind a shape each; default
    ceil(max_model_len / page_size), tables sized for max_model_len; a table sized per step
    can have any: pass (1, 16, 17)); max_num_reqs: the engine's request bound (default the
    planner's); mixed=False: no mixed decode + prefill shapes (`warm_steps`), for engines
    whose steps are decode-only or prefill-only (SGLang).
    The planner's schedules are as before (warm plans on a fresh set and drops it); its
    workspace is left as the last warm step's metadata build wrote it (no cache is written)."""
    if not planner.backend.compiles:
        return []
    from qsa_kernels import launch

    from .layer import QSANormWeights, bind_layer

    layouts = {_layout_key(c): c for c in caches}
    if not layouts:
        return []
    cfg, dev, dtype = planner.config, planner.device, planner.dtype
    T, L = planner.max_num_tokens, planner.max_model_len
    if max_num_reqs is None and planner.static is not None:
        max_num_reqs = planner.static["seq_lens"].shape[0]
    if planner.num_ring_rows is not None:  # a valid step's requests each hold a ring row
        max_num_reqs = min(max_num_reqs or T, planner.num_ring_rows)
    steps = warm_steps(cfg.compress_ratio, max_num_tokens=T, max_model_len=L, max_num_reqs=max_num_reqs,
                       decode_query_lens=decode_query_lens, mixed=mixed)
    Hi, Di, Hq, Hkv, D = cfg.index_n_heads, cfg.index_head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # The projections as an engine passes them, contiguous rows (one row, expanded: bound, never read).
    proj = {n: torch.empty(1, w, dtype=dtype, device=dev) for n, w in
            (("index_qk", (Hi + 1) * Di), ("q_gate", 2 * Hq * D), ("k", Hkv * D), ("v", Hkv * D))}
    norms = QSANormWeights(*(torch.zeros(d, dtype=dtype, device=dev) for d in (Di, Di, D, D)))
    # Every request's pages: page 0 (a table of every request's pages at 1M context would
    # take GBs; static plans copy it into the planner's own table).
    pages = planner.max_pages
    strides = {stride_class(s) for s in block_table_strides or (pages,)} if not static else {0}
    tables = [warm_block_table(max(max_num_reqs or T, 2), pages, s, dev) for s in sorted(strides)]
    found: dict[tuple, tuple] = {}
    saved = dict(planner._schedules)
    planner._schedules.clear()  # warm's schedules hold deferred launches: never the engine's
    try:
        for table in tables:
            planner._schedules.clear()  # a shape's launches bind anew on each table
            for step in steps:
                # planned as the engine plans (the metadata build and stage launch and compile)
                plan = planner.plan(step_inputs(step, table), static=static)
                n = plan.num_tokens
                with launch.deferred_binds(found):
                    for cache in layouts.values():
                        bind_layer(plan, norms, *(proj[k].expand(n, -1) for k in ("index_qk", "q_gate", "k", "v")),
                                   cache)
    finally:
        planner._schedules.clear()
        planner._schedules.update(saved)
    launch.compile_bindings(list(found.values()), compile_workers() if workers is None else workers)
    return steps


def _compiled_kernels() -> int:
    """Kernels Triton has compiled so far for qsa_kernels' JIT functions, over every device
    (Triton 3.x `JITFunction.device_caches`: device -> (kernel cache, ...))."""
    import sys

    from triton.runtime.jit import JITFunction

    fns = {id(v): v for name, mod in list(sys.modules.items()) if name.startswith("qsa_kernels")
           for v in vars(mod).values() if isinstance(v, JITFunction)}
    return sum(len(entry[0]) for fn in fns.values() for entry in fn.device_caches.values())


def start_up_warm(planner: "QSAPlanner", caches: Iterable[QSALayerCache], *, decode_query_lens: Sequence[int],
                  static: bool = True, block_table_strides: Sequence[int] = (), mixed: bool = True) -> str | None:
    """An engine's start-up warm-up: `planner.warm(caches, decode_query_lens, static,
    block_table_strides, mixed)` with the engine's planning (static steps, or eager steps on
    its own block tables of those row strides; mixed=False: no mixed decode + prefill shapes,
    for engines whose steps are decode-only or prefill-only, SGLang); returns the line to log,
    "QSA: warmed N kernel variants over M step shapes in S s" (N: kernels Triton compiled
    meanwhile). None where nothing compiles: the reference backend, or the interpreter
    (`planner.options.kernel.interpreter`, TRITON_INTERPRET=1; skipped: binding every shape in
    the interpreter would cost the CPU engine suites minutes for nothing)."""
    import time

    if not planner.backend.compiles or planner.options.kernel.interpreter:
        return None
    before, t0 = _compiled_kernels(), time.perf_counter()
    steps = planner.warm(caches, decode_query_lens=tuple(sorted(set(decode_query_lens))), static=static,
                         block_table_strides=block_table_strides, mixed=mixed)
    return (f"QSA: warmed {_compiled_kernels() - before} kernel variants over {len(steps)} step shapes "
            f"in {time.perf_counter() - t0:.1f} s")
