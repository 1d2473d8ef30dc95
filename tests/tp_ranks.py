"""Tensor-parallel QSA layers on torch.distributed ranks (test fixture, also run by the GPU
TP script).

`shard_layer` cuts a whole `QSAAttention` into one rank's layer the way vLLM's and SGLang's
`QKVParallelLinear` / `RowParallelLinear` cut theirs (`QSAConfig.head_shard`): this rank's
query heads of q_proj (each head's [q | gate] rows) and o_proj (columns), its KV heads of
k_proj / v_proj, the indexer and norms whole. `TPLayer` sums the ranks' o_proj outputs
(all-reduce) and records every selection. `run_ranks` spawns the ranks, each running the same
`SCHEDULE` through a `standalone.Runner` of its own (per-rank caches, same page order), and
returns what each rank saw.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from qsa_core import QSAAttention, QSAConfig
from qsa_core.standalone import Runner

# The tiny geometry of the HF oracle's TINY: 4 query / 2 KV heads, so TP 2 splits the KV
# heads and TP 4 replicates each on two ranks. Budget 16 tokens: contexts past 16 select.
TINY = QSAConfig(
    hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, index_n_heads=4, index_head_dim=128,
    token_topk=16, compress_ratio=4, rotary_dim=32, rope_theta=1e4,
)
# Steps of three requests: chunked prefills, a decode beside prefills, then decodes only.
SCHEDULE = [{"a": 33, "b": 22}, {"a": 1, "b": 20, "c": 27}, {"a": 1, "b": 1, "c": 1}]
RUNNER = dict(page_size=8, num_pages=48, max_requests=4, shuffle_pages=True, seed=3)


def random_layer(config: QSAConfig, seed: int) -> QSAAttention:
    """A `QSAAttention` with every weight random (norms included); each indexer query head is
    mixed with the key projection, as trained indexers score most groups above zero (few
    exact ReLU-zero ties at the top-k boundary)."""
    g = torch.Generator().manual_seed(seed)
    layer = QSAAttention(config)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.3 if "norm" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        w, Di = layer.indexer.index_qk_proj.weight, config.index_head_dim
        for h in range(config.index_n_heads):
            w[h * Di : (h + 1) * Di] = 0.5 * w[h * Di : (h + 1) * Di] + w[-Di:]
    return layer.eval()


def shard_layer(full: QSAAttention, tp_size: int, rank: int) -> QSAAttention:
    """Rank `rank`'s layer of `full` (weights copied): see the module docstring. An o_proj
    bias is kept on rank 0 only, so the all-reduced sum adds it once."""
    cfg = full.config
    shard = cfg.head_shard(tp_size, rank)
    D = cfg.head_dim
    q_rows = slice(shard.query_heads.start * 2 * D, shard.query_heads.stop * 2 * D)
    kv_rows = slice(shard.kv_heads.start * D, shard.kv_heads.stop * D)
    o_cols = slice(shard.query_heads.start * D, shard.query_heads.stop * D)
    layer = QSAAttention(cfg.for_rank(tp_size, rank))
    state = {}
    for name, t in full.state_dict().items():
        module, kind = name.rsplit(".", 1)
        if module == "q_proj":
            t = t[q_rows]
        elif module in ("k_proj", "v_proj"):
            t = t[kv_rows]
        elif module == "o_proj":
            t = t[:, o_cols] if kind == "weight" else (t if rank == 0 else torch.zeros_like(t))
        state[name] = t.clone()
    layer.load_state_dict(state)
    return layer.to(next(full.parameters()))


class TPLayer(nn.Module):
    """One rank's layer in a `Runner` chain: its partial o_proj output summed over the ranks
    (the engines' RowParallelLinear all-reduce); `selections` holds each step's selection."""

    def __init__(self, attn: QSAAttention, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.attn, self.config, self.group = attn, attn.config, group
        self.selections: list[torch.Tensor] = []

    def forward(self, hidden, plan, cache):
        sel = torch.empty(plan.num_tokens, self.config.packed_width, dtype=torch.int32, device=hidden.device)
        out = self.attn(hidden, plan, cache, selection_out=sel)
        self.selections.append(sel.cpu())
        if self.group is not None:
            if out.is_cuda and dist.get_backend(self.group) == "gloo":  # gloo reduces host copies
                host = out.cpu()
                dist.all_reduce(host, group=self.group)
                out.copy_(host)
            else:
                dist.all_reduce(out, group=self.group)
        return out


def schedule_inputs(config: QSAConfig, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The hidden states of every step of SCHEDULE (the same on every rank: TP replicates them)."""
    g = torch.Generator().manual_seed(seed)
    return [{rid: torch.randn(n, config.hidden_size, generator=g) for rid, n in step.items()} for step in SCHEDULE]


def run_schedule(layers: list[TPLayer], device: torch.device, dtype: torch.dtype) -> dict:
    """Run SCHEDULE through a Runner of `layers`; outputs, selections and caches (CPU copies)."""
    runner = Runner(layers, **RUNNER)
    outputs = []
    for chunks in schedule_inputs(layers[0].config):
        out = runner.step({rid: x.to(device, dtype) for rid, x in chunks.items()})
        outputs.append({rid: o.float().cpu() for rid, o in out.items()})
    caches = [{k: getattr(c, k).float().cpu() for k in ("k", "v", "compressed", "ring")} for c in runner.caches]
    return {"outputs": outputs, "selections": [layer.selections for layer in layers], "caches": caches}


def check_ranks(ranks: list[dict], tp1: dict, *, rtol: float, atol: float) -> None:
    """The ranks' results (`run_ranks`) against the unsharded run (`run_schedule`): outputs
    close (the partial o_proj sums add in another order); every layer's selections bitwise
    equal on every rank, layer 0's (same input everywhere) bitwise equal to TP 1's; each rank's
    main K/V its KV heads of TP 1's, its indexer caches whole (layer 0: bitwise)."""
    world = len(ranks)
    close = dict(rtol=rtol, atol=atol)
    for r, got in enumerate(ranks):
        for step, (mine, want) in enumerate(zip(got["outputs"], tp1["outputs"])):
            for rid in want:
                torch.testing.assert_close(mine[rid], want[rid], **close, msg=lambda m: f"rank {r} step {step} {rid}: {m}")
        for layer, sels in enumerate(got["selections"]):
            assert len(sels) == len(tp1["selections"][layer]) == len(SCHEDULE)
            for step, sel in enumerate(sels):
                assert torch.equal(sel, ranks[0]["selections"][layer][step]), f"rank {r} layer {layer} step {step}"
        for step, sel in enumerate(got["selections"][0]):
            assert torch.equal(sel, tp1["selections"][0][step]), f"rank {r} step {step}: layer 0 selection != TP 1"
        budget = TINY.token_topk
        assert sum(int((s[:, -1] > budget).sum()) for s in got["selections"][0]) > 40  # rows past the budget
        shard = TINY.head_shard(world, r)
        heads = slice(shard.kv_heads.start, shard.kv_heads.stop)
        for layer, (mine, want) in enumerate(zip(got["caches"], tp1["caches"])):
            assert mine["k"].shape[2] == len(shard.kv_heads)
            for name in ("k", "v"):
                torch.testing.assert_close(mine[name], want[name][:, :, heads], **close)
            for name in ("compressed", "ring"):
                if layer == 0:
                    assert torch.equal(mine[name], want[name]), f"rank {r} {name}"
                else:
                    torch.testing.assert_close(mine[name], want[name], **close)


def model(config: QSAConfig = TINY, num_layers: int = 2) -> list[QSAAttention]:
    return [random_layer(config, seed) for seed in range(num_layers)]


def _rank_main(rank: int, world: int, init: str, backend: str, device: str, dtype: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks meet on the loopback interface
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        dev = torch.device(device.replace("RANK", str(rank)))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dt = getattr(torch, dtype)
        layers = [TPLayer(shard_layer(full, world, rank).to(dev, dt), dist.group.WORLD) for full in model()]
        result = run_schedule(layers, dev, dt)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(world: int, out_dir: Path, *, backend: str = "gloo", device: str = "cpu",
              dtype: str = "float32", timeout: float = 240.0) -> list[dict]:
    """Spawn `world` ranks (torch.distributed over a file store in out_dir); each runs
    SCHEDULE on its shard of `model()` and saves its result. `device` may hold "RANK"
    (e.g. "cuda:RANK"). Every wait is bounded; ranks still alive at the deadline are killed."""
    ctx = multiprocessing.get_context("spawn")
    init = f"file://{out_dir / 'store'}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, backend, device, dtype, str(out_dir)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    errors = [(out_dir / f"rank{r}.err") for r in range(world)]
    detail = "\n".join(e.read_text() for e in errors if e.exists())
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"rank exit codes {codes} (None: killed at the {timeout:.0f} s deadline)\n{detail}"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]

