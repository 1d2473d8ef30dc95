"""What bench_qsa.py reports: the byte/FLOP model, the issue's targets, the tables, the JSON,
the plot, and the table sections of BENCHMARKS.md and README.md. No GPU needed.

    python benchmarks/bench_qsa.py report DIR [--markdown BENCHMARKS.md --readme README.md] [--no-plot]

re-renders DIR/table.md (and DIR/latency.png) from DIR/results.json, and with --markdown /
--readme rewrites the text between the bench markers of those files.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PEAK_BYTES_PER_S = 4.3e12  # device-to-device copy measured on the H200 machine kind
PEAK_FLOPS = 790e12  # bf16 8192^3 matmul measured there (dense tensor-core rate)
SCHEMA = 2  # results.json layout version: a resumed run skips only rows of this schema
MARK_START, MARK_END = "<!-- bench:table:start -->", "<!-- bench:table:end -->"


@dataclass(frozen=True)
class Geometry:
    """Per-layer shape of the benchmark (production Qwen4-Exp QSA)."""

    num_heads: int = 24
    num_kv_heads: int = 2
    head_dim: int = 256
    index_n_heads: int = 4
    index_head_dim: int = 128
    compress_ratio: int = 4
    token_topk: int = 2048
    page_size: int = 64

    @property
    def selection_width(self) -> int:  # W: budget plus the open tail of r - 1 tokens
        return self.token_topk + self.compress_ratio - 1


@dataclass
class Case:
    """One configuration: `batch` requests at `context` tokens, the last `rows` of each
    computed in this step (decode: rows <= 4 with MTP; prefill: one chunk)."""

    kind: str  # "decode" | "prefill"
    context: int
    batch: int
    rows: int
    index_dtype: str = "bf16"  # "bf16" | "fp8_e4m3": compressed keys and indexer queries

    @property
    def key(self) -> str:
        return f"{self.kind}-{self.context}-{self.batch}-{self.rows}-{self.index_dtype}"

    @property
    def label(self) -> str:
        ctx = f"{self.context >> 20}M" if self.context >= 1 << 20 else f"{self.context >> 10}K"
        if self.kind == "prefill":
            chunk = f"{self.rows >> 10}K" if self.rows >= 1024 else str(self.rows)
            return f"prefill {chunk} chunk at {ctx}"
        mtp = f", {self.rows} rows ({self.rows - 1} MTP)" if self.rows > 1 else ""
        return f"decode {ctx}, B{self.batch}{mtp}"


@dataclass
class Result:
    case: Case
    us: dict[str, float] = field(default_factory=dict)  # column -> median microseconds
    model: dict[str, float] = field(default_factory=dict)  # bytes / flops, see traffic()
    check: str = ""  # the reference check's outcome
    agreement: dict[str, int] = field(default_factory=dict)  # SGLang vs our selection
    notes: list[str] = field(default_factory=list)  # why a column is missing
    done: bool = False  # measured to the end (a resumed run skips it)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Result":
        return cls(Case(**d["case"]), d.get("us", {}), d.get("model", {}), d.get("check", ""),
                   d.get("agreement", {}), d.get("notes", []), d.get("done", False))


# The targets (issue 12): per configuration, a bound in us or "no slower than dense".
TARGETS: dict[str, float | str] = {
    Case("decode", 8192, 1, 1).key: "dense",
    Case("decode", 131072, 4, 1).key: 20.0,
    Case("decode", 131072, 64, 1).key: 200.0,
    Case("decode", 1 << 20, 4, 1).key: 80.0,
    Case("decode", 1 << 20, 4, 4).key: 150.0,
    Case("prefill", 16384, 1, 16384).key: "dense",
    Case("prefill", 131072, 1, 16384).key: 8000.0,
    Case("prefill", 1 << 20, 1, 16384).key: 40000.0,
}

# Column names, in table order. "whole step" is all of a layer's launches (prepare, select,
# attention) captured in one CUDA graph and timed as one replay; "select+expand" is selection
# writing the packed rows (the expansion is fused into the top-k's writer).
OPS = ["prepare", "select+expand", "attention"]
WHOLE, NO_PREP = "whole step", "qsa (no prepare)"
WHOLE_WARM = "whole step, warm L2"  # the same graph replayed back to back (the "now" method)
WHOLE_CLEAN = "whole step, clean L2"  # after a 256 MB read instead of a write: no dirty lines to write back
DENSE = "flashinfer dense"
SGL_INDEXER, SGL_ATTN, SGL_ALL = "sglang indexer", "sglang attention", "sglang (all)"


def traffic(case: Case, g: Geometry, kv_tokens: float, scored_groups: float, selected_tokens: float) -> dict:
    """The byte/FLOP model of one step (compulsory traffic, each byte once):

    - prepare: reads index_qk [T,(Hi+1)Di], q_gate [T,Hq,2D], k, v [T,Hkv,D]; writes q_idx
      [T,Hi,Di] (index dtype), q [T,Hq,D], the K/V cache rows, the ring rows and T/r compressed keys;
    - selection: reads every request's compressed keys once (context/r x Di, index dtype) and
      writes the selection [T, W+1] int32;
    - attention: reads q and gate, the K/V of the distinct tokens the request's rows select
      (`kv_tokens`, summed over requests), writes out [T,Hq,D].
    FLOPs: scoring 2*Hi*Di per (row, visible group) (`scored_groups`, summed over rows), attention
    4*Hq*D per (row, selected token) (`selected_tokens`). Dense: K/V of the whole context per
    request, q and out; 4*Hq*D per (row, visible token).
    """
    T, e = case.batch * case.rows, 2
    ei = 1 if case.index_dtype.startswith("fp8") else 2
    Hq, Hkv, D, Hi, Di, r = g.num_heads, g.num_kv_heads, g.head_dim, g.index_n_heads, g.index_head_dim, g.compress_ratio
    kv_row = Hkv * D * e * 2  # K and V of one token
    prepare = T * ((Hi + 1) * Di * e + Hq * 2 * D * e + 2 * Hkv * D * e) + T * (Hi * Di * ei + Hq * D * e + kv_row + Di * e) \
        + T / r * Di * ei
    select = case.batch * (case.context // r) * Di * ei + T * (g.selection_width + 1) * 4
    attention = T * Hq * D * e * 3 + kv_tokens * kv_row
    flops = 2 * Hi * Di * scored_groups + 4 * Hq * D * selected_tokens
    visible = sum(case.context - case.rows + 1 + j for j in range(case.rows)) * case.batch
    return {
        "bytes": prepare + select + attention,
        "bytes_no_prepare": select + attention,
        "flops": flops,
        "dense_bytes": case.batch * case.context * kv_row + T * Hq * D * e * 2,
        "dense_flops": 4 * Hq * D * visible,
        "kv_tokens": kv_tokens,
        "scored_groups": scored_groups,
        "selected_tokens": selected_tokens,
    }


def floor_us(nbytes: float, flops: float) -> float:
    return max(nbytes / PEAK_BYTES_PER_S, flops / PEAK_FLOPS) * 1e6


def held(r: Result) -> tuple[str, str]:
    """(target text, held?) of a configuration the issue names (an fp8 row takes its bf16
    twin's target), else ("", "")."""
    c = r.case
    tgt = TARGETS.get(Case(c.kind, c.context, c.batch, c.rows).key)
    if tgt is None:
        return "", ""
    got = r.us.get(WHOLE)
    if tgt == "dense":
        dense = r.us.get(DENSE)
        ok = "?" if got is None or dense is None else ("yes" if got <= dense else "no")
        return "<= dense", ok
    return f"<= {tgt:g}", "?" if got is None else ("yes" if got <= tgt else "no")


def _fmt(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def table(results: list[Result]) -> str:
    """The full table (BENCHMARKS.md), us per layer."""
    head = ["case", "index", "prepare", "select+expand", "attention", "sum of ops", WHOLE, WHOLE_CLEAN, WHOLE_WARM,
            NO_PREP, DENSE, SGL_INDEXER, SGL_ATTN, SGL_ALL, "target", "held?", "floor", "GB/s (% of 4.3 TB/s)",
            "TFLOP/s (% of 790)", "sglang agrees"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        us, m = r.us, r.model
        ops_sum = sum(us[c] for c in ("prepare", "select+expand", "attention")) if all(
            c in us for c in ("prepare", "select+expand", "attention")) else None
        tgt, ok = held(r)
        whole = us.get(WHOLE)
        if whole and m:
            gbs = m["bytes"] / (whole * 1e-6) / 1e9
            tfs = m["flops"] / (whole * 1e-6) / 1e12
            bw = f"{gbs:.0f} ({100 * gbs * 1e9 / PEAK_BYTES_PER_S:.0f} %)"
            fl = f"{tfs:.1f} ({100 * tfs * 1e12 / PEAK_FLOPS:.0f} %)"
        else:
            bw = fl = "-"
        flo = _fmt(floor_us(m["bytes"], m["flops"])) if m else "-"
        a = r.agreement
        agree = f"{a['agree']}/{a['gapped']}" if a.get("gapped") else "-"
        cells = [r.case.label, r.case.index_dtype, *(_fmt(us.get(c)) for c in OPS), _fmt(ops_sum), _fmt(whole),
                 *(_fmt(us.get(c)) for c in (WHOLE_CLEAN, WHOLE_WARM, NO_PREP, DENSE, SGL_INDEXER, SGL_ATTN, SGL_ALL)),
                 tgt, ok, flo, bw, fl, agree]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def short_table(results: list[Result]) -> str:
    """The README's table: the issue's target rows and the fp8 rows."""
    head = ["case", "QSA whole step", "QSA without prepare", "dense FlashInfer", "SGLang QSA (no prepare)", "target",
            "held?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if not held(r)[0]:
            continue
        tgt, ok = held(r)
        label = r.case.label + (f" ({r.case.index_dtype})" if r.case.index_dtype != "bf16" else "")
        lines.append("| " + " | ".join([label, _fmt(r.us.get(WHOLE)), _fmt(r.us.get(NO_PREP)), _fmt(r.us.get(DENSE)),
                                        _fmt(r.us.get(SGL_ALL)), tgt or "-", ok or "-"]) + " |")
    return "\n".join(lines)


def targets(results: list[Result]) -> str:
    """One line per target row: the verdict, the floor, and the op that takes the most time."""
    out = []
    for r in results:
        tgt, ok = held(r)
        if not tgt or WHOLE not in r.us:
            continue
        line = f"- {r.case.label} ({r.case.index_dtype}): whole step {_fmt(r.us[WHOLE])} us, target {tgt}"
        if DENSE in r.us:
            line += f" (dense {_fmt(r.us[DENSE])} us)"
        line += f": {'held' if ok == 'yes' else 'not held' if ok == 'no' else 'no verdict'}"
        if r.model:
            m = r.model
            line += (f"; floor {_fmt(floor_us(m['bytes'], m['flops']))} us ({m['bytes'] / 1e6:.0f} MB, "
                     f"{m['flops'] / 1e9:.0f} GFLOP)")
        parts = {c: r.us[c] for c in ("prepare", "select+expand", "attention") if c in r.us}
        if parts:
            top = max(parts, key=parts.get)
            line += f"; the largest part is {top}: {_fmt(parts[top])} of {_fmt(sum(parts.values()))} us"
        out.append(line)
    return "\n".join(out)


def notes(results: list[Result]) -> str:
    """Per-row check outcomes and the reasons for missing columns."""
    out = []
    for r in results:
        extra = "; ".join(r.notes)
        a = r.agreement
        agree = (f"; SGLang's selection equals ours in {a['agree']} of {a['gapped']} rows whose reference scores "
                 f"have a gap at the boundary ({a['rows']} rows compared); in all {a.get('all_rows', '?')} rows, "
                 f"ties included: {a.get('all_agree', '?')} equal") if a.get("rows") else ""
        out.append(f"- {r.case.label} ({r.case.index_dtype}): {r.check}{agree}" + (f"; {extra}" if extra else ""))
    return "\n".join(out)


def replace_section(path: Path, body: str) -> None:
    """Rewrite the text between the bench markers of path (the markers must exist)."""
    text = path.read_text()
    if MARK_START not in text or MARK_END not in text:
        raise ValueError(f"{path}: no '{MARK_START}' ... '{MARK_END}' markers to replace between")
    head, rest = text.split(MARK_START, 1)
    _, tail = rest.split(MARK_END, 1)
    path.write_text(f"{head}{MARK_START}\n{body}\n{MARK_END}{tail}")


def load(path: Path) -> tuple[dict, list[Result]]:
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        return data.get("meta", {}), []
    return data.get("meta", {}), [Result.from_json(d) for d in data["results"]]


def save(path: Path, meta: dict, results: list[Result]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"schema": SCHEMA, "meta": meta, "results": [r.to_json() for r in results]}, indent=1))
    tmp.replace(path)


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (kind, batch) in zip(axes, [("decode", 4), ("prefill", 1)]):
        rows = 1 if kind == "decode" else 16384
        sel = sorted((r for r in results if r.case.kind == kind and r.case.batch == batch and r.case.index_dtype == "bf16"
                      and r.case.rows == rows), key=lambda r: r.case.context)
        for name in (WHOLE, NO_PREP, DENSE, SGL_ALL):
            pts = [(r.case.context, r.us[name]) for r in sel if name in r.us]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        floors = [(r.case.context, floor_us(r.model["bytes"], r.model["flops"])) for r in sel if r.model]
        if floors:
            ax.plot(*zip(*floors), linestyle="--", marker=".", color="gray", label="floor (4.3 TB/s, 790 TFLOP/s)")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="us per layer",
               title=f"{kind}, batch {batch}" + (", 1 row/request" if kind == "decode" else ", 16K-row chunk"))
        ax.grid(True, which="both", alpha=0.3)
        if sel:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not in this run", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(out: Path, results: list[Result], meta: dict, *, markdown: Path | None = None,
           readme: Path | None = None, with_plot: bool = True) -> str:
    """Write out/table.md (and out/latency.png); rewrite the bench sections of the given files."""
    md = table(results)
    head = (f"Run: {meta.get('when', '?')} on {meta.get('device', '?')}, {meta.get('versions', '')}. "
            f"Times in us per layer, medians of {meta.get('method', 'CUDA-graph replays')}.")
    full = f"{head}\n\n{md}\n\nTargets:\n{targets(results)}\n\nChecks:\n{notes(results)}\n"
    (out / "table.md").write_text(full)
    if with_plot:
        plot(results, out / "latency.png")
    if markdown is not None:
        replace_section(markdown, full.rstrip())
    if readme is not None:
        replace_section(readme, f"{head}\n\n{short_table(results)}")
    return full


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_qsa.py report",
                                 description="Re-render a bench_qsa.py run (DIR/results.json) on any machine.")
    ap.add_argument("dir", type=Path, help="the folder bench_qsa.py --out wrote")
    ap.add_argument("--markdown", type=Path, help="rewrite this file's bench section (BENCHMARKS.md)")
    ap.add_argument("--readme", type=Path, help="rewrite this file's bench section (README.md, short table)")
    ap.add_argument("--no-plot", action="store_true", help="skip latency.png (needs matplotlib)")
    args = ap.parse_args(argv)
    meta, results = load(args.dir / "results.json")
    if not results:
        ap.error(f"{args.dir / 'results.json'}: no results of schema {SCHEMA}")
    print(render(args.dir, results, meta, markdown=args.markdown, readme=args.readme, with_plot=not args.no_plot))
