"""CPU cost of PageTableSnapshot.prepare against the naive per-step rebuild.

    python3 packages/block-tables/benchmarks/bench_prepare.py [--json PATH] [--quick]

For batch sizes 1, 64, 256 and 1024 over [max(1024, bs), 8192] int32 storage (128K context
at page size 16), it times one ``prepare`` per step (median over many steps, after
warm-up) for: a hit (nothing changed); a one-page append on every row; a one-page append
on 1/16 of the rows (steady decode at page size 16; at least one row); a reorder of the
whole batch; a full replacement by other rows. The baseline, timed in the same run, is
the rebuild engines do today: clear each row at full width, then copy its Python list in.
Only ``prepare`` is timed; the appends that make each step differ happen outside the
timed region. Row lengths are drawn uniformly from [64, 2048] pages (1K-32K tokens),
seed 0; a hit also runs at widths 512 and 65536 to show it does not depend on the width.
numpy only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    from block_tables import BlockTable, PageTableSnapshot
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from block_tables import BlockTable, PageTableSnapshot

WIDTH = 8192
POOL = 1 << 20
BATCH_SIZES = (1, 64, 256, 1024)
CASES = ("hit", "append_all", "append_1_16", "reorder", "replace", "naive")


def _tables(rng: np.random.Generator, count: int) -> list[BlockTable]:
    lengths = rng.integers(64, 2049, count)
    return [BlockTable(rng.integers(0, POOL, int(n)).astype(np.int32)) for n in lengths]


def _time(
    step: Callable[[], object],
    before: Callable[[int], None] | None,
    *,
    warmup: int,
    reps: int,
    budget_s: float,
) -> tuple[float, int]:
    """Median µs of ``step`` over up to ``reps`` timed calls; ``before(k)`` is untimed."""
    for k in range(warmup):
        if before is not None:
            before(k)
        step()
    samples: list[int] = []
    deadline = time.perf_counter() + budget_s
    for k in range(warmup, warmup + reps):
        if before is not None:
            before(k)
        t0 = time.perf_counter_ns()
        step()
        samples.append(time.perf_counter_ns() - t0)
        if len(samples) >= 15 and time.perf_counter() > deadline:
            break
    return float(np.median(samples)) / 1e3, len(samples)


def _naive_rebuild(storage: np.ndarray, lists: list[list[int]]) -> None:
    for i, ids in enumerate(lists):
        storage[i, :] = 0
        storage[i, : len(ids)] = ids


def _check(snapshot: PageTableSnapshot, rows: list[BlockTable]) -> None:
    expected = np.zeros((len(rows), snapshot.width), dtype=np.int32)
    _naive_rebuild(expected, [r.tolist() for r in rows])
    if not np.array_equal(snapshot.storage[: len(rows)], expected):
        raise SystemExit("benchmark self-check failed: snapshot differs from the naive rebuild")


def bench_batch(bs: int, *, quick: bool) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    reps, budget = (200, 0.3) if quick else (2000, 1.5)
    storage_rows = max(1024, bs)
    results: dict[str, dict[str, float]] = {}

    def run(case: str, step: Callable[[], object], before: Callable[[int], None] | None,
            rows: Callable[[], list[BlockTable]] | None, snap: PageTableSnapshot | None) -> None:
        median, count = _time(step, before, warmup=20, reps=reps, budget_s=budget)
        results[case] = {"us": median, "reps": count}
        if snap is not None and rows is not None:
            _check(snap, rows())

    # Reorder, replacement and the baseline use ``base`` as drawn; the append cases grow
    # copies of it, so every case works on rows of the same length distribution.
    base = _tables(rng, bs)
    others = _tables(rng, bs)
    lists = [t.tolist() for t in base]

    # hit
    rows = [t.copy() for t in base]
    snap = PageTableSnapshot(np.zeros((storage_rows, WIDTH), np.int32), pool_limit=POOL)
    snap.prepare(rows)
    run("hit", lambda: snap.prepare(rows), None, lambda: rows, snap)

    # one-page append on every row / on 1/16 of the rows
    def append_every(k: int) -> None:
        for t in rows:
            t.append_one((k * 7919 + len(t)) % POOL)

    run("append_all", lambda: snap.prepare(rows), append_every, lambda: rows, snap)

    sixteenth = max(1, bs // 16)

    def append_sixteenth(k: int) -> None:
        for j in range(sixteenth):
            t = rows[(k * sixteenth + j) % bs]
            t.append_one((k * 104729 + len(t)) % POOL)

    run("append_1_16", lambda: snap.prepare(rows), append_sixteenth, lambda: rows, snap)

    # reorder: alternate two permutations, so every step moves (almost) every row
    orders = [[base[i] for i in rng.permutation(bs)] for _ in range(2)]
    current: list[list[BlockTable]] = [base]

    def reorder(k: int) -> None:
        current[0] = orders[k % 2]

    run("reorder", lambda: snap.prepare(current[0]), reorder, lambda: current[0], snap)

    # full replacement: alternate two disjoint sets of rows
    def replace(k: int) -> None:
        current[0] = others if k % 2 == 0 else base

    run("replace", lambda: snap.prepare(current[0]), replace, lambda: current[0], snap)

    # baseline: the naive per-step rebuild from Python lists
    naive_storage = np.zeros((storage_rows, WIDTH), np.int32)
    run("naive", lambda: _naive_rebuild(naive_storage, lists), None, None, None)
    return results


def bench_width(quick: bool) -> dict[int, float]:
    """Hit cost at bs=256 for several widths: it must not depend on the width."""
    out: dict[int, float] = {}
    for width in (512, 8192, 65536):
        rng = np.random.default_rng(1)
        rows = [BlockTable(rng.integers(0, POOL, 64).astype(np.int32)) for _ in range(256)]
        snap = PageTableSnapshot(np.zeros((256, width), np.int32), pool_limit=POOL)
        snap.prepare(rows)
        out[width], _ = _time(
            lambda snap=snap, rows=rows: snap.prepare(rows),
            None,
            warmup=20,
            reps=200 if quick else 2000,
            budget_s=1.0,
        )
    return out


def bench_required(quick: bool) -> float:
    """Hit cost at bs=256, width 8192, with the per-step required-page check."""
    rng = np.random.default_rng(2)
    rows = _tables(rng, 256)
    required = np.array([len(t) for t in rows], dtype=np.int64)
    snap = PageTableSnapshot(np.zeros((1024, WIDTH), np.int32), pool_limit=POOL)
    snap.prepare(rows)
    median, _ = _time(
        lambda: snap.prepare(rows, required_pages=required),
        None,
        warmup=20,
        reps=200 if quick else 2000,
        budget_s=1.0,
    )
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke)")
    args = parser.parse_args()

    results = {bs: bench_batch(bs, quick=args.quick) for bs in BATCH_SIZES}
    widths = bench_width(args.quick)
    required = bench_required(args.quick)

    print(f"block-tables prepare, CPU µs per step (median), width {WIDTH}, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    header = ("| bs | hit | append all | append 1/16 | reorder | replace | naive rebuild "
              "| naive/hit | naive/append all |")
    print(header)
    print("|---:" * 9 + "|")
    for bs, r in results.items():
        us = {case: r[case]["us"] for case in CASES}
        reorder = "–" if bs == 1 else f"{us['reorder']:.0f}"  # one row cannot move
        print(
            f"| {bs} | {us['hit']:.1f} | {us['append_all']:.1f} | {us['append_1_16']:.1f} "
            f"| {reorder} | {us['replace']:.0f} | {us['naive']:.0f} "
            f"| {us['naive'] / us['hit']:.0f}x | {us['naive'] / us['append_all']:.0f}x |"
        )
    print()
    print("hit at bs=256 by width: " + ", ".join(f"{w}: {us:.1f} µs" for w, us in widths.items()))
    print(f"hit at bs=256 with required_pages (int64 array): {required:.1f} µs")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "block-tables prepare",
            "unit": "us per prepare (median)",
            "width": WIDTH,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "results": {str(bs): r for bs, r in results.items()},
            "hit_by_width_bs256": {str(w): us for w, us in widths.items()},
            "hit_with_required_pages_bs256": required,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
