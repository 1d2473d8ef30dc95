"""Host time of one kernel launch: Triton's own launch paths against QSA's bound launch.

For the same kernel, grid and arguments (each case issues the identical launch):

- `kernel[grid](...)`: `JITFunction.run`, Triton's ordinary launch (bind the arguments, the
  specialization key, the cache lookup, then the compiled kernel's launcher);
- `compiled[grid](...)`: the `CompiledKernel` handle Triton returns (`kernel.warmup` /
  `run(..., warmup=True)`), called with every argument: the current stream, the launch
  metadata, then its launcher (each tensor's `data_ptr` and a driver query in C);
- `compiled.run(...)`: that launcher called directly with the grid, stream and arguments;
- `bound (ordinary)`: a `BoundLaunch` with `KernelOptions.fast_launch` off (its `kernel[grid]`);
- `bound`: the `BoundLaunch` fast path (`qsa_kernels.launch`: its generated call checks the free
  arguments' specialization and hands raw pointers to `compiled.run`).

Kernels: an empty one (2 arguments), one of 8 pointers and 8 ints, and the decode attention
kernel of the production geometry (`AttentionLaunch`, 31 runtime arguments, 16 of them free).
Host us per launch: `time.perf_counter` around `--calls` unsynchronised launches, the median of
`--rounds` rounds (garbage collector off), one row per path; the GPU runs the empty launches
far faster than the host issues them, so the queue never fills.

    python benchmarks/bench_qsa.py launch [--calls 2000] [--rounds 9] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


@triton.jit
def _args_kernel(p0, p1, p2, p3, p4, p5, p6, p7, n0, n1, n2, n3, n4, n5, n6, n7, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if i < 0:  # never: the kernel reads its arguments, does nothing
        tl.store(p0 + n0 + n1 + n2 + n3 + n4 + n5 + n6 + n7, tl.load(p1) + tl.load(p2) + tl.load(p3) + tl.load(p4)
                 + tl.load(p5) + tl.load(p6) + tl.load(p7))


def host_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Median over rounds of the host us per call of `calls` unsynchronised calls."""
    gc.collect()
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        gc.disable()
        try:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
        finally:
            gc.enable()
        times.append((t1 - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return sorted(times)[rounds // 2]


def paths(fast, ordinary, free: tuple) -> dict[str, Callable[[], object]]:
    """Every launch path of one kernel launch: `fast` a `BoundLaunch` (fast path), `ordinary`
    the same binding with `fast_launch` off, `free` its free arguments."""
    from qsa_kernels import launch

    values = list(fast.values)
    for i, x in zip(fast.free_index, free):
        values[i] = x
    fn, grid, options = fast.launcher.fn, fast.grid, fast.options
    kernel = fast.launcher.compiled(grid, values, options)
    handle = kernel[grid]
    run, function, packed = launch.RUNTIME.handles(kernel)
    stream = launch.RUNTIME.stream_fn()
    device = launch.RUNTIME.device()
    g = tuple(grid) + (1,) * (3 - len(grid))
    return {
        "kernel[grid](...)": lambda: fn[grid](*values, **options),
        "compiled[grid](...)": lambda: handle(*values),
        "compiled.run(...)": lambda: run(*g, stream(device), function, packed, None, None, None, *values),
        "bound (ordinary)": lambda: ordinary(*free),
        "bound": lambda: fast(*free),
    }


def kernels() -> dict[str, tuple]:
    """Name -> (fast binding, ordinary binding, free arguments) of the kernels measured."""
    from qsa_kernels.launch import Launcher
    from qsa_kernels.options import KernelOptions

    dev = torch.device("cuda")
    slow = KernelOptions(fast_launch=False)
    found = {}
    x = torch.zeros(16, device=dev)
    empty = Launcher(_empty_kernel)
    found["empty (2 args)"] = tuple(empty.bind((1,), x, 5, free=("x_ptr",), options=o) for o in (KernelOptions(), slow)) \
        + ((x,),)
    ptrs = [torch.zeros(16, device=dev) for _ in range(8)]
    args = Launcher(_args_kernel)
    names = [f"p{i}" for i in range(4)] + [f"n{i}" for i in range(4)]
    bind = [args.bind((132,), *ptrs, *range(17, 25), free=tuple(names), BLOCK=16, options=o) for o in (KernelOptions(),
                                                                                                     slow)]
    found["8 ptr + 8 int (8 free)"] = (*bind, (*ptrs[:4], 17, 18, 19, 20))
    found["decode attention (16 free)"] = _attention(dev, slow)
    return found


def _attention(dev: torch.device, slow) -> tuple:
    """The decode attention kernel's binding (4 rows, 131072-token contexts, Hq 24 / Hkv 2 /
    D 256, W 2051, page 64) and its free arguments."""
    from qsa_kernels.attention import AttentionLaunch, plan_attention
    from qsa_kernels.options import KernelOptions

    T, Hq, Hkv, D, W, page = 4, 24, 2, 256, 2051, 64
    pages = 131072 // page
    q = torch.randn(T, Hq, D, device=dev, dtype=torch.bfloat16)
    gate = torch.randn(T, Hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T * pages, page, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(T * pages, device=dev, dtype=torch.int32).view(T, pages)
    to_req = torch.arange(T, device=dev, dtype=torch.int32)
    seq = torch.full((T,), 131072, device=dev, dtype=torch.int32)
    sel = torch.randint(0, 131072, (T, W + 1), device=dev, dtype=torch.int32)
    sel[:, -1] = W
    out = torch.empty(T, Hq * D, device=dev, dtype=torch.bfloat16)
    bound = []
    for options in (KernelOptions(), slow):
        schedule = plan_attention(T, Hq, Hkv, D, W, device=dev, options=options)
        launch = AttentionLaunch(q, gate, k, v, table, to_req, seq, sel, softmax_scale=D**-0.5, out=out,
                                 schedule=schedule)
        bound.append(launch._launches[0][0])  # the per-row kernel (its combine launch left out)
    qs, gs, bs, ss, os_ = q.stride(), gate.stride(), table.stride(), sel.stride(), out.stride()
    free = (q, gate, table, to_req, seq, sel, out, qs[0], qs[1], gs[0], gs[1], os_[0], bs[0], bs[1], ss[0], ss[1])
    return (*bound, free)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_qsa.py launch", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="launches per timed round")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per path (their median)")
    parser.add_argument("--out", type=Path, default=None, help="folder for launch.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False): it times kernel launches")
    from qsa_kernels import launch

    if launch.RUNTIME is None:
        parser.error(f"triton {triton.__version__} is not one the bound launch knows ({launch.SUPPORTED_TRITON})")
    rows = []
    for name, (fast, ordinary, free) in kernels().items():
        for path, fn in paths(fast, ordinary, free).items():
            try:
                us = round(host_us(fn, args.calls, args.rounds), 2)
            except Exception as exc:  # a path this Triton does not offer: report it, go on
                us = f"error: {type(exc).__name__}: {exc}"[:100]
            rows.append(dict(kernel=name, path=path, us=us))
            print(f"{name:<28}{path:<22}{us}", flush=True)
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__)
    print(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}: host us per launch")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "launch.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
