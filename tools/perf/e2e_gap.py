"""Why the metadata path costs more inside the full decode step than alone (investigation).

One runner per batch size (the main job's configuration: CUDA graphs, two slots, steady
decode batches), four ways of stepping it, interleaved in chunks in one process. Each
reports the host µs of ``begin()`` .. ``finish()`` (less the source-reuse wait), as the
main job does:

* ``full``: ``runner.step`` as the main job runs it (publication, first consumers, graph
  replay, sampler), back to back;
* ``synced``: the same, with ``torch.cuda.synchronize()`` before each step (the GPU idle
  while the host prepares: no concurrent GPU work, no queued launches);
* ``alone``: only the metadata path on the same runner, buffers and tables (begin,
  prepare, publish, finish), back to back: the isolated figure;
* ``alone+torch``: ``alone``, with 64 small CPU torch ops between steps (a stand-in for the
  rest of the step's host work, without any GPU work); ``alone+python``: a pure-Python
  loop of similar length instead;
* ``...,no-gc``: the same with Python's cyclic garbage collector disabled.

    python3 tools/perf/e2e_gap.py [--batch-sizes 1,64] [--rounds 6] [--chunk 50]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from repo_paths import use_sources  # noqa: E402

use_sources()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from decode_bench import mha_batches, mha_config  # noqa: E402
from decode_runner.runner import DECODE_STEP, DecodeRunner  # noqa: E402


def measure(bs: int, args: argparse.Namespace, junk: list[torch.Tensor]) -> dict[str, float]:
    runner = DecodeRunner(mha_config(bs, args.context, True), "cuda", "packed")
    gen = mha_batches(bs, args.context)  # built here, before any timed step
    batches = iter([next(gen) for _ in range(20 + 7 * args.rounds * args.chunk + 10)])
    for _ in range(20):
        runner.step(next(batches))
    torch.cuda.synchronize()
    st, step, pc = runner.state, runner.decode_step, time.perf_counter_ns
    seg: dict[str, list[tuple[int, int, int, int]]] = {"": [], "torch": [], "python": []}

    def alone(touch: str) -> float:
        out = []
        for _ in range(args.chunk):
            b = next(batches)
            if touch == "torch":
                acc = junk[0]
                for t in junk:
                    acc = acc + t * 0.5
            elif touch == "python":  # the same time in pure Python: no torch calls
                x = 0
                for i in range(3000):
                    x += i * i
            t0 = pc()
            st.begin()
            t1 = pc()
            step.prepare(b, b.padded_size)
            t2 = pc()
            st.publish(DECODE_STEP)
            t3 = pc()
            st.finish()
            t4 = pc()
            out.append((t4 - t0 - st.last_source_wait_ns) / 1e3)
            seg[touch].append((t1 - t0 - st.last_source_wait_ns, t2 - t1, t3 - t2, t4 - t3))
        return float(np.median(out))

    def full(synced: bool) -> float:
        out = []
        for _ in range(args.chunk):
            if synced:
                torch.cuda.synchronize()
            runner.step(next(batches))
            out.append(runner.host_metadata_ns / 1e3)
        return float(np.median(out))

    def no_gc(fn: Callable[[], float]) -> float:
        gc.disable()
        try:
            return fn()
        finally:
            gc.enable()

    ways = {"full": lambda: full(False), "synced": lambda: full(True),
            "full,no-gc": lambda: no_gc(lambda: full(False)),
            "alone": lambda: alone(""), "alone+torch": lambda: alone("torch"),
            "alone+torch,no-gc": lambda: no_gc(lambda: alone("torch")),
            "alone+python": lambda: alone("python")}
    med: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            med[name].append(ways[name]())
            torch.cuda.synchronize()
    for touch, rows in seg.items():
        parts = np.median(np.asarray(rows, dtype=np.float64), axis=0) / 1e3
        print(f"bs={bs} alone+{touch or 'nothing'}: begin {parts[0]:.1f}, prepare "
              f"{parts[1]:.1f}, publish {parts[2]:.1f}, finish {parts[3]:.1f} µs", flush=True)
    return {k: float(np.median(v)) for k, v in med.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    junk = [torch.randn(64) for _ in range(32)]
    for bs in (int(x) for x in args.batch_sizes.split(",")):
        med = measure(bs, args, junk)
        line = ", ".join(f"{k} {v:.1f}" for k, v in med.items())
        print(f"bs={bs}: host µs begin..finish (median of {args.rounds} chunk medians): "
              f"{line}", flush=True)


if __name__ == "__main__":
    main()
