"""Where a loop's metadata host time goes: its parts, the collector's share, and the same
step measured alone in the same process.

``decode_bench.py`` uses these for the families whose runner reports
``host_parts_ns`` (begin, producers, publish, finish, first consumers: the parts
``decode_runner.runner.HOST_PARTS`` names) and can run a step's metadata by itself
(``Loop.isolated``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np


class GcClock:
    """Host ns spent inside the garbage collector while installed (``gc.callbacks``), and
    how many collections ran: read the running totals before and after a step."""

    def __init__(self) -> None:
        self.ns = 0
        self.collections = 0
        self._start = 0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.ns += time.perf_counter_ns() - self._start
            self.collections += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def summarise(names: tuple[str, ...], parts: list[list[int]], gc_ns: list[int],
              gc_runs: list[int], isolated: list[float], isolated_parts: list[list[int]]
              ) -> dict[str, Any]:
    """The row fields: each part's p50 in the loop and alone (µs), the collector's mean µs
    and collections per step in the loop, the isolated step's p50 and spread."""
    out: dict[str, Any] = {}
    if parts:
        a = np.asarray(parts, dtype=np.float64) / 1e3
        out["parts_us_p50"] = dict(zip(names, np.median(a, axis=0).tolist(), strict=True))
    if gc_ns:
        out["gc_us_per_step"] = float(np.mean(gc_ns)) / 1e3
        out["gc_collections_per_step"] = float(np.mean(gc_runs))
    if isolated:
        out["isolated_us_p50"] = float(np.median(isolated))
        if isolated_parts:
            a = np.asarray(isolated_parts, dtype=np.float64) / 1e3
            out["isolated_parts_us_p50"] = dict(
                zip(names, np.median(a, axis=0).tolist(), strict=True))
    return out


def parts_table(rows: list[dict[str, Any]], names: tuple[str, ...]) -> list[str]:
    """The by-part table of the rows that carry parts: in the loop against the same step
    alone in the same process (``loop / alone``), each part's p50 in the loop (alone in
    brackets), and the collector's µs and collections per step in the loop."""
    rows = [r for r in rows if "parts_us_p50" in r]
    if not rows:
        return []
    head = " | ".join(f"{n} µs" for n in names)
    lines = [f"| bs | way | in loop µs | alone µs | loop / alone | {head} | gc µs (runs) |",
             "|---:|---|---:|---:|---:|" + "---:|" * len(names) + "---:|"]
    for r in rows:
        alone = r.get("isolated_us_p50")
        ratio = f"{r['host_us_p50'] / alone:.2f}x" if alone else "-"
        iso = r.get("isolated_parts_us_p50", {})
        cells = " | ".join(
            f"{r['parts_us_p50'][n]:.1f}" + (f" [{iso[n]:.1f}]" if n in iso else "")
            for n in names)
        gcs = (f"{r['gc_us_per_step']:.1f} ({r['gc_collections_per_step']:.2f})"
               if "gc_us_per_step" in r else "-")
        lines.append(f"| {r['bs']} | {r['way']} | {r['host_us_p50']:.1f} | "
                     f"{alone:.1f} | {ratio} | {cells} | {gcs} |" if alone else
                     f"| {r['bs']} | {r['way']} | {r['host_us_p50']:.1f} | - | - | "
                     f"{cells} | {gcs} |")
    return lines
