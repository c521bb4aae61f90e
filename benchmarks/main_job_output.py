"""The main job's plot and printed tables (``decode_bench.py`` writes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from decode_runner.runner import HOST_PARTS
from host_parts import parts_table
from main_job_loops import DEFAULT_FAMILIES, FAMILIES, WAYS

#: what the plot and the tables compare, and what "better" means
COMPARED = ("packed (this library: one DMA + one scatter per group) against direct (one "
            "copy per member) and atom (an ATOM-style host step), interleaved in one "
            "process; every figure is a time (lower is better), shown as way / packed: "
            "above 1 the way is slower than packed")
#: families whose ATOM-style way runs no consumer kernel (its host builds those arrays) while
#: packed's kernels run interpreted on a CPU: their ratio there measures the interpreter
ATOM_NOT_COMPARABLE_ON_CPU = ("v41", "mtp", "gdn", "deepseek_v4")
CPU_CAVEAT = ("CPU run (Triton interpreter, host-side scatter): it checks that the job runs "
              "and predicts no GPU host; the ATOM-style "
              f"{'/'.join(ATOM_NOT_COMPARABLE_ON_CPU)} ways run no consumer kernels (their "
              "host builds those arrays) while packed's run interpreted: those ratios are "
              "not comparable and are not drawn")
#: what the per-size line printed while the job runs reports, per way
SUMMARY_METRIC = "metadata host µs per step (p50)"


def drawn_ways(family: str, cuda: bool) -> list[str]:
    """The ways drawn as ratios to packed in ``family``'s panels (packed is the line at 1)."""
    return [w for w in WAYS[1:]
            if cuda or not (w == "atom" and family in ATOM_NOT_COMPARABLE_ON_CPU)]


def plot(results: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """One row per family, one panel per figure: each way's value as a ratio to packed's
    on a linear axis (packed = 1), packed's own value under each batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in FAMILIES if any(r["family"] == f for r in results)]
    panels = [("host_us_p50", "host µs per step, metadata", "µs"),
              ("gpu_span_us_p50", "GPU span, publication → model's first kernel", "µs"),
              ("ms_per_output_token", "ms per output token", "ms")]
    if not meta["cuda"]:
        panels = panels[:1] + panels[2:]
    fig, axes = plt.subplots(len(families), len(panels), squeeze=False,
                             figsize=(5 * len(panels), 3.3 * len(families)))
    colors = {"direct": "tab:orange", "atom": "tab:gray"}
    for i, fam in enumerate(families):
        rows = [r for r in results if r["family"] == fam]
        sizes = sorted({r["bs"] for r in rows})
        x = np.arange(len(sizes))
        packed = {r["bs"]: r for r in rows if r["way"] == "packed"}
        ways = drawn_ways(fam, meta["cuda"])
        for j, (key, title, unit) in enumerate(panels):
            ax = axes[i][j]
            top = 1.0
            for k, w in enumerate(ways):
                by = {r["bs"]: r for r in rows if r["way"] == w}
                ratio = [by[s][key] / packed[s][key] for s in sizes]
                top = max(top, *ratio)
                width = 0.76 / len(ways)
                bars = ax.bar(x + (k - (len(ways) - 1) / 2) * width, ratio, width,
                              color=colors[w], label=w)
                ax.bar_label(bars, [f"{v:.2f}x" if v < 10 else f"{v:.0f}x" for v in ratio],
                             fontsize=6)
            ax.axhline(1.0, color="tab:blue", lw=1.2, label="packed = 1")
            ax.set_xticks(x, [f"{s}\n{packed[s][key]:.3g} {unit}" for s in sizes], fontsize=7)
            ax.set_xlabel("batch size (requests); packed's own value below it", fontsize=7)
            ax.set_ylabel("way / packed (> 1: slower than packed)", fontsize=7)
            ax.set_ylim(0, top * 1.3)  # headroom: the bar labels stay inside the panel
            ax.set_title(f"{fam}: {title}", fontsize=9)
            if len(ways) < len(WAYS) - 1:
                ax.text(0.99, 0.97, "atom: not comparable on CPU", transform=ax.transAxes,
                        ha="right", va="top", fontsize=6, color="tab:gray")
    # one legend for the figure, outside every panel: it never covers a bar
    handles = {label: h for ax in axes.flat
               for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles),
               fontsize=7, frameon=False)
    caveat = "" if meta["cuda"] else "\n" + CPU_CAVEAT
    fig.suptitle(f"main job, {meta['device']}, {meta['date']}: {COMPARED}{caveat}",
                 fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)


def table(results: list[dict[str, Any]], cuda: bool) -> str:
    lines = [f"Compared: {COMPARED}." + ("" if cuda else f" {CPU_CAVEAT}.")]
    for fam in DEFAULT_FAMILIES:
        rows = [r for r in results if r["family"] == fam]
        if not rows:
            continue
        lines.append(f"\n{fam}: host µs p50 [chunk medians' min-max] (x = way / packed), GPU "
                     "span µs p50, H2D + kernels per step (profiler, by copy kind), ms per "
                     "output token")
        lines.append("| bs | way | host µs | GPU span µs | H2D + kernels | ms/token |")
        lines.append("|---:|---|---:|---:|---|---:|")
        for r in rows:
            span = f"{r['gpu_span_us_p50']:.1f}" if "gpu_span_us_p50" in r else "-"
            counts = (f"{r['h2d_per_step']:.0f} + {r['kernels_per_step']:.0f}"
                      if "h2d_per_step" in r else "-")
            lines.append(
                f"| {r['bs']} | {r['way']} | {r['host_us_p50']:.1f} "
                f"[{r['host_us_chunk_min']:.1f}-{r['host_us_chunk_max']:.1f}] "
                f"({r['host_vs_packed']:.1f}x) | {span} | {counts} | "
                f"{r['ms_per_output_token']:.3f} ({r['tpot_vs_packed']:.2f}x) |")
    return "\n".join(lines)


def parts_tables(results: list[dict[str, Any]]) -> str:
    """Per family whose runner reports them: the metadata by part in the loop, against the
    same step alone (no model) measured in the same process just before each chunk."""
    lines = []
    for fam in FAMILIES:
        table_lines = parts_table([r for r in results if r["family"] == fam], HOST_PARTS)
        if table_lines:
            lines += [f"\n{fam}: metadata host µs p50 by part, in the loop [alone]; "
                      "'alone': the same runner's next steps' metadata without the model, "
                      "just before each chunk; gc: the collector's µs and runs per step in "
                      "the loop", *table_lines]
    return "\n".join(lines)
