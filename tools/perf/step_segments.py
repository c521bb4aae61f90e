"""Where the host time of one packed decode step goes, segment by segment.

Times ``begin``, the fused producer (``DecodeStepInputs.prepare``, with its block-table
``stage`` timed apart), ``publish`` (with the arena's DMA + scatter enqueue, ``launch``,
timed apart) and ``finish`` of the plain-MHA decode step used by
``publication_bench.py decode`` (bs=64, 1/16 of the rows append a page), on CUDA when
available (real DMA and scatter) or on the CPU. Also prints a pure-Python calibration loop,
so figures from hosts of different speed can be compared.

    python tools/perf/step_segments.py [--bs 64] [--context 4096] [--steps 1500] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from repo_paths import use_sources

use_sources()

from h2d_core import H2DRunnerState  # noqa: E402
from h2d_runner_adapters import DecodeStepInputs  # noqa: E402

SEGMENTS = ("begin", "prepare", "stage", "publish", "launch", "finish", "total")


def calibrate(n: int = 200_000) -> float:
    """ns per iteration of a fixed loop of attribute reads, a call and a dict update."""

    class Box:
        __slots__ = ("a", "b")

        def __init__(self) -> None:
            self.a, self.b = 1, 2

    def f(x: int) -> int:
        return x + 1

    box, d = Box(), {}
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter_ns()
        for i in range(n):
            d[i & 7] = f(box.a) + box.b
        best = min(best, (time.perf_counter_ns() - t) / n)
    return best


def use_arena_launcher(st: H2DRunnerState) -> None:
    """The pre-compiled-launcher path: ``PackedArena.publish`` and torch events."""
    for recs in st._slot_groups:
        for rec in recs:
            if rec.packed is not None:
                rec.packed._binding = None  # the Python packing, then the arena's publish
    if st._slot_events is not None:
        st._slot_events = None
        st._events = [torch.cuda.Event() for _ in range(st.num_slots)]


class Variant:
    """One state + fused decode step with its segment timers."""

    def __init__(self, bs: int, per_row: int, page: int, device: str, launcher: str,
                 slots: int = 1) -> None:
        self.st = st = H2DRunnerState(device, backend="packed", num_slots=slots)
        self.step = DecodeStepInputs(st, max_reqs=bs, max_tokens=bs,
                                     max_pages_per_req=per_row, page_size=page)
        st.bind()
        if launcher == "arena":
            use_arena_launcher(st)
        self.compiled = any(rec.packed is not None and rec.packed.launches_graphs
                            for recs in st._slot_groups for rec in recs)
        self.seg: dict[str, list[float]] = {k: [] for k in SEGMENTS}
        self.stage_ns = 0
        self.launch_ns = 0
        tables = self.step.decode.tables
        real_stage = tables.stage

        def timed_stage(n: int) -> str:
            t = time.perf_counter_ns()
            r = real_stage(n)
            self.stage_ns = time.perf_counter_ns() - t
            return r

        tables.stage = timed_stage  # type: ignore[method-assign]
        for recs in st._slot_groups:
            for rec in recs:
                if rec.packed is not None:
                    real_publish = rec.packed.arena.publish

                    def timed_publish(end: int, stream: object, real=real_publish) -> None:
                        t = time.perf_counter_ns()
                        real(end, stream)
                        self.launch_ns = time.perf_counter_ns() - t

                    rec.packed.arena.publish = timed_publish

    def one(self, b: object, record: bool) -> None:
        global _active
        _active = self
        pc = time.perf_counter_ns
        st = self.st
        t0 = pc()
        st.begin()
        t1 = pc()
        self.step.prepare(b)
        t2 = pc()
        st.publish("decode_step")
        t3 = pc()
        st.finish()
        t4 = pc()
        if record:
            wait = st.last_source_wait_ns
            for k, v in zip(SEGMENTS, (t1 - t0 - wait, t2 - t1 - self.stage_ns, self.stage_ns,
                                       t3 - t2 - self.launch_ns, self.launch_ns, t4 - t3,
                                       t4 - t0 - wait), strict=True):
                self.seg[k].append(v / 1e3)


_active: Variant | None = None


def _time_compiled_launches() -> None:
    """Route the compiled pack + graph launch (h2d_kernels' PackedGroup.publish) through a
    timer that charges the variant stepping now."""
    import h2d_kernels.packed_group as state_module

    real_native = state_module._native
    if real_native is None or hasattr(real_native, "_timed"):
        return

    class TimedNative:
        _timed = True

        def __getattr__(self, name: str) -> object:
            return getattr(real_native, name)

        @staticmethod
        def publish_packed(*args: object) -> int:
            t = time.perf_counter_ns()
            end = real_native.publish_packed(*args)
            if _active is not None:
                _active.launch_ns = time.perf_counter_ns() - t
            return end

    state_module._native = TimedNative()  # type: ignore[assignment]


def run(bs: int, context: int, steps: int, device: str,
        launchers: tuple[str, ...] = ("compiled",), batches: str = "prebuilt",
        slots: int = 1) -> list[dict]:
    """Step every launcher variant on the same batches, alternating which goes first, so
    drift of the host (other load, clocks) reaches all of them alike.

    ``batches``: ``prebuilt`` makes every batch before the first step (its objects are
    long out of the caches when stepped, as in publication_bench); ``fresh`` makes each one
    untimed right before its step, as a scheduler hands its output to the runner.

    ``slots``: with one slot, each ``begin`` waits on the DMA its previous step launched a
    few µs earlier (usually still pending, so the query of a pending event is in ``begin``);
    with two, on the step before that, as when a forward pass runs between steps."""
    from decode_runner.scheduler import steady_decode_batches

    page, window = 16, 256
    per_row = -(-(context + page - 1 + window) // page)
    gen = steady_decode_batches(bs, context, page, window=window)

    def make() -> object:
        b = next(gen)
        b.columns, b.block_tables  # noqa: B018  (built outside the timed region)
        return b

    ready = [make() for _ in range(steps + 50)] if batches == "prebuilt" else []
    _time_compiled_launches()
    variants = [Variant(bs, per_row, page, device, lch, slots) for lch in launchers]
    it = iter(ready)
    for k in range(steps + 50):
        b = next(it) if ready else make()
        order = variants if k % 2 else variants[::-1]
        for v in order:
            v.one(b, record=k >= 50)
    if device == "cuda":
        torch.cuda.synchronize()
    return [{"bs": bs, "context": context, "device": device, "native": v.step.native,
             "compiled_launch": v.compiled, "batches": batches, "slots": slots,
             **{k: round(float(np.median(x)), 2) for k, x in v.seg.items()}}
            for v in variants]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 131072])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when available")
    ap.add_argument("--launcher", choices=("compiled", "arena", "both"), default="both",
                    help="compiled pack + cuGraphLaunch and driver events, the arena's "
                    "publish and torch events, or both (stepped alternately on the same "
                    "batches)")
    ap.add_argument("--batches", choices=("prebuilt", "fresh", "both"), default="prebuilt",
                    help="batches made before the run (cold) or right before each step")
    ap.add_argument("--slots", type=int, default=1, help="runner slots (see run())")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cal = calibrate()
    launchers = ("compiled", "arena") if args.launcher == "both" else (args.launcher,)
    kinds = ("prebuilt", "fresh") if args.batches == "both" else (args.batches,)
    rows = [r for c in args.context for kind in kinds
            for r in run(args.bs, c, args.steps, device, launchers, kind, args.slots)]
    print(f"python calibration loop: {cal:.1f} ns/iter  (python {sys.version.split()[0]}, "
          f"numpy {np.__version__}, torch {torch.__version__})")
    print("host µs (median) | " + " | ".join(SEGMENTS))
    for r in rows:
        print(f"{r['device']} bs={r['bs']} ctx={r['context']} native={r['native']} "
              f"compiled_launch={r['compiled_launch']} batches={r['batches']} "
              f"slots={r['slots']} | "
              + " | ".join(f"{r[k]:.2f}" for k in SEGMENTS))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_segments.json").write_text(
            json.dumps({"calibration_ns": cal, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
