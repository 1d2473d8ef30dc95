"""Test-only process setup for the SGLang servers the server tests launch (never shipped).

The tests put this folder on the server's PYTHONPATH, so Python imports this module at the
start of the launcher and of every process SGLang spawns (the scheduler included). Patches
are applied right after their target module is imported (a meta-path hook), so processes
that never import a target pay nothing.

- QSA_TEST_BASELINE=1 (only the run of SGLang's own `--attention-backend qsa`): makes that
  baseline run on the CPU. SGLang's `QSAIndexer` defines only forward_cuda / forward_xpu,
  so its CPU forward (`forward_native`) is routed to SGLang's own portable
  `_forward_impl` (whose torch fallbacks run on the CPU); and the rotary embedding's CPU
  flag is set as the qsa_core plugin sets it for itself.
- QSA_TEST_DUMP=<folder> with QSA_TEST_DUMP_RID=<request id>: every QSA layer's selection
  rows of that request's steps (single-request steps only) are saved to
  `<folder>/<pid>-<n>.pt` as {"layer", "positions" [T], "selection" [T, W]} (token
  positions, -1 padded, any order), from SGLang's `QSAIndexer` (baseline) or from the
  core's indexer half `qsa_indexer` as the qsa_core backend calls it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import itertools
import os
import sys

PATCHES = {}


def on_import(module_name):
    def register(fn):
        PATCHES[module_name] = fn
        return fn

    return register


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


_counter = itertools.count()


def _save(layer_id, positions, selection):
    import torch

    folder = os.environ["QSA_TEST_DUMP"]
    path = os.path.join(folder, f"{os.getpid()}-{next(_counter)}.pt")
    torch.save(
        {"layer": int(layer_id), "positions": positions.detach().cpu().clone(), "selection": selection.detach().cpu().clone()},
        path,
    )


def _dump_wanted(forward_batch):
    rid = os.environ.get("QSA_TEST_DUMP_RID")
    return bool(os.environ.get("QSA_TEST_DUMP")) and list(getattr(forward_batch, "rids", None) or []) == [rid]


if os.environ.get("QSA_TEST_BASELINE") == "1":

    @on_import("sglang.srt.layers.rotary_embedding.base")
    def _rope_cpu(module):
        module._is_cpu = True  # as the qsa_core plugin does for itself (RotaryEmbedding's native path)

    @on_import("sglang.srt.layers.attention.qsa.qsa_indexer")
    def _indexer_cpu(module):
        cls = module.QSAIndexer
        impl = cls._forward_impl

        def forward_native(self, hidden_states, positions, forward_batch, indexer_metadata, **kw):
            out = impl(self, hidden_states, positions, forward_batch, indexer_metadata, **kw)
            if _dump_wanted(forward_batch):
                n = out.shape[0]
                _save(self.layer_id, forward_batch.positions[:n], out)
            return out

        cls.forward_native = forward_native  # makes the baseline run: SGLang's own portable forward


else:

    _context = {}

    @on_import("qsa_adapters.sglang.backend")
    def _core_dump(module):
        cls = module.QSACoreBackend
        for name in ("forward_extend", "forward_decode"):
            original = getattr(cls, name)

            def wrapped(self, q, k, v, layer, forward_batch, *args, _original=original, **kw):
                _context["dump"] = _dump_wanted(forward_batch)
                _context["layer"] = layer.layer_id
                try:
                    return _original(self, q, k, v, layer, forward_batch, *args, **kw)
                finally:
                    _context["dump"] = False

            setattr(cls, name, wrapped)
        indexer_half = module.qsa_indexer  # the core's indexer half, as the backend calls it

        def qsa_indexer(plan, *args, **kw):
            indexed = indexer_half(plan, *args, **kw)
            if _context.get("dump"):
                n = plan.meta.num_tokens
                _save(_context["layer"], plan.meta.positions[:n], indexed.selection[:n, :-1])
            return indexed

        module.qsa_indexer = qsa_indexer


sys.meta_path.insert(0, _PatchAfterImport())
