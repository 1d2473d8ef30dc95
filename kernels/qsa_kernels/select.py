"""Triton selection: group scores over compressed keys, then an exact top-k in a total order.

Contract: `qsa_core/reference/select.py`. A select call runs per chunk of rows (host ints
only, no sync): the score launch (`select_score.py`) fills a capped fp32 scratch
[chunk rows, num_cols] for rows with visible > Kb, then the top-k launches
(`select_radix.py`: one fused program per row, or the radix passes; for short decode rows
`select_topk.py`, see `_topk_route`; for long prefill rows `select_prefill.py` from samples the
score launch writes too, see `_prefill_route`; long decode chunks of one row per request
`select_prefill`'s top-k from per-row samples, see `_decode_samples_route`) write each row's
chosen groups in ascending order (or the packed rows); rows with visible <= Kb take groups
0..visible-1 unscored.

`plan_select` fixes the schedule of a call (chunk, route, scratch views) when a step is
planned; `SelectLaunch` binds all of a call's launches to that schedule, the compressed keys
and the output (`launch.py`), so a layer relaunches them with q_idx and the block table only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from .select_radix import BINS as _BINS
from .select_radix import ChunkLaunches, TopkLaunch
from .options import DEFAULT, KernelOptions
from .select_score import ScoreLaunch, score_tiles
from . import select_prefill, select_topk
from .warm import kv_warm

# Route policy of a select call (`plan_select`): each bound with the reason for it; the H200
# figures behind them are in NOTES.md (Kernels). `python benchmarks/bench_qsa.py --only KEY --out
# DIR` times a table row's whole step (KEY as in results.json, e.g. decode-131072-4-1-bf16).

# Cap on the fp32 score scratch of one chunk of rows (bytes); never [rows, all columns].
SCORE_SCRATCH_BYTES = 64 << 20
# A prefill chunk scores at least this many rows (or all of them), past the cap where rows are
# long (256 MiB at 1M context): the score kernel's per-chunk tail and the top-k launches amortise
# (faster than 64-row chunks at 1M; --only prefill-1048576-1-16384-bf16). Shorter contexts
# already chunk >= 256 rows under the cap.
PREFILL_MIN_CHUNK_ROWS = 256
# Fused per-row top-k only for few rows over few columns, where the radix passes' ten launches
# dominate; one program per row is slower than the passes beyond ~4K columns or for many rows
# (--only decode-8192-1-1-bf16 prefill-16384-1-16384-bf16).
_FUSED_MAX_COLS = 4096
# The planner's column buckets above 4096 are its multiples (`planner.column_bucket`).
_BUCKET_STEP = 4096
_FUSED_MAX_ROWS = 256
# Decode chunks of up to this many rows whose rows fit `select_topk`'s short top-k take it: one
# launch where the radix passes take seven, faster at 8K context with 1 and 256 rows (--only
# decode-8192-1-1-bf16 decode-32768-4-1-bf16).
_TOPK_SHORT_MAX_ROWS = 256
# The per-row-samples decode route (the score launch also writes per-row samples, then one
# `select_prefill` top-k launch, `select_prefill.decode_tiles`; MTP rows' samples come from a
# launch of their own over the score scratch) takes decode chunks of up to this many rows longer
# than the short top-k's (with `KernelOptions.decode_samples`): two or three launches where the
# radix passes take seven, faster than them and than the segment top-k it replaced at every
# shape measured (128K B4, B64, B256, 1M B4, MTP 1M B4 x 4 and 128K B16 x 4; --only
# decode-131072-4-1-bf16 decode-131072-64-1-bf16 decode-1048576-4-1-bf16 decode-1048576-4-4-bf16).
_DECODE_SAMPLES_MAX_ROWS = 256


def _decode_samples_route(n_cols: int, block_topk: int, chunk: int, decode: bool, options: KernelOptions,
                          rows_per_request: int = 1) -> select_prefill.SampleTiles | None:
    """The `select_prefill.decode_tiles` where a decode chunk takes the per-row-samples route
    (options.decode_samples, at most _DECODE_SAMPLES_MAX_ROWS rows, rows longer than the short
    top-k's), else None."""
    small = options.small_tiles
    if not (options.decode_samples and decode and chunk <= _DECODE_SAMPLES_MAX_ROWS) or select_topk.short_route(
            n_cols, select_topk.topk_tiles(n_cols, small, chunk)):
        return None
    return select_prefill.decode_tiles(n_cols, block_topk, decode_block_g(options), small, chunk, rows_per_request)


def decode_block_g(options: KernelOptions = DEFAULT) -> int:
    """Columns per decode score tile (the largest per-row sample stride)."""
    return score_tiles(True, select_tiles(True, options), options.small_tiles).block_g


def _topk_route(n_cols: int, chunk: int, decode: bool, options: KernelOptions) -> bool:
    """Whether a decode chunk of rows takes `select_topk`'s short top-k (else `select_radix`)."""
    return decode and chunk <= _TOPK_SHORT_MAX_ROWS and select_topk.short_route(
        n_cols, select_topk.topk_tiles(n_cols, options.small_tiles, chunk))


def _prefill_route(n_cols: int, block_topk: int, decode: bool, chunk: int,
                   options: KernelOptions) -> select_prefill.SampleTiles | None:
    """The `select_prefill` tiles where a prefill chunk of `chunk` rows x n_cols columns takes
    it (at least options.select_prefill_min_rows rows), else None."""
    if decode or chunk < options.select_prefill_min_rows:
        return None
    block_g = score_block_g(n_cols, options)
    tiles = select_prefill.prefill_tiles(n_cols, block_topk, block_g, small=options.small_tiles)
    return tiles if n_cols > block_topk and select_prefill.prefill_route(n_cols, block_topk, tiles, block_g) else None


def score_block_g(n_cols: int, options: KernelOptions = DEFAULT) -> int:
    """Columns per prefill score tile of rows of n_cols columns (the samples' geometry)."""
    return score_tiles(False, select_tiles(False, options), options.small_tiles, num_cols=n_cols).block_g


def _score_scratch(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """fp32 [rows, cols] score scratch (uninitialised; tests poison it with NaN)."""
    return torch.empty(rows, cols, dtype=torch.float32, device=device)


def select_tiles(decode: bool, options: KernelOptions = DEFAULT) -> SelectTiles:
    """The tiles of a decode or prefill select call (`SelectTiles`). options.small_tiles: small
    column tiles (tests cross tile borders) and 8 rows per radix program (the interpreter's cost
    is per program). Else the H200's: 128-column decode score tiles and 64-column prefill ones
    (`select_score.score_tiles` says why), radix tiles of 4096 columns and one row a program."""
    if options.small_tiles:
        return SelectTiles(block_r=16, block_g=16, scan=32, rows=8)
    return SelectTiles(block_r=64, block_g=128 if decode else 64, scan=4096, rows=1)


@dataclass(frozen=True)
class SelectTiles:
    """Tiles of one select call (`select_tiles`). block_r x block_g: the prefill score tile
    (block_r rows feed tl.dot); block_g alone for decode (one row a program, heads feed tl.dot);
    scan: columns per radix tile; rows: rows per radix program; rows_per_request: decode rows
    per request (> 1: a request's rows share each key load); rows_aligned: the decode rows are
    whole requests from row 0 (a decode-only step: the request-rows score kernel)."""

    block_r: int
    block_g: int
    scan: int
    rows: int
    rows_per_request: int = 1
    rows_aligned: bool = False


@dataclass(frozen=True)
class SelectWorkspace:
    """Persistent scratch of selection (flat; a schedule takes views): fp32 scores, the
    int32 radix histograms and arrival counters (zero between uses: the resolving program
    clears what it read), states and per-tile counts; the scratch of `select_prefill` (long prefill rows)."""

    scores: torch.Tensor
    hist: torch.Tensor
    arrive: torch.Tensor
    state: torch.Tensor
    counts: torch.Tensor
    prefill: select_prefill.PrefillScratch | None = None
    decode_samples: select_prefill.PrefillScratch | None = None


def select_workspace(max_rows: int, max_cols: int, block_topk: int, device: torch.device | str,
                     options: KernelOptions = DEFAULT) -> SelectWorkspace:
    """Scratch for any `plan_select` with num_rows <= max_rows, num_cols <= max_cols and these
    options (with options.decode_samples: also that of the per-row-samples decode route)."""
    dev = torch.device(device)
    cols = max(max_cols, 1)
    if cols <= block_topk:  # nothing is ever scored
        return SelectWorkspace(*(torch.empty(0, dtype=dt, device=dev) for dt in (torch.float32,) + (torch.int32,) * 4))
    tiles = select_tiles(True, options)  # both kinds share the radix tiles
    max_chunk = min(max_rows, max(1, SCORE_SCRATCH_BYTES // (4 * (block_topk + 1))))
    score_elems = max(min(max_chunk * cols, SCORE_SCRATCH_BYTES // 4), _scored_chunk(max_rows, cols, False) * cols)
    hist_rows = triton.cdiv(max_chunk, tiles.rows) * tiles.rows
    # chunk * n_tiles <= chunk + chunk * cols / scan, and chunk * cols <= score_elems.
    count_slots = max_chunk + score_elems // tiles.scan + 1
    return SelectWorkspace(
        scores=_score_scratch(1, score_elems, dev).view(-1),
        hist=torch.zeros(hist_rows * _BINS, dtype=torch.int32, device=dev),
        arrive=torch.zeros(hist_rows, dtype=torch.int32, device=dev),
        state=torch.empty(max_chunk * 4, dtype=torch.int32, device=dev),
        counts=torch.empty(count_slots * 2, dtype=torch.int32, device=dev),
        prefill=_prefill_scratch(max_rows, cols, block_topk, dev, options),
        decode_samples=_decode_samples_scratch(max_rows, cols, block_topk, dev, options)
        if options.decode_samples else None,
    )


def _scored_chunk(num_rows: int, n_cols: int, decode: bool) -> int:
    """Rows per scratch pass of scored rows of n_cols columns (the score scratch cap; prefill:
    at least PREFILL_MIN_CHUNK_ROWS)."""
    rows = max(1, SCORE_SCRATCH_BYTES // (4 * n_cols))
    return max(1, min(num_rows, rows if decode else max(rows, PREFILL_MIN_CHUNK_ROWS)))


def _prefill_scratch(max_rows: int, max_cols: int, block_topk: int, dev: torch.device,
                     options: KernelOptions) -> select_prefill.PrefillScratch | None:
    """`select_prefill` scratch for every prefill plan up to max_rows x max_cols (num_cols:
    the `planner.column_bucket`s, powers of two up to 4096 then multiples of 4096, or
    max_cols): the largest need of any column bound that takes the route (a chunk's need is
    not monotone in its columns: a multiple of 4096 may need more than the next power of two)."""
    need: dict[str, int] = {}
    bounds = ({max_cols} | {1 << i for i in range(block_topk.bit_length(), max_cols.bit_length())}
              | set(range(_BUCKET_STEP, max_cols + 1, _BUCKET_STEP)))
    for c in sorted(bounds):
        chunk = _scored_chunk(max_rows, c, False)
        tiles = _prefill_route(c, block_topk, False, chunk, options)
        if tiles is not None:
            elems = select_prefill.prefill_scratch_elems(chunk, max_rows, c, tiles, score_block_g(c, options))
            need = {k: max(need.get(k, 1), v) for k, v in elems.items()}
    return select_prefill.prefill_scratch(need, dev) if need else None


def _decode_samples_scratch(max_rows: int, max_cols: int, block_topk: int, dev: torch.device,
                            options: KernelOptions) -> select_prefill.PrefillScratch | None:
    """Scratch of the per-row-samples decode route for every decode plan up to max_rows x
    max_cols (`planner.column_bucket`s): the largest need of any that takes it, a power of two
    c standing for the bounds in (c / 2, c] (their chunks up to that of c / 2 + 1 columns, their
    rows' needs up to c's), and n = min(2^k, that chunk) rows for the chunks of (2^(k-1), 2^k]
    rows (`select_prefill.decode_seg`'s rows class: fewer rows may take more segments)."""
    need: dict[str, int] = {}
    bounds = {1 << i for i in range(block_topk.bit_length(), (max_cols - 1).bit_length() + 1)}
    for c in sorted(bounds):
        chunk = min(_scored_chunk(max_rows, c // 2 + 1, True), _DECODE_SAMPLES_MAX_ROWS)
        for n in sorted({min(1 << k, chunk) for k in range(chunk.bit_length() + 1)}):
            tiles = _decode_samples_route(c, block_topk, n, True, options) if c > block_topk else None
            if tiles is not None:
                elems = select_prefill.prefill_scratch_elems(n, n, c, tiles, decode_block_g(options))
                need = {k: max(need.get(k, 1), v) for k, v in elems.items()}
    return select_prefill.prefill_scratch(need, dev) if need else None


@dataclass(frozen=True)
class SelectSchedule:
    """How one select call runs, fixed when the step is planned (host ints and views only).

    num_cols: the column bound (groups of the longest request); chunk: rows per scratch
    pass; scored: any row may have more than Kb visible groups; fused: the one-launch
    per-row top-k, else the radix passes; the views scores fp32 [chunk, num_cols], hist,
    arrive, state, counts int32 (unscored: one-element stand-ins, never read); topk_tiles: the
    tiles of `select_topk` where a decode chunk takes it instead (`_topk_route`), else None;
    prefill / prefill_tiles: those of `select_prefill` where a prefill chunk takes it
    (`_prefill_route`), else None; decode_samples / decode_samples_tiles: those of the
    per-row-samples decode route (`_decode_samples_route`), else None.
    """

    num_rows: int
    num_cols: int
    chunk: int
    scored: bool
    fused: bool
    decode: bool
    n_tiles: int
    tiles: SelectTiles
    options: KernelOptions
    scores: torch.Tensor
    hist: torch.Tensor
    arrive: torch.Tensor
    state: torch.Tensor
    counts: torch.Tensor
    topk_tiles: select_topk.TopkTiles | None = None
    prefill: select_prefill.PrefillScratch | None = None
    prefill_tiles: select_prefill.SampleTiles | None = None
    decode_samples: select_prefill.PrefillScratch | None = None
    decode_samples_tiles: select_prefill.SampleTiles | None = None

    @property
    def route(self) -> str:
        """The top-k route `SelectLaunch` binds: "prefill" (`select_prefill`), "dsamp" (the
        per-row-samples decode route), "topk-short" (`select_topk`), "fused" or "radix"
        (`select_radix`'s one program per row or passes)."""
        if self.prefill is not None:
            return "prefill"
        if self.decode_samples is not None:
            return "dsamp"
        if self.topk_tiles is not None:
            return "topk-short"
        return "fused" if self.fused else "radix"


def _route_scratch(workspace: SelectWorkspace | None, name: str, need: dict[str, int], make):
    """A route's scratch: the workspace's field `name` (else `make()`, allocated here), checked
    to hold `need` elements per field."""
    have = getattr(workspace, name) if workspace is not None else None
    have = make() if have is None else have
    for field, n in need.items():
        if getattr(have, field).numel() < n:
            raise ValueError(f"select workspace.{name}.{field} holds {getattr(have, field).numel()} < {n} elements")
    return have


def plan_select(
    num_rows: int,
    num_cols: int,
    block_topk: int,
    *,
    decode: bool,
    device: torch.device | str,
    workspace: SelectWorkspace | None = None,
    rows_per_request: int = 1,
    rows_aligned: bool = False,
    options: KernelOptions = DEFAULT,
) -> SelectSchedule:
    """Schedule of a decode or prefill select over num_rows rows and num_cols columns.

    num_cols = max_seq_len // r, the bound on any row's visible groups. Scratch views come
    from `workspace` (CUDA-graph safe) or are allocated here. rows_per_request: decode rows
    per request (decode_query_len; > 1 lets a request's rows share each key load).
    rows_aligned: the decode rows are whole requests of rows_per_request rows from row 0, then
    inert rows (a decode-only step: no request of 0 rows shifts another's); MTP rows then take
    the request-rows score kernel, in chunks of whole requests.
    options: the kernels' options (routes, tiles; the launches bound to the schedule take it).
    """
    Kb = block_topk
    n_cols = max(num_cols, 1)
    # (decode scores: MTP rows share keys)
    tiles = replace(select_tiles(decode, options), rows_per_request=rows_per_request, rows_aligned=rows_aligned)
    scan = tiles.scan
    n_tiles = triton.cdiv(n_cols, scan)
    scored = n_cols > Kb
    chunk = _scored_chunk(num_rows, n_cols, decode) if scored else max(num_rows, 1)
    if decode and rows_aligned and chunk < num_rows:  # a request's rows in one chunk
        chunk = max(rows_per_request, chunk - chunk % rows_per_request)
    fused = n_cols <= _FUSED_MAX_COLS and chunk <= _FUSED_MAX_ROWS
    rows = tiles.rows
    if workspace is None and scored:
        workspace = SelectWorkspace(
            scores=_score_scratch(chunk, n_cols, torch.device(device)).view(-1),
            hist=torch.zeros(triton.cdiv(chunk, rows) * rows * _BINS, dtype=torch.int32, device=device),
            arrive=torch.zeros(triton.cdiv(chunk, rows), dtype=torch.int32, device=device),
            state=torch.empty(chunk * 4, dtype=torch.int32, device=device),
            counts=torch.empty(chunk * n_tiles * 2, dtype=torch.int32, device=device),
        )
    if scored:
        need = dict(scores=chunk * n_cols, hist=triton.cdiv(chunk, rows) * rows * _BINS,
                    arrive=triton.cdiv(chunk, rows), state=chunk * 4, counts=chunk * n_tiles * 2)
        for name, n in need.items():
            if getattr(workspace, name).numel() < n:
                raise ValueError(f"select workspace.{name} holds {getattr(workspace, name).numel()} < {n} elements")
        scores = workspace.scores[: chunk * n_cols].view(chunk, n_cols)
        hist = workspace.hist[: need["hist"]].view(-1, _BINS)
        arrive = workspace.arrive[: need["arrive"]]
        state = workspace.state[: chunk * 4].view(chunk, 4)
        counts = workspace.counts[: need["counts"]].view(chunk, n_tiles, 2)
    else:
        # Never read (every row has visible <= Kb), but of the dtypes the kernels declare: the
        # emit's chosen count sums `counts` as int32, which sm_90's compiler checks.
        scores = torch.empty(1, 1, dtype=torch.float32, device=device)
        hist = arrive = state = counts = torch.empty(1, 1, dtype=torch.int32, device=device)
    dsamp_tiles = _decode_samples_route(n_cols, Kb, chunk, decode, options, rows_per_request) if scored else None
    dsamp = None
    if dsamp_tiles is not None:
        need = select_prefill.prefill_scratch_elems(chunk, chunk, n_cols, dsamp_tiles, decode_block_g(options))
        dsamp = _route_scratch(workspace, "decode_samples", need, lambda: select_prefill.prefill_scratch(need, device))
    topk_tiles = None
    if dsamp is None and _topk_route(n_cols, chunk, decode, options):
        topk_tiles = select_topk.topk_tiles(n_cols, options.small_tiles, chunk)
    prefill = None
    prefill_tiles = _prefill_route(n_cols, Kb, decode, chunk, options)
    if prefill_tiles is not None:
        need = select_prefill.prefill_scratch_elems(chunk, num_rows, n_cols, prefill_tiles,
                                                    score_block_g(n_cols, options))
        prefill = _route_scratch(workspace, "prefill", need, lambda: select_prefill.prefill_scratch(need, device))
    return SelectSchedule(
        num_rows=num_rows, num_cols=n_cols, chunk=chunk, scored=scored, fused=fused, decode=decode,
        n_tiles=n_tiles, tiles=tiles, options=options,
        scores=scores, hist=hist, arrive=arrive, state=state, counts=counts, topk_tiles=topk_tiles,
        prefill=prefill, prefill_tiles=prefill_tiles, decode_samples=dsamp, decode_samples_tiles=dsamp_tiles,
    )


class SelectLaunch:
    """A select call's launches bound to its schedule, the compressed keys [pages,
    page_size / r, Di] and token_to_req / visible_blocks int32 [N], for the schedule's rows
    [first_row, first_row + num_rows) of these N-row tensors; `__call__(q_idx [N, Hi, Di],
    block_table, out)` launches them (q_idx's dtype fixed) into out: int32 [N, Kb] (the
    chosen groups) or, with `positions` int64 [N] given, the packed selection int32
    [N, W + 1] (groups expanded to tokens, the open tail, the count: no expand launch).
    `out` at binding gives the shape and dtype every call's out must have. kv_cache: the
    layer's (K, V) caches, which a decode chunk's top-k may warm in L2 for the attention
    (`warm.kv_warm`)."""

    def __init__(self, schedule: "SelectSchedule", q_idx: torch.Tensor, compressed: torch.Tensor,
                 block_table: torch.Tensor, token_to_req: torch.Tensor, visible_blocks: torch.Tensor,
                 out: torch.Tensor, *, page_size: int, compress_ratio: int, block_topk: int,
                 first_row: int = 0, positions: torch.Tensor | None = None,
                 kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        s, options = schedule, schedule.options
        kv = kv_warm(*kv_cache, token_to_req, compress_ratio, s.num_rows, block_topk, options) \
            if kv_cache is not None and s.decode else None
        self.rows, self.q_dtype, self.out_shape = first_row + s.num_rows, q_idx.dtype, out.shape
        for name, t in (("q_idx", q_idx), ("token_to_req", token_to_req), ("visible_blocks", visible_blocks),
                        ("out", out)):
            if t.shape[0] < self.rows:
                raise ValueError(f"the select schedule covers rows up to {self.rows}; {name} has {t.shape[0]}")
        bound: dict[int, tuple] = {}  # rows of a chunk -> its launches (all full chunks share theirs)
        self._chunks: list[tuple[int, ScoreLaunch | None, ChunkLaunches]] = []
        for row0 in range(first_row, self.rows, s.chunk):
            n = min(s.chunk, self.rows - row0)
            if n not in bound:
                samples = None if s.prefill is None else select_prefill.samples_view(
                    s.prefill, s.chunk, s.num_cols, s.prefill_tiles, score_block_g(s.num_cols, options))
                if s.decode_samples is not None:
                    samples = select_prefill.samples_view(s.decode_samples, s.chunk, s.num_cols,
                                                          s.decode_samples_tiles, decode_block_g(options))
                scored_samples = s.decode_samples is not None and not s.decode_samples_tiles.sample_launch
                score = ScoreLaunch(
                    q_idx, compressed, block_table, token_to_req, visible_blocks, s.scores, row0=row0, rows=n,
                    num_cols=s.num_cols, page_size=page_size, compress_ratio=compress_ratio, block_topk=block_topk,
                    decode=s.decode, tiles=s.tiles, options=options,
                    samples=samples if s.prefill is not None or scored_samples else None,
                    sample_sub=0 if s.prefill is None else s.prefill_tiles.sub,
                    row_samples=s.decode_samples_tiles.row_s if scored_samples else 0,
                ) if s.scored else None
                if s.prefill is not None:
                    topk = select_prefill.PrefillTopkLaunch(
                        s.scores, samples, visible_blocks, out, s.prefill, row0=row0, rows=n, num_cols=s.num_cols,
                        block_topk=block_topk, tiles=s.prefill_tiles, score_block_g=score_block_g(s.num_cols, options),
                        first_row=first_row, num_rows=s.num_rows, chunk=s.chunk, positions=positions,
                        compress_ratio=compress_ratio, options=options,
                    )
                elif s.decode_samples is not None:
                    topk = select_prefill.PrefillTopkLaunch(
                        s.scores, samples, visible_blocks, out, s.decode_samples, row0=row0, rows=n,
                        num_cols=s.num_cols, block_topk=block_topk, tiles=s.decode_samples_tiles,
                        score_block_g=decode_block_g(options), first_row=first_row, num_rows=s.num_rows,
                        chunk=s.chunk, positions=positions, compress_ratio=compress_ratio, kv=kv,
                        block_table=block_table, options=options,
                    )
                elif s.topk_tiles is not None:
                    topk = select_topk.TopkLaunch(
                        s.scores, visible_blocks, out, row0=row0, rows=n, num_cols=s.num_cols,
                        block_topk=block_topk, tiles=s.topk_tiles, positions=positions, compress_ratio=compress_ratio,
                        options=options,
                    )
                else:
                    topk = TopkLaunch(
                        s.scores, visible_blocks, out, s.state, s.hist, s.arrive, s.counts, row0=row0, rows=n,
                        num_cols=s.num_cols, n_tiles=s.n_tiles, block_topk=block_topk, scored=s.scored,
                        fused=s.fused, tiles=s.tiles, positions=positions, compress_ratio=compress_ratio,
                        options=options,
                    )
                bound[n] = (score, topk)
            self._chunks.append((row0, *bound[n]))

    def __call__(self, q_idx: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if q_idx.dtype is not self.q_dtype or q_idx.shape[0] < self.rows:
            raise ValueError(f"select was bound for q_idx {self.q_dtype} [>= {self.rows}, ...], "
                             f"got {q_idx.dtype} {tuple(q_idx.shape)}")
        if out.shape != self.out_shape or out.dtype is not torch.int32:
            raise ValueError(f"select out must be int32 {tuple(self.out_shape)}, got {out.dtype} {tuple(out.shape)}")
        out_stride = out.stride()[0]
        for row0, score, topk in self._chunks:
            if score is not None:
                score(q_idx, block_table, row0)
            topk(row0, out, out_stride, block_table)
        return out
