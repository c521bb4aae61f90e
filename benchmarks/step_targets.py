"""The plain-MHA decode step's host time against its targets and the peers, in one process.

The step: sampling + token inputs + MHA decode metadata as one combined group
(``DecodeStepInputs``), 128K-token context rows, 1/16 of the rows append a page each step,
two slots. Host µs from ``begin()`` until the first consumers (token assembly, KV-index
generation) are enqueued, then ``finish()`` (less any blocking wait for source reuse),
median per chunk of steps, for these ways of doing the same step (each through its first
consumers: MRV2's timed step builds its ids too):

* ``packed``: this library, one DMA + one scatter per step (checked from its counters), with
  token assembly and KV-index generation fused into the publication (``fuse_token_assembly``,
  ``fuse_kv_indices``: inside its CUDA graph, the counts read from the arena header), so the
  consumer calls launch nothing;
* ``packed-eager``: the same without the fusion: ``generate_kv_indices`` launches the Triton
  kernel after ``publish`` (Triton's launcher, every step);
* ``direct``: this library with ``backend="direct"`` (one copy per member, the consumer
  launched after them);
* ``atom``: the shared ATOM-style step (``peers/atom_style.py`` through
  ``decode_runner/atom_style.py``) over the same batches, into the same destinations (a
  ``DecodeStepInputs`` it only borrows them from): the engine's full-width per-row
  block-table rebuild from the scheduler's Python page lists (their upkeep outside the
  timed step), one copy per field, then the same consumer launched; less its wait for a
  free pinned source set;
* ``mrv2``: ``peers/mrv2_style.py``, our re-creation of vLLM Model Runner V2's mechanism
  (GPU-resident request state, 2 H2D, staged block-table diffs and sampling snapshots read
  by Triton kernels through UVA) over rows of the same width, one page appended per row
  every 16 steps; its host timing leaves out its ring-slot wait, as the others' do;
* ``packed``, by part (after the interleaved rounds): ``begin``, ``prepare``, ``publish``
  (with the fused consumer) and ``finish`` timed apart; begin + publish + finish is the
  launch floor (event query, packing, graph launch, event record);
* ``packed+ctx``: ``packed`` run under ``torch.set_default_device("cpu")`` (a
  ``DeviceContext`` on the mode stack, as an engine that restores ``"cpu"`` instead of
  ``None`` after GPU initialization): what that default costs per step.

The GPU host's speed drifts between processes (up to 2x), so the ways run in one process,
interleaved in chunks (``--rounds`` rounds of ``--chunk`` steps each), and the table reports
the median of the chunk medians, their extremes (the spread) and each peer's ratio to
``packed``. Every way runs on CPU too (Triton's interpreter): that checks the benchmark
runs; its figures predict no GPU host.

    python benchmarks/step_targets.py [--batch-sizes 1,8,64,256] [--rounds 8] [--chunk 200]
        [--context 131072] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from repo_paths import ROOT, use_sources

use_sources()

from decode_runner.atom_style import AtomStyleDecode  # noqa: E402
from decode_runner.scheduler import steady_decode_batches  # noqa: E402
from peers.mrv2_style import Mrv2StyleStep  # noqa: E402

from h2d_core import H2DRunnerState  # noqa: E402
from h2d_runner_adapters import DecodeStepInputs, StepShape  # noqa: E402

PAGE = 16
WINDOW = 512
#: the targets (host µs: at most 10 at bs 1-64, 16 at bs 256)
TARGETS = {1: 10.0, 8: 10.0, 64: 10.0, 256: 16.0}


class LibraryStep:
    """The library's fused decode step on one backend, stepped ``chunk`` steps at a time."""

    def __init__(self, backend: str, bs: int, context: int, device: str, warmup: int,
                 fuse: bool = False) -> None:
        per_row = -(-(context + PAGE - 1 + WINDOW) // PAGE)
        self.state = H2DRunnerState(device, backend=backend, num_slots=2)
        #: the engine's persistent buffer of the previous step's sampled tokens, which token
        #: assembly reads for the deferred ids
        self.prev = torch.zeros(bs, 1, dtype=torch.int32, device=device)
        self.step = DecodeStepInputs(self.state,
                                     StepShape(max_reqs=bs, max_tokens=bs,
                                               max_pages_per_req=per_row, page_size=PAGE),
                                     fuse_kv_indices=fuse,
                                     fuse_token_assembly=self.prev if fuse else None)
        self.state.bind()
        fused = (self.step.decode.kv_indices_consumer, self.step.tokens.assembly_consumer)
        if fuse and not all(c is not None and c.fused for c in fused):
            raise RuntimeError(f"{backend}: KV-index generation or token assembly was not fused")
        self.batches = steady_decode_batches(bs, context, PAGE, window=WINDOW)
        self.run(warmup)

    def run(self, steps: int) -> float:
        """Step ``steps`` batches (built before the timed region); the median host µs."""
        batches = [next(self.batches) for _ in range(steps)]
        for b in batches:
            b.columns, b.block_tables  # noqa: B018
        st, prepare, pc = self.state, self.step.prepare, time.perf_counter_ns
        consume, assemble, prev = (self.step.decode.generate_kv_indices,
                                   self.step.tokens.assemble, self.prev)
        times = []
        for b in batches:
            t0 = pc()
            st.begin()
            plan = prepare(b)
            st.publish("decode_step")
            assemble(plan.tokens, prev)  # the first consumers (fused: already enqueued)
            consume(plan.decode)
            st.finish()
            times.append(pc() - t0 - st.last_source_wait_ns)
        return float(np.median(times)) / 1e3

    def parts(self, steps: int) -> dict[str, float]:
        """The same step timed part by part (median host µs of each): ``begin`` (the slot
        event's query), ``prepare`` (the producer: checks, writes, counts, table stage),
        ``publish`` (header, packing and the graph launch of DMA + scatter + the fused
        consumer) and ``finish`` (the event record). begin + publish + finish is the launch
        floor: the driver calls every way of publishing pays."""
        batches = [next(self.batches) for _ in range(steps)]
        for b in batches:
            b.columns, b.block_tables  # noqa: B018
        st, prepare, pc = self.state, self.step.prepare, time.perf_counter_ns
        consume, assemble, prev = (self.step.decode.generate_kv_indices,
                                   self.step.tokens.assemble, self.prev)
        times = np.zeros((steps, 4), dtype=np.int64)
        for i, b in enumerate(batches):
            t0 = pc()
            st.begin()
            t1 = pc()
            plan = prepare(b)
            t2 = pc()
            st.publish("decode_step")
            assemble(plan.tokens, prev)
            consume(plan.decode)
            t3 = pc()
            st.finish()
            t4 = pc()
            times[i] = (t1 - t0 - st.last_source_wait_ns, t2 - t1, t3 - t2, t4 - t3)
        med = np.median(times, axis=0) / 1e3
        return dict(zip(("begin", "prepare", "publish", "finish"), map(float, med),
                        strict=True))

    def per_step(self) -> dict[str, float]:
        c = self.state.counters("decode_step")
        n = max(c.publications, 1)
        return {"dmas": c.dmas / n, "scatters": c.scatters / n,
                "direct_copies": c.direct_copies / n}


class AtomStep:
    """The shared ATOM-style decode step over the library ways' batches and destinations."""

    def __init__(self, bs: int, context: int, device: str, warmup: int) -> None:
        per_row = -(-(context + PAGE - 1 + WINDOW) // PAGE)
        self.state = H2DRunnerState(device, backend="direct", num_slots=2)
        self.step = DecodeStepInputs(self.state,
                                     StepShape(max_reqs=bs, max_tokens=bs,
                                               max_pages_per_req=per_row, page_size=PAGE))
        self.state.bind()
        self.atom = AtomStyleDecode(self.step, page_size=PAGE)
        self.prev = torch.zeros(bs, 1, dtype=torch.int32, device=device)
        self.batches = steady_decode_batches(bs, context, PAGE, window=WINDOW)
        self.run(warmup)

    def run(self, steps: int) -> float:
        """Step ``steps`` batches (built before the timed region); the median host µs from
        the host build until the first consumers are enqueued, less the wait for a source
        set."""
        batches = [next(self.batches) for _ in range(steps)]
        for b in batches:
            b.columns, b.block_tables  # noqa: B018
        atom, pc = self.atom, time.perf_counter_ns
        consume, assemble, prev = (self.step.decode.generate_kv_indices,
                                   self.step.tokens.assemble, self.prev)
        times = []
        for b in batches:
            atom.sync_lists(b)  # the scheduler's list upkeep: outside the timed step
            t0 = pc()
            _, tplan, plan = atom.publish(b, None)
            assemble(tplan, prev)  # the deferred ids, as the library's ways
            consume(plan)
            times.append(pc() - t0 - atom.last_wait_ns)
        return float(np.median(times)) / 1e3


class UnderDeviceContext:
    """A way run with ``set_default_device("cpu")`` active (a DeviceContext)."""

    def __init__(self, inner: LibraryStep) -> None:
        self.inner = inner

    def run(self, steps: int) -> float:
        torch.set_default_device("cpu")
        try:
            return self.inner.run(steps)
        finally:
            torch.set_default_device(None)


class Mrv2Step:
    """The MRV2-style step (``peers.mrv2_style``) at the library ways' row width; rows start
    short enough for every timed step to fit them."""

    def __init__(self, bs: int, context: int, device: str, warmup: int, steps: int) -> None:
        max_blocks = -(-context // PAGE)
        start = max_blocks * PAGE - PAGE - (warmup + steps)
        self.step = Mrv2StyleStep(bs, max_blocks, device, context_len=start, page_size=PAGE)
        self.run(warmup)

    def run(self, steps: int) -> float:
        """The median host µs of ``steps`` steps' metadata work (its ring wait left out)."""
        times = []
        for _ in range(steps):
            self.step.step()
            times.append(self.step.last_host_ns)
        return float(np.median(times)) / 1e3


def measure(bs: int, args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on CPU the consumer kernel needs TRITON_INTERPRET=1")
    fuse = True  # packed: KV-index generation inside the publication's graph
    ways: dict[str, Any] = {
        "packed": LibraryStep("packed", bs, args.context, device, args.warmup, fuse),
        "packed-eager": LibraryStep("packed", bs, args.context, device, args.warmup),
        "direct": LibraryStep("direct", bs, args.context, device, args.warmup),
        "packed+ctx": UnderDeviceContext(LibraryStep("packed", bs, args.context, device,
                                                     args.warmup, fuse)),
        "atom": AtomStep(bs, args.context, device, args.warmup),
        "mrv2": Mrv2Step(bs, args.context, device, args.warmup, args.rounds * args.chunk),
    }
    medians: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            medians[name].append(ways[name].run(args.chunk))
    if device == "cuda":
        torch.cuda.synchronize()
    out: dict[str, Any] = {"bs": bs, "context": args.context, "device": device,
                           "target_us": TARGETS.get(bs)}
    for name, values in medians.items():
        out[f"{name}_us"] = float(np.median(values))
        out[f"{name}_us_chunks"] = values
        out[f"{name}_us_spread"] = [min(values), max(values)]
    out["packed_parts_us"] = ways["packed"].parts(args.rounds * args.chunk // 2)
    out["packed_per_step"] = ways["packed"].per_step()
    out["direct_per_step"] = ways["direct"].per_step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure(int(bs), args) for bs in args.batch_sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_targets.json").write_text(json.dumps(rows, indent=1))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}; host µs per decode step, median of "
          f"{args.rounds} interleaved chunks [packed's lowest-highest chunk]; ratio = way / "
          "packed (lower is better)")
    print("| bs | target | packed | packed-eager | direct | atom | mrv2 | packed+ctx | "
          "DMAs+scatters/step (packed) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        p = r["packed_us"]

        def cell(k: str, r: dict[str, Any] = r, p: float = p) -> str:
            v = r.get(f"{k}_us")
            return "-" if v is None else f"{v:.1f} ({v / p:.1f}x)"

        per = r["packed_per_step"]
        target = "-" if r["target_us"] is None else f"≤ {r['target_us']:.0f}"
        lo, hi = r["packed_us_spread"]
        print(f"| {r['bs']} | {target} | **{p:.1f}** [{lo:.1f}-{hi:.1f}] | "
              f"{cell('packed-eager')} | "
              f"{cell('direct')} | "
              f"{cell('atom')} | {cell('mrv2')} | {cell('packed+ctx')} | "
              f"{per['dmas']:.0f} + {per['scatters']:.0f} "
              f"(direct copies {per['direct_copies']:.0f}) |")
    print("\npacked by part, host µs (median per step): begin / prepare / publish+consumer / "
          "finish; floor = begin + publish + finish")
    for r in rows:
        q = r["packed_parts_us"]
        floor = q["begin"] + q["publish"] + q["finish"]
        print(f"bs={r['bs']}: {q['begin']:.1f} / {q['prepare']:.1f} / {q['publish']:.1f} / "
              f"{q['finish']:.1f}; floor {floor:.1f}")


if __name__ == "__main__":
    main()
