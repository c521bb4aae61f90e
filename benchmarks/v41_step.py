"""The DeepSeek-V4.1 decode step's host time: this library against an ATOM-style step.

One ordinary decode step (one query token per request, 128K-token contexts, 256-token
blocks, 1/16 of the requests cross a block each step), three ways, interleaved in one
process (the GPU host's speed drifts between processes):

* ``packed``: ``token_inputs`` (``TokenStepInputs.prepare``: sampling, ids, deferred
  sources, query prefix) and ``v41_metadata`` (``V41MetadataInputs.begin_step``): two
  producer calls, two DMAs and two scatters, the first consumer (step indptrs and the
  per-token expansion) fused into the ``v41_metadata`` publication (``fuse_step_indptrs``);
* ``launched``: the same, the first consumer launched by the caller after ``publish``
  (two Triton launches: what the fusion saves);
* ``direct``: the same code with ``backend="direct"`` (one copy per member, the first
  consumer launched);
* ``atom``: an ATOM-style step re-created from the context document (§1.2-1.6): the host
  builds every array (positions, query prefix, full-width block-table rows from Python
  lists, state slots, four plans, batch ids, committed counts, three host cumsums, the
  per-token committed counts and block-table gather, the HCA index head, ``qo_indptr``)
  and copies each member on its own: 20 V4 fp8 copies plus the 4 token-core ones.

Host µs per step (median of chunk medians), every way up to the same point, the first
consumer's outputs enqueued: for the library from ``begin()`` to ``finish()`` with
``generate_step_indptrs`` inside (it launches nothing when fused), less any blocking wait
for source reuse; for ``atom`` the host work that builds those arrays and its copies. On
CPU (``--device cpu``) the consumers, Triton kernels, would run interpreted: they are left
out of every way there, and the header says so. Ratio = way / packed.

GPU span per step (CUDA only, a separate pass): CUDA events from the first publication
work to where the first attention kernel could start: for the library the DMAs, scatters
and the first consumer (step indptrs and the per-token expansion: per-token tables, HCA
index head), for ``atom`` its 24 copies (its host already built those arrays). Each step
is queued behind a ~1 ms ``torch.cuda._sleep`` so the host has enqueued all of it: the
span is GPU work, not host gaps.

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
SLEEP_CYCLES = 2_000_000  # ~1 ms on the H200: longer than any way's host enqueue


class Batches:
    """Steady decode: ``bs`` requests near ``context`` tokens, one token a step; a request
    crosses into a new block every 256 steps (1/16 of them share each crossing step)."""

    def __init__(self, bs: int, context: int) -> None:
        self.bs = bs
        self.ctx = np.array([context - V4_BLOCK + (i * 16) % V4_BLOCK for i in range(bs)],
                            np.int64)
        self.tables = [BlockTable(range(1 + i * 1000, 1 + i * 1000 + -(-int(c) // V4_BLOCK)))
                       for i, c in enumerate(self.ctx)]
        self.lists = [list(t) for t in self.tables]
        self.next_block = 10**6

    def step(self) -> tuple[SpanColumns, list[BlockTable], list[list[int]]]:
        self.ctx += 1
        for i in range(self.bs):
            if -(-int(self.ctx[i]) // V4_BLOCK) > len(self.tables[i]):
                t = self.tables[i].lineage_copy()
                t.append_one(self.next_block)
                self.tables[i] = t
                self.lists[i] = [*self.lists[i], self.next_block]
                self.next_block += 1
        n = self.bs
        slots = np.arange(n, dtype=np.int32)
        cols = SpanColumns(np.ones(n, np.int32), self.ctx.astype(np.int32), slots, slots)
        return cols, list(self.tables), self.lists


class Library:
    """token_inputs + v41_metadata on one backend."""

    def __init__(self, backend: str, bs: int, context: int, device: str,
                 fuse: bool = False) -> None:
        blocks = -(-(context + 8192) // V4_BLOCK)  # room for the steps run
        self.state = st = H2DRunnerState(device, backend=backend, num_slots=2)
        self.tokens = TokenStepInputs(st, max_reqs=bs, max_tokens=bs)
        self.consumers = device == "cuda"  # interpreted on CPU: left out there
        self.v4 = V41MetadataInputs(st, max_reqs=bs, max_tokens=bs, max_blocks_per_req=blocks,
                                    dummy_state_slot=bs, dummy_block=0, window=WINDOW,
                                    index_topk=TOPK, fp8=True, envelope_rows=ENVELOPE,
                                    fuse_step_indptrs=fuse and self.consumers)
        st.bind()
        self.batches = Batches(bs, context)
        n = bs
        self.columns = BatchColumns(
            query_lens=np.ones(n, np.int32), context_lens=np.full(n, context, np.int32),
            temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
            token_ids=np.zeros(n, np.int32), num_drafts=np.zeros(n, np.int32))
        self.run(20)

    def run(self, steps: int) -> float:
        work = [self.batches.step()[:2] for _ in range(steps)]
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=self.columns)
        st, v4, tokens = self.state, self.v4, self.tokens
        pc = time.perf_counter_ns
        times = []
        consumers = self.consumers
        for spans, rows in work:
            t0 = pc()
            st.begin()
            tokens.prepare(batch)
            plan = v4.begin_step(spans, block_tables=rows)
            st.publish(TOKEN_INPUTS)
            st.publish(V41_METADATA)
            if consumers:
                v4.generate_step_indptrs(plan)
            st.finish()
            times.append(pc() - t0 - st.last_source_wait_ns)
        return float(np.median(times)) / 1e3

    def gpu_span(self, steps: int) -> float:
        """Median GPU µs from the first publication work through the first consumer."""
        work = [self.batches.step()[:2] for _ in range(steps)]
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=self.columns)
        st, v4, tokens = self.state, self.v4, self.tokens
        events = []
        for spans, rows in work:
            torch.cuda._sleep(SLEEP_CYCLES)
            e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            e0.record()
            st.begin()
            tokens.prepare(batch)
            plan = v4.begin_step(spans, block_tables=rows)
            st.publish(TOKEN_INPUTS)
            st.publish(V41_METADATA)
            v4.generate_step_indptrs(plan)
            st.finish()
            e1.record()
            events.append((e0, e1))
        torch.cuda.synchronize()
        return float(np.median([a.elapsed_time(b) * 1e3 for a, b in events]))

    def per_step(self) -> dict[str, float]:
        out = {}
        for group in (TOKEN_INPUTS, V41_METADATA):
            c = self.state.counters(group)
            n = max(c.publications, 1)
            out[group] = {"dmas": c.dmas / n, "scatters": c.scatters / n,
                          "direct_copies": c.direct_copies / n}
        return out


class AtomStyle:
    """The host side of an ATOM-style V4 fp8 decode step: every array built on the host,
    one copy per member (20 V4 + 4 token core)."""

    def __init__(self, bs: int, context: int, device: str) -> None:
        self.bs = bs
        self.batches = Batches(bs, context)
        blocks = -(-(context + 8192) // V4_BLOCK)  # room for the steps run
        self.blocks = blocks
        pin = device == "cuda"
        hca_cap = bs * (WINDOW + -(-(context + 1024) // 128))

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
            cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return cpu, torch.zeros(shape, dtype=dtype, device=device)

        i32, i64 = torch.int32, torch.int64
        self.m = {
            "positions": pair((bs,), i64), "cu_seqlens_q": pair((bs + 1,), i32),
            "context_lens": pair((bs,), i32), "block_tables": pair((bs, blocks), i32),
            "slot_out": pair((bs,), i32), "slot_in": pair((bs,), i32),
            "compress_4": pair((bs + bs, 4), i32), "write_4": pair((bs * 8, 4), i32),
            "compress_128": pair((bs + bs, 4), i32), "write_128": pair((bs * 128, 4), i32),
            "batch_id": pair((bs,), i32), "ncsa": pair((bs,), i32),
            "ind_swa": pair((bs + 1,), i32), "ind_csa": pair((bs + 1,), i32),
            "ind_hca": pair((bs + 1,), i32), "n_committed": pair((bs,), i32),
            "bt_per_token": pair((bs, blocks), i32), "hca_idx": pair((hca_cap,), i32),
            "qo_indptr": pair((bs + 1,), i32), "ragged_extend": pair((bs,), i32),
            "temperatures": pair((bs,), torch.float32), "input_ids": pair((bs,), i32),
            "decode_cu": pair((bs + 1,), i32), "decode_src": pair((bs,), i32),
        }
        self.np = {k: c.numpy() for k, (c, _) in self.m.items()}
        self.run(20)

    def step(self, spans: SpanColumns, lists: list[list[int]]) -> None:
        a, n = self.np, self.bs
        ctx = spans.context_lens.astype(np.int64)
        pos = ctx - 1
        a["positions"][:n] = pos
        a["cu_seqlens_q"][: n + 1] = np.arange(n + 1)
        a["context_lens"][:n] = ctx
        bt = a["block_tables"]
        for i, row in enumerate(lists):  # the per-row full-width rebuild
            bt[i, :] = 0
            bt[i, : len(row)] = row
        a["slot_out"][:n] = spans.state_slots_out
        a["slot_in"][:n] = spans.state_slots_in
        t = np.arange(n)
        for r, k, c_name, w_name in ((4, 8, "compress_4", "write_4"),
                                     (128, 128, "compress_128", "write_128")):
            rows = np.stack([t, t, pos, np.full(n, k - 1)], axis=1)
            sel = np.flatnonzero((pos + 1) % r == 0)
            a[c_name][: sel.size] = rows[sel]
            a[c_name][sel.size : n] = -1
            a[w_name][:n] = rows
        a["batch_id"][:n] = t
        ncsa = ctx // 4
        a["ncsa"][:n] = ncsa
        swa = np.minimum(pos + 1, WINDOW)
        vis = np.minimum((pos + 1) // 4, ncsa)
        hca = ctx // 128
        for name, seg in (("ind_swa", swa), ("ind_csa", swa + np.minimum(vis, TOPK)),
                          ("ind_hca", swa + hca)):
            a[name][0] = 0
            np.cumsum(seg, out=a[name][1 : n + 1])
        a["n_committed"][:n] = vis
        a["bt_per_token"][:n] = bt[:n]  # per-token gather (one token per request here)
        head = a["hca_idx"]
        ptr = a["ind_hca"]
        for i in range(n):  # HCA index head: compressed rows, then -1 for the window tail
            e = np.arange(int(hca[i]))
            start = int(ptr[i])
            head[start : start + e.size] = bt[i, e // 2] * ENVELOPE + e % 2
            head[start + e.size : int(ptr[i + 1])] = -1
        a["qo_indptr"][: n + 1] = np.arange(n + 1)
        a["ragged_extend"][:n] = 1
        a["temperatures"][:n] = 1.0
        a["input_ids"][:n] = 0
        a["decode_cu"][: n + 1] = np.arange(n + 1)
        a["decode_src"][:n] = t
        for cpu, gpu in self.m.values():
            gpu.copy_(cpu, non_blocking=True)

    def gpu_span(self, steps: int) -> float:
        """Median GPU µs of the step's copies (queued behind a sleep)."""
        work = [self.batches.step() for _ in range(steps)]
        events = []
        for spans, _, lists in work:
            torch.cuda._sleep(SLEEP_CYCLES)
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
            times.append(pc() - t0)
        return float(np.median(times)) / 1e3


