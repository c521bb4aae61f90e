"""The DeepSeek-V4.1 decode step's host time: this library against an ATOM-style step.

One ordinary decode step (one query token per request, 128K-token contexts, 256-token
blocks, 1/16 of the requests cross a block each step), four ways, interleaved in one
process (the GPU host's speed drifts between processes):

* ``packed``: ``token_inputs`` (``TokenStepInputs.prepare``: sampling, ids, deferred
  sources, query prefix) and ``v41_metadata`` (``V41MetadataInputs.begin_step``): two
  producer calls, two DMAs and two scatters, the first consumer (step indptrs and the
  per-token expansion) fused into the ``v41_metadata`` publication (``fuse_step_indptrs``);
* ``launched``: the same, the first consumer launched by the caller after ``publish``
  (two Triton launches: what the fusion saves);
* ``direct``: the same code with ``backend="direct"`` (one copy per member, the first
  consumer launched);
* ``atom``: the shared ATOM-style step (``peers/atom_families.py``, ``V4DecodeStep``,
  from the ATOM catalog §2.4 / §3c): the host builds every array (positions, query prefix,
  full-width block-table rows from the scheduler's Python lists, state slots, four plans,
  batch ids, committed counts, three host cumsums, the per-token committed counts and
  block-table gather, the HCA index head, ``qo_indptr``) and copies each member on its
  own, its leading rows only (plans: one row per request and ratio; the HCA indices up to
  their last pointer): 19 V4 fp8 copies plus the 4 token-core ones.

Host µs per step (median of chunk medians), every way up to the same point, the first
consumer's outputs enqueued: for the library from ``begin()`` to ``finish()`` with
``generate_step_indptrs`` inside (it launches nothing when fused); for ``atom`` the host
work that builds those arrays (what the library's first consumer builds on the GPU) and
its copies; each less its blocking wait for source reuse (the library's slot, the
ATOM-style step's pinned source set; two each). On
CPU (``--device cpu``) the consumers, Triton kernels, would run interpreted: they are left
out of every way there, and the header says so. Ratio = way / packed.

GPU span per step (CUDA only, a separate pass): CUDA events from the first publication
work to where the first attention kernel could start: for the library the DMAs, scatters
and the first consumer (step indptrs and the per-token expansion: per-token tables, HCA
index head), for ``atom`` its 23 copies (its host already built those arrays). Each step
is queued behind a ``torch.cuda._sleep`` three times the way's own host p90 (measured in
the timed rounds first; at least ~1 ms), so the host has enqueued all of it: the span is
GPU work, not host gaps.

    python benchmarks/v41_step.py [--batch-sizes 1,8,64,256] [--rounds 6] [--chunk 100]
        [--context 131072] [--device cuda|cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from repo_paths import ROOT, use_sources

use_sources()

from peers.atom_families import V4DecodeStep  # noqa: E402
from peers.atom_style import PageLists  # noqa: E402
from span_sleep import sleep_cycles  # noqa: E402

from block_tables import BlockTable  # noqa: E402
from h2d_core import H2DRunnerState  # noqa: E402
from h2d_runner_adapters import (  # noqa: E402
    TOKEN_INPUTS,
    V4_BLOCK,
    V41_METADATA,
    BatchColumns,
    ScheduledBatch,
    SpanColumns,
    TokenStepInputs,
    V41MetadataInputs,
)

WINDOW, TOPK, ENVELOPE = 128, 1024, 66  # SWA window, index top-k, compressed rows per block
TARGET_US = {64: 20.0}
#: the one-publication way's combined group (token inputs + the V4.1 metadata)
V41_STEP = "v41_step"


class Batches:
    """Steady decode: ``bs`` requests near ``context`` tokens, one token a step; a request
    crosses into a new block every 256 steps (1/16 of them share each crossing step)."""

    def __init__(self, bs: int, context: int) -> None:
        self.bs = bs
        self.ctx = np.array([context - V4_BLOCK + (i * 16) % V4_BLOCK for i in range(bs)],
                            np.int64)
        self.tables = [BlockTable(range(1 + i * 1000, 1 + i * 1000 + -(-int(c) // V4_BLOCK)))
                       for i, c in enumerate(self.ctx)]
        self.lists = PageLists()  # the scheduler's Python page lists (ATOM's block tables)
        self.next_block = 10**6

    def step(self) -> tuple[SpanColumns, list[BlockTable], list[list[int]]]:
        self.ctx += 1
        for i in range(self.bs):
            if -(-int(self.ctx[i]) // V4_BLOCK) > len(self.tables[i]):
                t = self.tables[i].lineage_copy()
                t.append_one(self.next_block)
                self.tables[i] = t
                self.next_block += 1
        n = self.bs
        slots = np.arange(n, dtype=np.int32)
        cols = SpanColumns(np.ones(n, np.int32), self.ctx.astype(np.int32), slots, slots)
        return cols, list(self.tables), list(self.lists.sync(self.tables))


class Library:
    """token_inputs + v41_metadata on one backend; ``one``: both in one publication
    (``TokenStepInputs(group="v41_step", extra_groups=[V41_METADATA])``)."""

    def __init__(self, backend: str, bs: int, context: int, device: str,
                 fuse: bool = False, one: bool = False) -> None:
        blocks = -(-(context + 8192) // V4_BLOCK)  # room for the steps run
        self.state = st = H2DRunnerState(device, backend=backend, num_slots=2)
        self.consumers = device == "cuda"  # interpreted on CPU: left out there
        self.v4 = V41MetadataInputs(st, max_reqs=bs, max_tokens=bs, max_blocks_per_req=blocks,
                                    dummy_state_slot=bs, dummy_block=0, window=WINDOW,
                                    index_topk=TOPK, fp8=True, envelope_rows=ENVELOPE,
                                    fuse_step_indptrs=fuse and self.consumers)
        self.groups: tuple[str, ...] = ((V41_STEP,) if one else (TOKEN_INPUTS, V41_METADATA))
        self.tokens = (TokenStepInputs(st, max_reqs=bs, max_tokens=bs, group=V41_STEP,
                                       extra_groups=[V41_METADATA]) if one
                       else TokenStepInputs(st, max_reqs=bs, max_tokens=bs))
        st.bind()
        self.batches = Batches(bs, context)
        n = bs
        self.columns = BatchColumns(
            query_lens=np.ones(n, np.int32), context_lens=np.full(n, context, np.int32),
            temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
            token_ids=np.zeros(n, np.int32), num_drafts=np.zeros(n, np.int32))
        self.host_us: list[float] = []
        self.run(20)
        self.host_us.clear()

    def run(self, steps: int) -> float:
        work = [self.batches.step()[:2] for _ in range(steps)]
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=self.columns)
        st, v4, tokens = self.state, self.v4, self.tokens
        pc = time.perf_counter_ns
        times = []
        consumers = self.consumers
        publish = st.publish
        groups = self.groups
        for spans, rows in work:
            t0 = pc()
            st.begin()
            tokens.prepare(batch)
            plan = v4.begin_step(spans, block_tables=rows)
            for group in groups:
                publish(group)
            if consumers:
                v4.generate_step_indptrs(plan)
            st.finish()
            times.append(pc() - t0 - st.last_source_wait_ns)
        self.host_us += [t / 1e3 for t in times]
        return float(np.median(times)) / 1e3

    def gpu_span(self, steps: int, host_p90_us: float) -> float:
        """Median GPU µs from the first publication work through the first consumer, each
        step queued behind a sleep longer than its host enqueue."""
        work = [self.batches.step()[:2] for _ in range(steps)]
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=self.columns)
        st, v4, tokens = self.state, self.v4, self.tokens
        cycles = sleep_cycles(host_p90_us)
        events = []
        for spans, rows in work:
            torch.cuda._sleep(cycles)
            e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            e0.record()
            st.begin()
            tokens.prepare(batch)
            plan = v4.begin_step(spans, block_tables=rows)
            for group in self.groups:
                st.publish(group)
            v4.generate_step_indptrs(plan)
            st.finish()
            e1.record()
            events.append((e0, e1))
        torch.cuda.synchronize()
        return float(np.median([a.elapsed_time(b) * 1e3 for a, b in events]))

    def per_step(self) -> dict[str, float]:
        out = {}
        for group in self.groups:
            c = self.state.counters(group)
            n = max(c.publications, 1)
            out[group] = {"dmas": c.dmas / n, "scatters": c.scatters / n,
                          "direct_copies": c.direct_copies / n}
        return out


class AtomStyle(V4DecodeStep):
    """The shared ATOM-style V4 fp8 decode step (``peers/atom_families.py``: every array
    built on the host, one copy per member, 19 V4 + 4 token core) over this benchmark's
    batches."""

    def __init__(self, bs: int, context: int, device: str) -> None:
        blocks = -(-(context + 8192) // V4_BLOCK)  # room for the steps run
        super().__init__(bs, blocks, device, window=WINDOW, index_topk=TOPK,
                         envelope_rows=ENVELOPE)
        self.bs = bs
        self.batches = Batches(bs, context)
        self.host_us: list[float] = []
        self.run(20)
        self.host_us.clear()

    def gpu_span(self, steps: int, host_p90_us: float) -> float:
        """Median GPU µs of the step's copies (its host already built what the library's
        first consumer builds), each step queued behind a sleep longer than its host."""
        work = [self.batches.step() for _ in range(steps)]
        cycles = sleep_cycles(host_p90_us)
        events = []
        for spans, _, lists in work:
            torch.cuda._sleep(cycles)
            e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            e0.record()
            self.step(spans, lists)
            e1.record()
            events.append((e0, e1))
        torch.cuda.synchronize()
        return float(np.median([a.elapsed_time(b) * 1e3 for a, b in events]))

    def run(self, steps: int) -> float:
        work = [self.batches.step() for _ in range(steps)]
        pc = time.perf_counter_ns
        times = []
        for spans, _, lists in work:
            t0 = pc()
            self.step(spans, lists)
            times.append(pc() - t0 - self.last_wait_ns)
        self.host_us += [t / 1e3 for t in times]
        return float(np.median(times)) / 1e3


def measure(bs: int, args: argparse.Namespace) -> dict[str, Any]:
    ways: dict[str, Any] = {
        "packed": Library("packed", bs, args.context, args.device, fuse=True),
        "one": Library("packed", bs, args.context, args.device, fuse=True, one=True),
        "launched": Library("packed", bs, args.context, args.device),
        "direct": Library("direct", bs, args.context, args.device),
        "atom": AtomStyle(bs, args.context, args.device),
    }
    medians: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            medians[name].append(ways[name].run(args.chunk))
    if args.device == "cuda":
        torch.cuda.synchronize()
    out: dict[str, Any] = {"bs": bs, "context": args.context, "device": args.device,
                           "target_us": TARGET_US.get(bs)}
    for name, values in medians.items():
        out[f"{name}_us"] = float(np.median(values))
        out[f"{name}_us_chunks"] = values
    out["packed_per_step"] = ways["packed"].per_step()
    out["one_per_step"] = ways["one"].per_step()
    out["consumers_timed"] = ways["packed"].consumers
    for name, way in ways.items():
        out[f"{name}_us_p90"] = float(np.percentile(way.host_us, 90))
    if args.device == "cuda":  # each way's sleep scaled to its own host time, measured above
        for name, way in ways.items():
            out[f"{name}_gpu_span_us"] = way.gpu_span(args.chunk, out[f"{name}_us_p90"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure(int(bs), args) for bs in args.batch_sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "v41_step.json").write_text(json.dumps(rows, indent=1))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    timed = ("through the first consumer enqueued" if args.device == "cuda"
             else "first consumers left out (CPU: they would run interpreted)")
    print(f"{gpu}, torch {torch.__version__}; V4.1 decode step (q=1, {args.context}-token "
          f"contexts): host µs {timed}, median of {args.rounds} interleaved chunks "
          "[packed's lowest-highest chunk]; ratio = way / packed; lower is better")
    print("| bs | target | packed (fused) | one publication | launched | direct | atom | "
          "DMAs+scatters/step (packed; one) | GPU span µs packed / one / launched / direct / "
          "atom |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        p = r["packed_us"]
        per = r["packed_per_step"]
        dmas = sum(g["dmas"] for g in per.values())
        scatters = sum(g["scatters"] for g in per.values())
        copies = sum(g["direct_copies"] for g in per.values())
        one = r["one_per_step"]
        one_ops = (f"{sum(g['dmas'] for g in one.values()):.0f} + "
                   f"{sum(g['scatters'] for g in one.values()):.0f}")
        target = "-" if r["target_us"] is None else f"≤ {r['target_us']:.0f}"
        span = " / ".join(f"{r[k + '_gpu_span_us']:.1f}" if k + "_gpu_span_us" in r else "-"
                          for k in ("packed", "one", "launched", "direct", "atom"))
        lo, hi = min(r["packed_us_chunks"]), max(r["packed_us_chunks"])
        lo1, hi1 = min(r["one_us_chunks"]), max(r["one_us_chunks"])
        print(f"| {r['bs']} | {target} | **{p:.1f}** [{lo:.1f}-{hi:.1f}] | **{r['one_us']:.1f}** "
              f"[{lo1:.1f}-{hi1:.1f}] ({r['one_us'] / p:.2f}x) | {r['launched_us']:.1f} "
              f"({r['launched_us'] / p:.1f}x) | {r['direct_us']:.1f} "
              f"({r['direct_us'] / p:.1f}x) | {r['atom_us']:.1f} ({r['atom_us'] / p:.1f}x) | "
              f"{dmas:.0f} + {scatters:.0f} (direct copies {copies:.0f}); {one_ops} | {span} |")


if __name__ == "__main__":
    main()
