"""The kernels' options: every route, tile and launch switch of `qsa_kernels`, as one typed value.

Nothing in `qsa_kernels` reads the environment: a planner holds one `KernelOptions` (the
core's `QSAOptions.kernel`, filled from the environment by `QSAOptions.from_env`) and passes
it to `plan_select`, `plan_attention`, `select_workspace`, `partials_size`, the `*Launch`
classes and `Launcher.bind`. The defaults
are the production behaviour on a GPU; `KernelOptions.for_interpreter()` is what Triton's CPU
interpreter needs (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

_PDL_MODES = (0, 1, 2)


@dataclass(frozen=True)
class KernelOptions:
    """Route, tile and launch options of the kernels (frozen: a schedule keeps the one it was
    planned with).

    interpreter: the kernels run in Triton's interpreter: loops over loaded bounds take their
        `while` form, tl.dot operands are fp32 (the interpreter's bf16 dots are wrong), the
        prepare's roundings are done by hand, and the L2 warm's inline asm is never bound.
        Must be True exactly when `TRITON_INTERPRET=1` (CPU tests).
    small_tiles: tiles of a few columns, rows per radix program and a 32-column one-pass
        attention block, so that the interpreter's small test shapes cross every tile border
        and reach every route (its cost is per program, not per element). CPU tests only.
    select_prefill_min_rows: prefill select chunks of at least this many rows take the
        sample-bounded top-k (`select_prefill`): 64 on the GPU, where chunks of 64, 512 and 4096
        rows (at 1M, 128K and 16K context) were faster on it than on the radix passes (H200, see
        NOTES.md (Kernels); `python benchmarks/bench_qsa.py --only prefill-16384-1-16384-bf16 --out
        DIR`); 1 in the interpreter's tests so that small steps reach that route.
    fast_launch: bound launches call the compiled kernel's launcher directly (`launch.py`);
        False launches every kernel the ordinary way, `kernel[grid](...)`. Flipped by an engineer
        (QSA_FAST_LAUNCH=0) to time the launcher against Triton's path (`bench_qsa.py host`) or
        to rule it out when a launch misbehaves.
    pdl: programmatic dependent launch mode on sm_90+ (0 off, 1 signal after the wait, 2
        signal at the end). Flipped (QSA_PDL) by the GPU suite, which checks that every mode gives
        the same bits, and by an engineer as a fallback should a driver misbehave.
    decode_samples: long decode chunks of <= 256 rows take the per-row-samples top-k
        (`select.py`); False sends them to the radix passes. Flipped (QSA_DECODE_SAMPLES=0) to
        time the route against the passes, and by tests to reach the short and radix top-k.
    shared_prefill: prefill attention steps of >= shared_prefill_min_rows rows run the
        shared-tile kernels (`attention_prefill.py`); False keeps the one-pass kernel. Flipped
        (QSA_SHARED_PREFILL=0) to time the shared tiles against the one pass.
    shared_prefill_min_rows: 1024: the shared tiles gain where neighbouring rows' selections
        overlap and stay within noise of the one pass on random selections (H200, see NOTES.md
        (Kernels); `python benchmarks/bench_qsa.py --only prefill-16384-1-16384-bf16
        --prefill-data overlap --out DIR`); tests lower it to reach those kernels with few rows.
    l2_warm: the decode top-k hints the chosen groups' K/V into L2 (`warm.py`); it changes no
        value. Flipped (QSA_L2_WARM=0) by the GPU suite, which checks the bits are the same
        without it, and to time the hint.
    """

    interpreter: bool = False
    small_tiles: bool = False
    select_prefill_min_rows: int = 64
    fast_launch: bool = True
    pdl: int = 2
    decode_samples: bool = True
    shared_prefill: bool = True
    shared_prefill_min_rows: int = 1024
    l2_warm: bool = True

    def __post_init__(self) -> None:
        if self.pdl not in _PDL_MODES:
            raise ValueError(f"KernelOptions.pdl must be one of {_PDL_MODES}, got {self.pdl!r}")
        if self.select_prefill_min_rows < 1:
            raise ValueError(f"KernelOptions.select_prefill_min_rows must be >= 1, got {self.select_prefill_min_rows}")

    @classmethod
    def for_interpreter(cls, **overrides: object) -> "KernelOptions":
        """The options Triton's interpreter needs (interpreter, small tiles, the prefill
        top-k from one row), with `overrides` (field=value) on top."""
        return replace(cls(interpreter=True, small_tiles=True, select_prefill_min_rows=1), **overrides)


DEFAULT = KernelOptions()