def measure(bs: int, args: argparse.Namespace) -> dict[str, Any]:
    ways: dict[str, Any] = {
        "packed": Library("packed", bs, args.context, args.device, fuse=True),
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
    out["consumers_timed"] = ways["packed"].consumers
    if args.device == "cuda":
        for name, way in ways.items():
            out[f"{name}_gpu_span_us"] = way.gpu_span(args.chunk)
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
          f"contexts): host µs {timed}, median of {args.rounds} interleaved chunks; ratio = "
          "way / packed; lower is better")
    print("| bs | target | packed (fused) | launched | direct | atom | DMAs+scatters/step "
          "(packed) | GPU span µs packed / launched / direct / atom |")
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        p = r["packed_us"]
        per = r["packed_per_step"]
        dmas = sum(g["dmas"] for g in per.values())
        scatters = sum(g["scatters"] for g in per.values())
        copies = sum(g["direct_copies"] for g in per.values())
        target = "-" if r["target_us"] is None else f"≤ {r['target_us']:.0f}"
        span = " / ".join(f"{r[k + '_gpu_span_us']:.1f}" if k + "_gpu_span_us" in r else "-"
                          for k in ("packed", "launched", "direct", "atom"))
        print(f"| {r['bs']} | {target} | **{p:.1f}** | {r['launched_us']:.1f} "
              f"({r['launched_us'] / p:.1f}x) | {r['direct_us']:.1f} "
              f"({r['direct_us'] / p:.1f}x) | {r['atom_us']:.1f} ({r['atom_us'] / p:.1f}x) | "
              f"{dmas:.0f} + {scatters:.0f} (direct copies {copies:.0f}) | {span} |")


if __name__ == "__main__":
    main()
