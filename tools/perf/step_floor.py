"""The packed decode step with its Python bookkeeping taken out: what is left to win.

Times, on the same bound storage and batches as ``step_ab.py`` / ``step_segments.py``
(bs=64, 1/16 of the rows append a page each step), two ways of publishing one decode step:

* ``api``: the public path, ``begin`` / ``DecodeStepInputs.prepare`` / ``publish`` /
  ``finish``;
* ``floor``: only the compiled and driver calls that path makes, in the same order,
  on the same bound storage: the slot event's query, the compiled request layout's plan,
  the block-table snapshot's prepare and the layout's write, the compiled record's count
  store, the compiled key diff into range triples, ``PackedGroup.publish`` (header, pack
  + graph launch) and the event record. Between them it keeps only the few record
  updates the next call needs.

It leaves out the epoch contract's Python: owner, epoch, device and stream checks, the
produced/published sets, the table record and its on-publish commit, counters, the
producer decorator. The difference between the two is therefore the most that
moving that bookkeeping into compiled code could save. ``floor`` is a measuring device,
not a supported way to publish.

Both states see the same batches; after every step on the CPU (every 50th on CUDA) their
destinations are compared bytewise, so the floor does the same work as the API. Steps the
compiled pass does not cover (every ``window`` steps all rows restart) go through the API
on both states and are not timed.

    python tools/perf/step_floor.py [--bs 64] [--context 4096 131072] [--steps 2000]
        [--slots 2] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from repo_paths import use_sources

use_sources()

from decode_runner.scheduler import steady_decode_batches  # noqa: E402

from h2d_core import H2DRunnerState  # noqa: E402
from h2d_core.native import native as core_native  # noqa: E402
from h2d_runner_adapters import DecodeStepInputs  # noqa: E402

GROUP = "decode_step"


class Setup:
    """One state and fused decode step, bound and warmed up through the API."""

    def __init__(self, args: argparse.Namespace, context: int, batches: list[Any]) -> None:
        page = 16
        per_row = -(-(context + page - 1 + 256) // page)
        self.state = st = H2DRunnerState(args.device, backend="packed", num_slots=args.slots)
        self.step = DecodeStepInputs(st, max_reqs=args.bs, max_tokens=args.bs,
                                     max_pages_per_req=per_row, page_size=page)
        st.bind()
        for slot, b in zip(range(args.slots), batches, strict=False):
            self.api(b, slot)
        self.times: list[int] = []

    def api(self, batch: Any, slot: int) -> None:
        st = self.state
        st.begin(slot)
        self.step.prepare(batch)
        st.publish(GROUP)
        st.finish()


class Floor:
    """The compiled calls of ``Setup``'s step without the bookkeeping around them."""

    def __init__(self, setup: Setup) -> None:
        st, step = setup.state, setup.step
        self.setup = setup
        if not step.native or core_native is None:
            raise SystemExit("step_floor needs the compiled helpers (H2D_NATIVE=1, built)")
        step._bind()
        self.layouts = step._layouts
        self.records = [recs[st.plan(GROUP).index] for recs in st._slot_groups]
        self.counts = step._counts
        tables = step.decode.tables
        self.tables = tables
        self.table_member = tables.buffer.homes[0][1]
        self.row_bytes = tables._row_bytes
        rows = tables.buffer.spec.shape[0]
        self.keys = [np.empty(rows, np.int64), np.empty(rows, np.int64)]
        self.spare = 0
        published = tables.published
        assert published is not None
        self.published = self.keys[1][: published.keys.size]
        self.published[:] = published.keys
        self.events = st._slot_events
        self.stream = st._stream_id
        self.whole = 0  # steps that sent the whole table

    def resync(self) -> None:
        """After an API step: take over the table record it committed."""
        published = self.tables.published
        assert published is not None
        n = published.keys.size
        self.published = self.keys[1 - self.spare][:n]
        self.published[:] = published.keys

    def one(self, batch: Any, slot: int) -> bool:
        """One step; False (nothing written) when the compiled pass does not cover it."""
        setup = self.setup
        if self.events is not None:
            self.events.wait(slot)
        rec = self.records[slot]
        rec.clear_counts()
        cols = batch.columns
        layout = self.layouts[slot]
        layout.plan(cols.query_lens, cols.context_lens, -1, -1, (
            cols.temperatures, cols.top_k, cols.top_p, cols.prev_sample_rows,
            cols.token_ids, cols.num_drafts))
        if layout.min_query_len != layout.max_query_len:
            return False
        n, t = layout.num_reqs, layout.num_tokens
        self.tables.snapshots[slot].prepare(batch.block_tables,
                                            required_pages=layout.required_pages)
        layout.write()
        k_rows, p_rows = not layout.uniform_mask & 2, not layout.uniform_mask & 4
        rec.store_counts(self.counts._fused, (
            n, n if k_rows else None, n if p_rows else None, t, n + 1, n, n + 1, t, t, n,
            n + 1))
        snap = self.tables.snapshots[slot]
        keys = self.keys[self.spare]
        limit, max_bytes = self.tables._limits(n)
        found = snap._native.changed_byte_ranges(
            snap._row_keys, self.published, self.published.size, n, self.row_bytes, limit,
            max_bytes, keys, self.table_member)
        if found is NotImplemented:
            raise SystemExit("step_floor: the compiled key diff did not cover a steady step")
        if found is None:  # too many changed spans: whole rows, as stage() decides
            self.whole += 1
            buf = self.tables.buffer
            for gi, i in buf.homes:
                setup.state._slot_groups[slot][gi].store_count(i, n, buf._unit_bytes)
        elif found[0]:
            rec.ranges = found[0]
            rec.ranged.add(self.table_member)
            rec.active += 1
            rec.range_bytes = found[1]
        rec.packed.publish(rec.counts, rec.ranges, self.stream)  # h2d_kernels' one call
        if self.events is not None:
            self.events.record(slot, self.stream)
            setup.state._event_recorded[slot] = True
        self.published = keys[:n]
        self.spare = 1 - self.spare
        return True


