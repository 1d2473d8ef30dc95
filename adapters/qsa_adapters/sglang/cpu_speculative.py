"""What SGLang 0.5.23's NEXTN / EAGLE path needs on the CPU, applied for `qsa_core` only.

SGLang sends the CPU to sgl_kernel's CPU build for EAGLE's tree build and greedy
verification (only with `SGLANG_USE_CPU_ENGINE=1`; that build is not on PyPI). Without it
`build_tree_kernel_efficient_func` raises NameError and `verify_tree_greedy_func` returns its
outputs untouched (nothing accepted). Both have Triton kernels in the same SGLang module (its
XPU route); with `TRITON_INTERPRET=1` (set by `cpu.apply_cpu_settings`) they run on the CPU.
The MTP draft layer runs SGLang's own QSA backend, whose `QSAIndexer` defines only
forward_cuda / forward_xpu: its CPU forward is routed to SGLang's own portable `_forward_impl`.

Three AROUND hooks, each a pass-through unless `cpu.apply_cpu_settings` ran in this process
(`qsa_core` on the CPU).
"""

from __future__ import annotations

from typing import Any, Callable

from . import cpu

SPEC_TREE = "sglang.kernels.ops.speculative.spec_tree"
BUILD_TARGET = SPEC_TREE + ".build_tree_kernel_efficient_func"
VERIFY_TARGET = SPEC_TREE + ".verify_tree_greedy_func"
INDEXER_TARGET = "sglang.srt.layers.attention.qsa.qsa_indexer.QSAIndexer.forward_native"


def build_tree_around(original: Callable, *args: Any, **kwargs: Any) -> None:
    """EAGLE's tree build (positional arguments as SGLang passes them) on SGLang's Triton kernel."""
    if not cpu.cpu_settings_applied():
        return original(*args, **kwargs)
    from sglang.kernels.ops.speculative import spec_tree

    spec_tree.sgl_build_tree_kernel_triton(*args, **kwargs)


def verify_greedy_around(original: Callable, *args: Any, **kwargs: Any):
    """EAGLE's greedy verification on SGLang's Triton kernel; returns (predicts, accept_index,
    accept_token_num) as SGLang's dispatcher does."""
    if not cpu.cpu_settings_applied():
        return original(*args, **kwargs)
    from sglang.kernels.ops.speculative import spec_tree

    names = ("predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index",
             "retrieve_next_token", "retrieve_next_sibling", "target_predict")
    bound = {**dict(zip(names, args)), **kwargs}
    bound.pop("topk", None)  # the chain / tree layout is in the retrieve_* tensors
    spec_tree.verify_tree_greedy_triton(**bound)
    return bound["predicts"], bound["accept_index"], bound["accept_token_num"]


def indexer_forward_native_around(original: Callable, indexer: Any, *args: Any, **kwargs: Any):
    """SGLang's QSAIndexer on the CPU (the MTP draft layer): its own portable forward."""
    if not cpu.cpu_settings_applied():
        return original(indexer, *args, **kwargs)
    return indexer._forward_impl(*args, **kwargs)


HOOKS = ((BUILD_TARGET, build_tree_around), (VERIFY_TARGET, verify_greedy_around),
         (INDEXER_TARGET, indexer_forward_native_around))
