"""The speculative (MTP) verify step's host time, and the copies of verify and draft steps.

One verify step of ``k`` drafts per request (q = k + 1 tokens), 32K-token contexts, 16-token
pages, 1/16 of the requests cross a page each step, three ways interleaved in one process
(the GPU host's speed drifts between processes):

* ``packed``: ``DecodeStepInputs(max_drafts=k)`` (+ ``GdnStateInputs`` riding in the same
  group for GDN+MTP): the fused producer, the speculative indices, the GDN state indices,
  one publication: one DMA and one scatter;
* ``direct``: the same code with ``backend="direct"`` (one copy per member);
* ``atom``: the shared ATOM-style verify step (``peers/atom_families.py``,
  ``MtpVerifyStep``): the host builds every array (full-width block-table rows from the
  scheduler's Python lists, the KV slots by a Python comprehension over them) and copies
  each member: 13 copies for MHA+MTP (the plain-MHA 10 and the verify trio); for GDN+MTP
  15 (plus the second query prefix and the spec state indices), the block table rebuilt
  a second time, one scalar store per request for ``num_accepted_tokens`` and the
  ``.item()`` readback of the spec token count.

Host µs per step (median of chunk medians) from ``begin()`` to ``finish()`` for the
library, the host work and copies for ``atom``, each less its blocking wait for source
reuse (the library's slot, the ATOM-style step's pinned source set; two each).
Ratio = way / packed. CUDA only, from a ``torch.profiler`` trace: host-to-device copies and
kernels of one packed verify step, and of the ``k`` draft steps after it
(``MhaDraftLoop.advance``: metadata and KV indices on the GPU).

    python benchmarks/mtp_step.py [--batch-sizes 1,8,64,256] [--k 1] [--gdn] [--rounds 6]
        [--chunk 100] [--context 32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from repo_paths import ROOT, use_sources

use_sources()

from peers.atom_families import MtpVerifyStep  # noqa: E402
from peers.atom_style import PageLists  # noqa: E402

from block_tables import BlockTable  # noqa: E402
from h2d_core import H2DRunnerState  # noqa: E402
from h2d_kernels import copy_counts, is_copy  # noqa: E402
from h2d_runner_adapters import (  # noqa: E402
    DECODE_STEP,
    GDN_STATE,
    BatchColumns,
    DecodeStepInputs,
    GdnStateInputs,
    MhaDraftLoop,
    ScheduledBatch,
    StepShape,
)

PAGE = 16


class Batches:
    """Steady verify steps: ``bs`` requests near ``context`` tokens, ``k + 1`` tokens a
    step; a request crosses into a new page every ``PAGE / (k + 1)`` steps on average."""

    def __init__(self, bs: int, context: int, k: int) -> None:
        self.bs, self.k = bs, k
        self.ctx = np.array([context + (i * 3) % PAGE for i in range(bs)], np.int32)
        self.tables = [BlockTable(range(i * 5000, i * 5000 + -(-int(c + 2 * k + 2) // PAGE)))
                       for i, c in enumerate(self.ctx)]
        self.lists = PageLists()  # the scheduler's Python page lists (ATOM's block tables)
        self.next_page = 10**7
        self.window = 0

    def step(self) -> tuple[ScheduledBatch, list[list[int]]]:
        n, q = self.bs, self.k + 1
        self.window += 1
        if self.window > 200:  # stay inside the declared rows: restart the contexts
            self.window = 0
            self.ctx -= 200 * q
        self.ctx += q
        for i in range(n):
            need = -(-(int(self.ctx[i]) + 2 * self.k + 2) // PAGE)
            if need > len(self.tables[i]):
                t = self.tables[i].lineage_copy()
                t.append_one(self.next_page)
                self.tables[i] = t
                self.next_page += 1
        cols = BatchColumns(
            query_lens=np.full(n, q, np.int32), context_lens=self.ctx.copy(),
            temperatures=np.zeros(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
            token_ids=np.zeros(n * q, np.int32), num_drafts=np.full(n, self.k, np.int32))
        return (ScheduledBatch((), False, PAGE, given_columns=cols,
                               given_block_tables=list(self.tables)),
                list(self.lists.sync(self.tables)))


class Library:
    def __init__(self, backend: str, bs: int, args: argparse.Namespace) -> None:
        k = args.k
        per_row = -(-(args.context + 200 * (k + 1) + 4 * k + 64) // PAGE)
        self.state = st = H2DRunnerState(args.device, backend=backend, num_slots=2)
        self.gdn = (GdnStateInputs(st, max_reqs=bs, num_spec=k) if args.gdn else None)
        self.step = DecodeStepInputs(st,
                                     StepShape(max_reqs=bs, max_tokens=bs * (k + 1),
                                               max_pages_per_req=per_row, page_size=PAGE),
                                     max_drafts=k, extra_groups=[GDN_STATE] if args.gdn else ())
        st.bind()
        self.loop = MhaDraftLoop(self.step.decode, self.step.tokens)
        self.batches = Batches(bs, args.context, k)
        self.groups = np.arange(bs, dtype=np.int32)
        self.accepted = np.ones(bs, np.int32)
        self.run(20)

    def publish(self, batch: ScheduledBatch) -> Any:
        st, step = self.state, self.step
        st.begin()
        plan = step.prepare_verify(batch)  # the step and its verification indices
        if self.gdn is not None:
            self.gdn.prepare(self.groups, num_accepted=self.accepted)
        st.publish(DECODE_STEP)
        st.finish()
        return plan

    def run(self, steps: int) -> float:
        work = [self.batches.step()[0] for _ in range(steps)]
        for b in work:
            b.columns, b.block_tables  # noqa: B018
        pc, st = time.perf_counter_ns, self.state
        times = []
        for batch in work:
            t0 = pc()
            self.publish(batch)
            times.append(pc() - t0 - st.last_source_wait_ns)
        return float(np.median(times)) / 1e3


class AtomStyle(MtpVerifyStep):
    """The shared ATOM-style verify step (``peers/atom_families.py``: MHA+MTP 13 copies;
    GDN+MTP 15 copies, the block table rebuilt twice, per-request scalar stores of the
    accepted counts and one ``.item()``) over this benchmark's batches."""

    def __init__(self, bs: int, args: argparse.Namespace) -> None:
        k = args.k
        per_row = -(-(args.context + 200 * (k + 1) + 4 * k + 64) // PAGE)
        super().__init__(bs, k, per_row, PAGE, args.device, gdn=args.gdn)
        self.bs = bs
        self.batches = Batches(bs, args.context, k)
        self.run(20)

    def run(self, steps: int) -> float:
        """Median host µs of ``steps`` steps (their batches and page lists built before),
        less each step's wait for a free source set."""
        work = [self.batches.step() for _ in range(steps)]
        pc = time.perf_counter_ns
        times = []
        for batch, lists in work:
            t0 = pc()
            self.step(batch, lists)
            times.append(pc() - t0 - self.last_wait_ns)
        return float(np.median(times)) / 1e3


def _profiled(fn: Any) -> tuple[list[str], Counter[str]]:
    """The device events' names of ``fn()`` (the record_function mirrors left out) and its
    copies by kind (the runtime's copy kind, read from the trace)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"
             and not e.name.startswith("h2d.")]
    return names, copy_counts(prof)


def _kernels(names: list[str]) -> int:
    return len([n for n in names if not is_copy(n) and "Memset" not in n])


def atom_counts(atom: AtomStyle) -> dict[str, int]:
    """Host-to-device copies (by the runtime's copy kind) and kernels of one ATOM-style
    verify step."""
    batch, lists = atom.batches.step()
    names, kinds = _profiled(lambda: atom.step(batch, lists))
    return {"atom_h2d": kinds["H2D"], "atom_kernels": _kernels(names)}


def trace_counts(lib: Library, k: int) -> dict[str, int]:
    """Host-to-device copies and kernels of one verify publication and of its k draft
    steps, from a torch.profiler trace (CUDA)."""
    batch = lib.batches.step()[0]
    rejected = torch.zeros(lib.batches.bs, dtype=torch.int32, device="cuda")
    plan = lib.publish(batch)
    for s in range(1, k + 1):
        lib.loop.advance(plan.decode, rejected, s)
    torch.cuda.synchronize()
    out = {}
    for what in ("verify", "draft"):
        batch = lib.batches.step()[0]
        if what == "draft":
            plan = lib.publish(batch)
            torch.cuda.synchronize()

        def run(what: str = what, plan: Any = plan, batch: Any = batch) -> None:
            if what == "verify":
                lib.publish(batch)
            else:
                for s in range(1, k + 1):
                    lib.loop.advance(plan.decode, rejected, s)

        names, kinds = _profiled(run)
        out[f"{what}_h2d"] = kinds["H2D"]
        out[f"{what}_kernels"] = _kernels(names)
        out[f"{what}_other_copies"] = sum(kinds.values()) - kinds["H2D"]
    return out


def measure(bs: int, args: argparse.Namespace) -> dict[str, Any]:
    ways: dict[str, Any] = {"packed": Library("packed", bs, args),
                            "direct": Library("direct", bs, args),
                            "atom": AtomStyle(bs, args)}
    medians: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            medians[name].append(ways[name].run(args.chunk))
    out: dict[str, Any] = {"bs": bs, "k": args.k, "gdn": args.gdn, "context": args.context}
    for name, values in medians.items():
        out[f"{name}_us"] = float(np.median(values))
        out[f"{name}_us_chunks"] = values
    c = ways["packed"].state.counters(DECODE_STEP)
    out["packed_dmas_per_step"] = c.dmas / max(c.publications, 1)
    out["packed_scatters_per_step"] = c.scatters / max(c.publications, 1)
    if args.device == "cuda":
        out.update(trace_counts(ways["packed"], args.k))
        out.update(atom_counts(ways["atom"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--gdn", action="store_true")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure(int(bs), args) for bs in args.batch_sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"k{args.k}{'_gdn' if args.gdn else ''}"
    (args.out / f"mtp_step_{tag}.json").write_text(json.dumps(rows, indent=1))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}; {'GDN+' if args.gdn else 'MHA+'}MTP verify "
          f"step, k={args.k}, {args.context}-token contexts: host µs, median of "
          f"{args.rounds} interleaved chunks [packed's lowest-highest chunk]; ratio = way / "
          "packed; lower is better")
    print("| bs | packed | direct | atom | verify: H2D + kernels (packed) | "
          f"{args.k} draft steps: H2D + kernels | atom: H2D + kernels |")
    print("|---:|---:|---:|---:|---|---|---|")
    for r in rows:
        p = r["packed_us"]
        trace = (f"{r['verify_h2d']} + {r['verify_kernels']} | {r['draft_h2d']} + "
                 f"{r['draft_kernels']} | {r['atom_h2d']} + {r['atom_kernels']}"
                 if "verify_h2d" in r else
                 f"{r['packed_dmas_per_step']:.0f} DMA + {r['packed_scatters_per_step']:.0f} "
                 "scatter (counters) | - | -")
        lo, hi = min(r["packed_us_chunks"]), max(r["packed_us_chunks"])
        print(f"| {r['bs']} | **{p:.1f}** [{lo:.1f}-{hi:.1f}] | {r['direct_us']:.1f} "
              f"({r['direct_us'] / p:.1f}x) "
              f"| {r['atom_us']:.1f} ({r['atom_us'] / p:.1f}x) | {trace} |")


if __name__ == "__main__":
    main()