def same_destinations(a: H2DRunnerState, b: H2DRunnerState) -> bool:
    return all(torch.equal(x.gpu, b.buffers()[name].gpu) for name, x in a.buffers().items())


def run(args: argparse.Namespace, context: int) -> dict[str, float]:
    gen = steady_decode_batches(args.bs, context, 16, window=256)
    batches = [next(gen) for _ in range(args.steps + 2 * args.slots)]
    for b in batches:
        b.columns, b.block_tables  # noqa: B018  (built outside the timed region)
    api, floor_setup = Setup(args, context, batches), Setup(args, context, batches)
    floor = Floor(floor_setup)
    check_every = 1 if args.device == "cpu" else 50
    pc = time.perf_counter_ns
    uncovered = 0
    for k in range(args.slots, args.slots + args.steps):
        b, slot = batches[k], k % args.slots
        t0 = pc()
        api.api(b, slot)
        t1 = pc()
        covered = floor.one(b, slot)
        t2 = pc()
        if covered:
            api.times.append(t1 - t0 - api.state.last_source_wait_ns)
            floor_setup.times.append(t2 - t1)
        else:
            uncovered += 1
            floor_setup.api(b, slot)
            floor.resync()
        if k % check_every == 0:
            if args.device == "cuda":
                torch.cuda.synchronize()
            if not same_destinations(api.state, floor_setup.state):
                raise SystemExit(f"step_floor: destinations differ after step {k}")
    if args.device == "cuda":
        torch.cuda.synchronize()
    if not same_destinations(api.state, floor_setup.state):
        raise SystemExit("step_floor: destinations differ at the end")
    return {"api": float(np.median(api.times)) / 1e3,
            "floor": float(np.median(floor_setup.times)) / 1e3, "uncovered": uncovered,
            "whole": floor.whole}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 131072])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    args = ap.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"host µs per step (median of the covered steps of {args.steps}); destinations "
          "compared bytewise")
    for context in args.context:
        r = run(args, context)
        print(f"{args.device} bs={args.bs} ctx={context} slots={args.slots} | api "
              f"{r['api']:.2f} | floor {r['floor']:.2f} | bookkeeping {r['api'] - r['floor']:.2f}"
              f" | uncovered steps {r['uncovered']}, whole-table steps {r['whole']}")


if __name__ == "__main__":
    main()
