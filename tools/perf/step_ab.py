"""Two source trees stepped in one process: a same-run A/B of the packed decode step.

Host speed on the lent machines drifts by up to 2x between processes (see the calibration
loop of ``step_segments.py``), so two revisions timed in separate runs cannot be compared.
This script loads the packages of ``--base`` (another checkout, e.g. ``git worktree add
/tmp/base HEAD~3``) and of this tree into the same process, each with its own modules and
compiled helpers, and steps them alternately on equal batches: drift reaches both alike.

Each tree keeps its modules in its own table; before a tree steps, its table is put back
into ``sys.modules`` (outside the timed region), so imports made inside functions resolve
to the same tree.

    python tools/perf/step_ab.py --base /tmp/base [--bs 64] [--context 4096 131072]
        [--steps 2000] [--slots 2] [--device cuda|cpu]

Prints host µs medians per tree: begin (less any blocking wait), prepare (the fused
producer), publish, finish and their total, and the ratio new / base.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from repo_paths import ROOT, source_paths

TOP_LEVEL = ("block_tables", "h2d_kernels", "h2d_core", "h2d_runner_adapters", "decode_runner")
SEGMENTS = ("begin", "prepare", "publish", "finish", "total")


def _ours(name: str) -> bool:
    return name.split(".", 1)[0] in TOP_LEVEL


class Tree:
    """One source tree's modules, loaded once per process: a second load of the same
    compiled helpers would share their C state with the first."""

    def __init__(self, label: str, root: Path) -> None:
        self.label = label
        self.paths = source_paths(root)
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        self.modules: dict[str, ModuleType] = {}
        with self.active():
            self.core = importlib.import_module("h2d_core")
            self.adapters = importlib.import_module("h2d_runner_adapters")
            self.scheduler = importlib.import_module("decode_runner.scheduler")

    @contextmanager
    def active(self) -> Iterator[None]:
        """This tree's modules in ``sys.modules`` and its sources first on ``sys.path``
        (a module imported for the first time inside comes from this tree, and is kept)."""
        saved = sys.path[:]
        sys.path[:0] = self.paths
        sys.modules.update(self.modules)
        try:
            yield
        finally:
            sys.path[:] = saved
            self.modules.update((n, m) for n, m in sys.modules.items() if _ours(n))


class Variant:
    """One tree's state and fused decode step for one context length."""

    def __init__(self, tree: Tree, args: argparse.Namespace, context: int) -> None:
        self.tree = tree
        page, window = 16, 256
        per_row = -(-(context + page - 1 + window) // page)
        with tree.active():
            self.state = tree.core.H2DRunnerState(args.device, backend="packed",
                                                  num_slots=args.slots)
            self.step = tree.adapters.DecodeStepInputs(
                self.state, max_reqs=args.bs, max_tokens=args.bs,
                max_pages_per_req=per_row, page_size=page)
            self.state.bind()
            gen = tree.scheduler.steady_decode_batches(args.bs, context, page, window=window)
            self.batches = [next(gen) for _ in range(args.steps + args.warmup)]
            for b in self.batches:
                b.columns, b.block_tables  # noqa: B018  (built outside the timed region)
            for b in self.batches[: args.warmup]:  # lazy imports and first-use binding
                self.one(b)
        self.times: dict[str, list[int]] = {k: [] for k in SEGMENTS}

    def one(self, batch: Any, record: bool = False) -> None:
        pc = time.perf_counter_ns
        st = self.state
        t0 = pc()
        st.begin()
        t1 = pc()
        self.step.prepare(batch)
        t2 = pc()
        st.publish("decode_step")
        t3 = pc()
        st.finish()
        t4 = pc()
        if record:
            wait = st.last_source_wait_ns
            for k, v in zip(SEGMENTS, (t1 - t0 - wait, t2 - t1, t3 - t2, t4 - t3,
                                       t4 - t0 - wait), strict=True):
                self.times[k].append(v)

    def medians(self) -> dict[str, float]:
        return {k: float(np.median(v)) / 1e3 for k, v in self.times.items()}


def run(trees: list[Tree], args: argparse.Namespace, context: int) -> list[dict[str, float]]:
    variants = [Variant(t, args, context) for t in trees]
    for k in range(args.warmup, args.warmup + args.steps):
        for v in (variants if k % 2 else variants[::-1]):
            sys.modules.update(v.tree.modules)
            v.one(v.batches[k], record=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    return [v.medians() for v in variants]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True,
                    help="another checkout (its packages/ and tests-integration/)")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 131072])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    args = ap.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    trees = [Tree("base", args.base.resolve()), Tree("new", ROOT)]
    print(f"host µs (median of {args.steps} steps, trees stepped alternately) | "
          + " | ".join(SEGMENTS))
    for context in args.context:
        base, new = run(trees, args, context)
        for label, m in (("base", base), ("new", new)):
            print(f"{args.device} bs={args.bs} ctx={context} slots={args.slots} {label:4s} | "
                  + " | ".join(f"{m[k]:.2f}" for k in SEGMENTS))
        print(f"{'':>32s} new/base | "
              + " | ".join(f"{new[k] / base[k]:.2f}" for k in SEGMENTS))

if __name__ == "__main__":
    main()
