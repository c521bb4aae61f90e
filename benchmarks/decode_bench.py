"""The main job: end-to-end decode loops per model family, three ways in one process.

Families (each a runner of ``tests-integration/decode_runner``, CUDA graphs where the
runner has them):

* ``mha``: plain paged-attention decode (``DecodeRunner``), 1/16 of the rows append a page
  each step, deferred token ids;
* ``v41``: DeepSeek-V4.1-shaped decode (``V41Runner``): ``token_inputs`` + ``v41_metadata``
  (two groups), their first consumers and a compressed-attention stand-in, 256-token blocks;
* ``mtp``: MHA + MTP (``MtpRunner``, k=1): a verify step (one group: sampling, tokens,
  speculative indices, MHA metadata), acceptance, and the draft loop (no upload);
* ``gdn``: GDN + MTP: as ``mtp`` with GDN state indices riding in the verify group;
* ``deepseek_v4`` (not in the default set): transformers' ``DeepseekV4ForCausalLM`` (8
  layers on CUDA: sliding-window, compressed-sparse rate 4 and heavily-compressed rate
  128; fp32, eager) decoded by ``DeepseekV4Runner`` through ``token_inputs`` +
  ``v41_metadata`` and their first consumers, 256-token blocks; its rows add tokens per
  second and the metadata's share of the step's host work, as the Llama rows do. See
  ``deepseek_v4_family.py``;
* ``llama`` / ``llama_sync`` (not in the default set): a transformers ``LlamaForCausalLM``,
  Llama-3.2-1B-shaped random weights on CUDA, decoded by ``DecodeRunner`` over a paged KV
  cache through the published metadata, one graph per padded bucket, 128K-capable block
  tables; ``llama_sync`` reads each step's ids back (a synchronous engine loop). Their
  rows add tokens per second, the whole step's host µs and the metadata's share of it,
  and on CUDA the step's GPU busy µs and the GPU idle µs per step (wall less busy). See
  ``llama_family.py``, which also holds ``--ttft``: time to first token on a
  prefill-heavy workload (2K-8K-token prompts, chunked prefill), packed vs direct.

Ways, interleaved by chunks (the lent host's speed drifts between and within processes):

* ``packed``: this library (one DMA + one scatter per group);
* ``direct``: the same code with ``backend="direct"`` (one copy per member);
* ``atom``: the ATOM-style step (the host builds every array, one copy each). For ``mha``
  it publishes into the runner's destinations and its steps' logits equal packed's (the
  tests check it); for ``v41``/``deepseek_v4``/``mtp``/``gdn`` it is the ATOM-style host
  step of
  ``v41_step.py``/``mtp_step.py`` into its own destinations and the model runs over the
  destinations as last published: its host time, copies and GPU span are ATOM's, its
  values are not consumed.

Per family, batch size and way:

* H2D copies and kernels per step from a ``torch.profiler`` trace, **by copy kind**: the
  source and destination memory kinds the runtime reports for each memcpy (an H2D copy is
  one from pinned or pageable host memory to the device, whatever its label says);
* host µs of the step's metadata work, every way to the same point: its first consumers'
  work enqueued (the library: ``begin()`` through ``finish()`` and the first consumers'
  launches, less the wait for source reuse, reported apart; the ATOM-style ways build
  those arrays on the host). p50 over every timed step, and the spread: the lowest and
  highest chunk median;
* GPU span µs: CUDA events from the first publication work through the first consumers and
  the model's first kernel (the embedding gather of the step's ids, run eagerly in this
  pass), each step queued behind a sleep longer than the way's host time, so the span is
  GPU work, not host gaps (except where a way itself waits on the GPU: the ATOM-style GDN
  step's ``.item()``). The ATOM-style V4.1 and MTP ways have no first consumers of ours:
  their host builds those arrays;
* ms per output token: wall time per step (chunks of steps, synchronized at their end;
  the scheduler's inputs built before each chunk) over the tokens each request gains per
  step (1; for MTP 1 + the accepted drafts, the packed way's for the ATOM-style way, whose
  values are not consumed).

Ratios are way / packed. Without a GPU a small CPU configuration runs (Triton kernels in the
interpreter): it checks that every loop and way runs, but its figures predict no GPU host
(the packed scatter runs on the host there, and every "copy" is a memcpy). Writes
``decode_bench.json`` and ``decode_bench.png`` into ``--out`` (default ``results/``) and
prints the tables last.

    python benchmarks/decode_bench.py [--families mha,v41,mtp,gdn,deepseek_v4,llama,...]
        [--batch-sizes 1,8,64,256] [--rounds 4] [--chunk 50] [--ttft] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("H2D_BENCH_FORCE_CPU"):
    import torch as _torch_probe

    _CUDA = _torch_probe.cuda.is_available()
else:
    _CUDA = False
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the consumers run interpreted

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from repo_paths import use_sources  # noqa: E402

use_sources()

from decode_runner.mtp import MtpConfig, MtpRunner  # noqa: E402
from decode_runner.runner import DecodeRunner, RunnerConfig  # noqa: E402
from decode_runner.scheduler import steady_decode_batches, steady_decode_num_pages  # noqa: E402
from decode_runner.v41 import V41Config, V41Runner  # noqa: E402
from peers.atom_style import PageLists  # noqa: E402
from span_sleep import sleep_cycles  # noqa: E402
from trace_counts import count_per_step  # noqa: E402

from block_tables import BlockTable  # noqa: E402
from h2d_runner_adapters import (  # noqa: E402
    DECODE_STEP,
    TOKEN_INPUTS,
    V4_BLOCK,
    V41_METADATA,
    ScheduledBatch,
    SpanColumns,
)

FAMILIES = ("mha", "v41", "mtp", "gdn", "deepseek_v4", "llama", "llama_sync")
DEFAULT_FAMILIES = FAMILIES[:4]
WAYS = ("packed", "direct", "atom")
PAGE = 16
WINDOW = 512  # steady MHA rows restart every WINDOW steps (new table versions)


@dataclass
class Loop:
    """One family's decode loop on one way.

    ``step()`` runs a step and returns the tokens each request gained; ``wait_ns()`` the
    last step's wait for source reuse; ``counters()`` the library's own per-step counts;
    ``prefetch(n)`` builds the next ``n`` steps' scheduler inputs ahead (outside any
    timing). ``runner`` holds ``host_metadata_ns``, ``span_events`` and
    ``span_through_model``. Optional: ``host_step_ns()``, the last step's whole host
    work (its waits left out); ``extra(row, args)``, family-specific CUDA figures."""

    runner: Any
    step: Callable[[], float]
    wait_ns: Callable[[], int]
    counters: Callable[[], dict[str, float]] = field(default=lambda: {})
    prefetch: Callable[[int], None] = field(default=lambda n: None)
    host_step_ns: Callable[[], int] | None = None
    extra: Callable[[dict[str, Any], argparse.Namespace], dict[str, Any]] | None = None


def _queued(make: Callable[[], Any]) -> tuple[Callable[[], Any], Callable[[int], None]]:
    """``(take, prefetch)`` over ``make``: ``prefetch(n)`` queues ``n`` items ahead."""
    queue: deque[Any] = deque()

    def take() -> Any:
        return queue.popleft() if queue else make()

    def prefetch(n: int) -> None:
        while len(queue) < n:
            queue.append(make())

    return take, prefetch


def _library_counters(state: Any, groups: tuple[str, ...]) -> dict[str, float]:
    """DMAs, scatters and direct copies per step of the step's publication groups (the
    library's own counters, beside the profiler's counts)."""
    out = {"dmas": 0.0, "scatters": 0.0, "direct_copies": 0.0}
    steps = max(state.counters(groups[0]).publications, 1)
    for group in groups:
        c = state.counters(group)
        out["dmas"] += c.dmas
        out["scatters"] += c.scatters
        out["direct_copies"] += c.direct_copies
    return {k: v / steps for k, v in out.items()}


# -- plain MHA ---------------------------------------------------------------------------
def mha_config(bs: int, context: int, cuda: bool) -> RunnerConfig:
    """The MHA family's runner: a 2-layer paged decoder (fp16 on the GPU), one graph."""
    per_row = -(-(context + PAGE - 1 + WINDOW) // PAGE)
    return RunnerConfig(
        max_reqs=bs, max_tokens=bs, max_pages_per_req=per_row, page_size=PAGE,
        num_pages=steady_decode_num_pages(bs, context, PAGE, WINDOW),
        vocab=4096 if cuda else 512, hidden=256 if cuda else 32, layers=2,
        heads=4 if cuda else 2, head_dim=64 if cuda else 16,
        dtype=torch.float16 if cuda else torch.float32, graph_sizes=(bs,) if cuda else (),
        seed=1, num_slots=2)  # two slots: the host prepares step N+1 while the GPU runs N


def mha_batches(bs: int, context: int) -> Iterator[ScheduledBatch]:
    """The MHA family's steady decode batches (see ``steady_decode_batches``), their
    columns and rows built as they are yielded: the scheduler's side, outside any timing."""
    for b in steady_decode_batches(bs, context, PAGE, window=WINDOW, graph_sizes=(bs,)):
        b.columns, b.block_tables  # noqa: B018
        yield b


def mha_loop(way: str, bs: int, args: argparse.Namespace) -> Loop:
    """The plain-MHA decode loop on ``way`` (the ATOM-style way publishes into the runner's
    destinations: its steps are the packed steps' bit for bit)."""
    runner = DecodeRunner(mha_config(bs, args.context, args.cuda), args.device, way)
    batches = mha_batches(bs, args.context)
    take, prefetch = _queued(lambda: next(batches))

    def step() -> float:
        runner.step(take())
        return 1.0

    def wait() -> int:
        return runner.atom.last_wait_ns if runner.atom else runner.state.last_source_wait_ns

    return Loop(runner, step, wait, lambda: _library_counters(runner.state, (DECODE_STEP,)),
                prefetch)


# -- DeepSeek V4.1 -----------------------------------------------------------------------
class V41Steady:
    """``bs`` requests near ``context`` tokens, one token a step; 1/16 of them cross into a
    new 256-token block each 16 steps; every ``window`` steps the rows restart."""

    def __init__(self, bs: int, context: int, per_row: int, window: int = 1024) -> None:
        self.bs, self.per_row, self.window = bs, per_row, window
        self.start = np.array([context - V4_BLOCK + 1 + (i * 16) % V4_BLOCK
                               for i in range(bs)], np.int32)
        self.ctx = self.start.copy()
        self.steps = 0
        self.tables = [self._table(i, int(c)) for i, c in enumerate(self.ctx)]
        self.lists = PageLists()  # the scheduler's Python page lists, for the ATOM-style way
        self.slots = np.arange(bs, dtype=np.int32)
        self.ids = np.zeros(bs, np.int32)

    def _table(self, row: int, ctx: int) -> BlockTable:
        base = 1 + row * self.per_row  # block 0 is the runner's dummy
        return BlockTable(range(base, base + -(-ctx // V4_BLOCK)))

    def step(self) -> tuple[SpanColumns, list[BlockTable], list[list[int]]]:
        """The next step's spans, block-table rows and the rows as Python page lists."""
        self.steps += 1
        if self.steps % self.window == 0:
            self.ctx[:] = self.start
            self.tables = [self._table(i, int(c)) for i, c in enumerate(self.ctx)]
        self.ctx += 1
        for i in range(self.bs):
            if -(-int(self.ctx[i]) // V4_BLOCK) > len(self.tables[i]):
                t = self.tables[i].lineage_copy()
                t.append_one(1 + i * self.per_row + len(t))
                self.tables[i] = t
        q = np.ones(self.bs, np.int32)
        return (SpanColumns(q, self.ctx.copy(), self.slots, self.slots), list(self.tables),
                list(self.lists.sync(self.tables)))


def v41_loop(way: str, bs: int, args: argparse.Namespace) -> Loop:
    """The V4.1 decode loop on ``way`` (the ATOM-style way: ``v41_step.AtomStyle``'s host
    step and copies in place of the publication and the first consumers, whose arrays it
    builds on the host; its values are not consumed)."""
    import v41_step

    cuda = args.cuda
    ctx = args.v41_context
    per_row = -(-(ctx + 1024) // V4_BLOCK)
    cfg = V41Config(
        max_reqs=bs, max_tokens=bs, max_blocks=per_row, num_blocks=bs * per_row + 1,
        num_state_slots=bs, full_q=1, vocab=4096 if cuda else 256, hidden=64 if cuda else 16,
        window=v41_step.WINDOW if cuda else 8, index_topk=v41_step.TOPK if cuda else 4,
        envelope_rows=v41_step.ENVELOPE if cuda else 3, seed=1)
    runner = V41Runner(cfg, args.device, "direct" if way == "atom" else way)
    steady = V41Steady(bs, ctx, per_row)
    padded = bs if cuda else None
    if way == "atom":
        atom = v41_step.AtomStyle(bs, ctx, args.device)
        runner.step(*steady.step()[:2], steady.ids, padded)  # the destinations, once
        runner.metadata_hook = atom.step

    take, prefetch = _queued(steady.step)

    def step() -> float:
        spans, rows, lists = take()
        runner.step(spans, rows, steady.ids, padded, lists=lists)
        return 1.0

    def wait() -> int:  # the ATOM-style step waits for a free pinned source set
        return atom.last_wait_ns if way == "atom" else runner.state.last_source_wait_ns

    return Loop(runner, step, wait,
                lambda: _library_counters(runner.state, (TOKEN_INPUTS, V41_METADATA)),
                prefetch)


# -- MTP / GDN ---------------------------------------------------------------------------
def mtp_loop(way: str, bs: int, args: argparse.Namespace, gdn: bool) -> Loop:
    """The MHA+MTP (or GDN+MTP) verify + draft loop on ``way`` (the ATOM-style way:
    ``mtp_step.AtomStyle``'s host step and copies in place of the verify publication, its
    values not consumed; for GDN its host time includes the ``.item()`` that engine
    waits on, and the per-request scalar stores)."""
    import mtp_step

    cuda = args.cuda
    k = 1
    ctx = args.mtp_context
    growth = (args.total_steps + 8) * (k + 1) + 4 * k + 4
    per_row = -(-(ctx + growth) // PAGE)
    cfg = MtpConfig(
        num_reqs=bs, k=k, page_size=PAGE, num_pages=bs * per_row, max_pages_per_req=per_row,
        vocab=4096 if cuda else 256, hidden=256 if cuda else 32, layers=1,
        heads=4 if cuda else 2, head_dim=64 if cuda else 16,
        dtype=torch.float16 if cuda else torch.float32, gdn=gdn, draft_bias=1.0, seed=1,
        initial_context=ctx)
    runner = MtpRunner(cfg, args.device, "direct" if way == "atom" else way)
    if way == "atom":
        ns = SimpleNamespace(k=k, device=args.device, gdn=gdn, context=ctx + growth)
        atom = mtp_step.AtomStyle(bs, ns)
        runner.iterate()  # the destinations, once
        runner.metadata_hook = atom.step

    def step() -> float:
        runner.iterate()
        return 1.0 + float(runner.last_accepted.mean())

    def wait() -> int:  # the ATOM-style step waits for a free pinned source set
        return atom.last_wait_ns if way == "atom" else runner.state.last_source_wait_ns

    return Loop(runner, step, wait, lambda: _library_counters(runner.state, (DECODE_STEP,)))


# -- transformers models (their modules are imported on use: they need transformers) -----
def _model_loop(d: Any, groups: tuple[str, ...]) -> Loop:
    """The ``Loop`` of a model family's decode (``llama_family.LlamaDecode`` or its
    subclass), the library's counters over ``groups``."""
    return Loop(d.runner, d.step, d.wait_ns,
                lambda: _library_counters(d.runner.state, groups), d.prefetch,
                d.host_step_ns, d.extra)


def llama_loop(way: str, bs: int, args: argparse.Namespace, sync: bool) -> Loop:
    """The Llama-3.2-1B-shaped decode loop on ``way`` (``llama_family.LlamaDecode``)."""
    import llama_family

    return _model_loop(llama_family.LlamaDecode(way, bs, args, sync=sync), (DECODE_STEP,))


def deepseek_v4_loop(way: str, bs: int, args: argparse.Namespace) -> Loop:
    """The DeepSeek-V4 decode loop on ``way`` (``deepseek_v4_family.DeepseekV4Decode``;
    the ATOM-style way: ``v41_step.AtomStyle`` as the runner's ``metadata_hook``)."""
    import deepseek_v4_family

    return _model_loop(deepseek_v4_family.DeepseekV4Decode(way, bs, args),
                       (TOKEN_INPUTS, V41_METADATA))


BUILDERS: dict[str, Callable[[str, int, argparse.Namespace], Loop]] = {
    "mha": mha_loop,
    "v41": v41_loop,
    "mtp": lambda w, b, a: mtp_loop(w, b, a, gdn=False),
    "gdn": lambda w, b, a: mtp_loop(w, b, a, gdn=True),
    "deepseek_v4": deepseek_v4_loop,
    "llama": lambda w, b, a: llama_loop(w, b, a, sync=False),
    "llama_sync": lambda w, b, a: llama_loop(w, b, a, sync=True),
}


# -- measuring ---------------------------------------------------------------------------
def _chunk(loop: Loop, steps: int, cuda: bool) -> tuple[list[float], list[float], float,
                                                         float, list[float]]:
    """``steps`` steps: per-step host µs and wait µs, wall ms per step, tokens/request,
    per-step whole host µs (where the loop reports it)."""
    host, wait, whole, tokens = [], [], [], 0.0
    loop.prefetch(steps)  # the scheduler's side, outside the wall clock
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens += loop.step()
        host.append(loop.runner.host_metadata_ns / 1e3)
        wait.append(loop.wait_ns() / 1e3)
        if loop.host_step_ns is not None:
            whole.append(loop.host_step_ns() / 1e3)
    if cuda:
        torch.cuda.synchronize()
    return host, wait, (time.perf_counter() - t0) * 1e3 / steps, tokens / steps, whole


def _span(loop: Loop, steps: int, host_us: float) -> list[float]:
    """GPU µs from the first publication work through the model's first kernel."""
    cycles = sleep_cycles(host_us)  # the span is GPU work, not host gaps
    runner = loop.runner
    runner.span_through_model = True
    loop.prefetch(steps)
    evs = []
    for _ in range(steps):
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        runner.span_events = pair
        torch.cuda._sleep(cycles)
        loop.step()
        evs.append(pair)
    runner.span_events = None
    runner.span_through_model = False
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in evs]


def measure(family: str, bs: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One family at one batch size: the three ways interleaved; one row per way."""
    loops = {w: BUILDERS[family](w, bs, args) for w in WAYS}
    for loop in loops.values():
        _chunk(loop, args.warmup, args.cuda)
    host: dict[str, list[float]] = {w: [] for w in WAYS}
    wait: dict[str, list[float]] = {w: [] for w in WAYS}
    chunk_p50: dict[str, list[float]] = {w: [] for w in WAYS}
    wall: dict[str, list[float]] = {w: [] for w in WAYS}
    per_req: dict[str, list[float]] = {w: [] for w in WAYS}
    whole: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for w in (WAYS if r % 2 == 0 else WAYS[::-1]):
            h, wt, ms, tok, wh = _chunk(loops[w], args.chunk, args.cuda)
            host[w] += h
            whole[w] += wh
            wait[w] += wt
            chunk_p50[w].append(float(np.median(h)))
            wall[w].append(ms)
            per_req[w].append(tok)
    rows = []
    for w, loop in loops.items():
        hs = np.asarray(host[w])
        ms = float(np.median(wall[w]))
        tok = float(np.mean(per_req[w]))
        row: dict[str, Any] = {
            "family": family, "bs": bs, "way": w, "steps": len(hs),
            # the spread: the chunk medians' extremes (the host drifts within a process)
            "host_us_p50": float(np.median(hs)), "host_us_chunk_min": min(chunk_p50[w]),
            "host_us_chunk_max": max(chunk_p50[w]), "host_us_chunk_p50s": chunk_p50[w],
            "source_wait_us_p50": float(np.median(wait[w])),
            "step_ms": ms, "tokens_per_request_step": tok, "ms_per_output_token": ms / tok,
            "tokens_per_s": bs * tok / ms * 1e3,
            "library_per_step": loop.counters() if w != "atom" else None,
        }
        if whole[w]:  # the whole step's host work, and the metadata's share of it
            ws = np.asarray(whole[w])
            row["host_step_us_p50"] = float(np.median(ws))
            row["metadata_share_p50"] = float(np.median(hs / np.maximum(ws, 1e-3)))
        if args.cuda:
            span = _span(loop, args.span_steps, float(np.percentile(hs, 90)))
            row["gpu_span_us_p50"] = float(np.median(span))
            if loop.extra is not None:
                row.update(loop.extra(row, args))
            loop.prefetch(args.profile_steps)
            row.update(count_per_step(loop.step, args.profile_steps))
        rows.append(row)
    packed = rows[0]
    if family in ("mtp", "gdn"):
        # the ATOM-style way's values are not consumed, so its acceptance is not its own:
        # its time per output token uses the packed way's tokens per step
        atom = rows[2]
        atom["tokens_per_request_step"] = packed["tokens_per_request_step"]
        atom["ms_per_output_token"] = atom["step_ms"] / packed["tokens_per_request_step"]
    for row in rows:
        row["host_vs_packed"] = row["host_us_p50"] / packed["host_us_p50"]
        row["tpot_vs_packed"] = row["ms_per_output_token"] / packed["ms_per_output_token"]
    del loops, loop
    gc.collect()  # runners hold cycles (the ATOM-style way points back at its runner)
    if args.cuda:
        torch.cuda.empty_cache()
    return rows


# -- output ------------------------------------------------------------------------------
#: what the plot and the tables compare, and what "better" means
COMPARED = ("packed (this library: one DMA + one scatter per group) against direct (one "
            "copy per member) and atom (an ATOM-style host step), interleaved in one "
            "process; every figure is a time (lower is better), shown as way / packed: "
            "above 1 the way is slower than packed")
CPU_CAVEAT = ("CPU run (Triton interpreter, host-side scatter): it checks that the job runs "
              "and predicts no GPU host; the ATOM-style v41/mtp/gdn/deepseek_v4 ways run no "
              "consumer kernels (their host builds those arrays) while packed's run "
              "interpreted, so their ratios are not comparable")


def _plot(results: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """One row per family, one panel per figure: each way's value as a ratio to packed's
    on a linear axis (packed = 1), packed's own value under each batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in FAMILIES if any(r["family"] == f for r in results)]
    panels = [("host_us_p50", "host µs per step, metadata", "µs"),
              ("gpu_span_us_p50", "GPU span, publication → model's first kernel", "µs"),
              ("ms_per_output_token", "ms per output token", "ms")]
    if not meta["cuda"]:
        panels = panels[:1] + panels[2:]
    fig, axes = plt.subplots(len(families), len(panels), squeeze=False,
                             figsize=(5 * len(panels), 3.3 * len(families)))
    colors = {"direct": "tab:orange", "atom": "tab:gray"}
    for i, fam in enumerate(families):
        rows = [r for r in results if r["family"] == fam]
        sizes = sorted({r["bs"] for r in rows})
        x = np.arange(len(sizes))
        packed = {r["bs"]: r for r in rows if r["way"] == "packed"}
        for j, (key, title, unit) in enumerate(panels):
            ax = axes[i][j]
            for k, w in enumerate(WAYS[1:]):
                by = {r["bs"]: r for r in rows if r["way"] == w}
                ratio = [by[s][key] / packed[s][key] for s in sizes]
                bars = ax.bar(x + (k - 0.5) * 0.38, ratio, 0.38, color=colors[w], label=w)
                ax.bar_label(bars, [f"{v:.2f}x" if v < 10 else f"{v:.0f}x" for v in ratio],
                             fontsize=6)
            ax.axhline(1.0, color="tab:blue", lw=1.2, label="packed = 1")
            ax.set_xticks(x, [f"{s}\n{packed[s][key]:.3g} {unit}" for s in sizes], fontsize=7)
            ax.set_xlabel("batch size (requests); packed's own value below it", fontsize=7)
            ax.set_ylabel("way / packed (> 1: slower than packed)", fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{fam}: {title}", fontsize=9)
            ax.legend(fontsize=7)
    caveat = "" if meta["cuda"] else "\n" + CPU_CAVEAT
    fig.suptitle(f"main job, {meta['device']}, {meta['date']}: {COMPARED}{caveat}",
                 fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(results: list[dict[str, Any]], cuda: bool) -> str:
    lines = [f"Compared: {COMPARED}." + ("" if cuda else f" {CPU_CAVEAT}.")]
    for fam in DEFAULT_FAMILIES:
        rows = [r for r in results if r["family"] == fam]
        if not rows:
            continue
        lines.append(f"\n{fam}: host µs p50 [chunk medians' min-max] (x = way / packed), GPU "
                     "span µs p50, H2D + kernels per step (profiler, by copy kind), ms per "
                     "output token")
        lines.append("| bs | way | host µs | GPU span µs | H2D + kernels | ms/token |")
        lines.append("|---:|---|---:|---:|---|---:|")
        for r in rows:
            span = f"{r['gpu_span_us_p50']:.1f}" if "gpu_span_us_p50" in r else "-"
            counts = (f"{r['h2d_per_step']:.0f} + {r['kernels_per_step']:.0f}"
                      if "h2d_per_step" in r else "-")
            lines.append(
                f"| {r['bs']} | {r['way']} | {r['host_us_p50']:.1f} "
                f"[{r['host_us_chunk_min']:.1f}-{r['host_us_chunk_max']:.1f}] "
                f"({r['host_vs_packed']:.1f}x) | {span} | {counts} | "
                f"{r['ms_per_output_token']:.3f} ({r['tpot_vs_packed']:.2f}x) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                    help=f"comma-separated, of {','.join(FAMILIES)}")
    ap.add_argument("--batch-sizes", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--context", type=int, default=None,
                    help="MHA and Llama decode tokens per request")
    ap.add_argument("--ttft", action="store_true",
                    help="also time to first token on the Llama prefill-heavy workload")
    ap.add_argument("--ttft-reps", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    cuda = args.cuda = _CUDA
    args.device = "cuda" if cuda else "cpu"
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    sizes = [int(s) for s in (args.batch_sizes or ("1,8,64,256" if cuda else "1,8")).split(",")]
    args.rounds = args.rounds or (4 if cuda else 2)
    args.chunk = args.chunk or (50 if cuda else 3)
    args.warmup = args.warmup or (20 if cuda else 2)
    args.span_steps = 40 if cuda else 0
    args.profile_steps = 5
    args.context = args.context or (1024 if cuda else 64)
    args.v41_context = 32768 if cuda else 600
    args.mtp_context = 1024 if cuda else 40
    args.total_steps = args.warmup + args.rounds * args.chunk + args.span_steps + \
        args.profile_steps + 2
    args.page, args.window = PAGE, WINDOW
    args.ttft_reps = args.ttft_reps or (5 if cuda else 1)
    llama = args.ttft or any(f.startswith("llama") for f in families)
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or 'host'})"
    if not cuda:
        print("No CUDA device: running the small CPU configuration. It checks that every "
              "loop and way runs; its figures predict no GPU host (the packed scatter runs "
              "on the host here, every copy is a memcpy, kernels are interpreted).",
              flush=True)
        torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__,
            "cuda": cuda, "mha_context": args.context, "v41_context": args.v41_context,
            "mtp_context": args.mtp_context, "rounds": args.rounds, "chunk": args.chunk,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    output: dict[str, Any] = {"meta": meta}
    if llama:
        import llama_family

        meta["llama"] = llama_family.describe(args, sizes)
    if "deepseek_v4" in families:
        import deepseek_v4_family

        meta["deepseek_v4"] = deepseek_v4_family.describe(args, sizes)
    results: list[dict[str, Any]] = []
    output["results"] = results
    for fam in families:
        for bs in sizes:
            t = time.perf_counter()
            rows = measure(fam, bs, args)
            results += rows
            print(f"{fam} bs={bs}: " + ", ".join(
                f"{r['way']} {r['host_us_p50']:.1f} µs" for r in rows)
                + f" ({time.perf_counter() - t:.1f} s)", flush=True)
            # written after every size: an interrupted run keeps what it measured
            (out / "decode_bench.json").write_text(json.dumps(output, indent=1))
    if args.ttft:
        t = time.perf_counter()
        output["ttft"] = llama_family.measure_ttft(args)
        print("llama TTFT p50: " + ", ".join(
            f"{w} {r['ttft_ms']['p50']:.1f} ms" for w, r in output["ttft"]["ways"].items())
            + f" ({time.perf_counter() - t:.1f} s)", flush=True)
        (out / "decode_bench.json").write_text(json.dumps(output, indent=1))
    written = str(out / "decode_bench.json")
    try:
        if results:
            _plot(results, out / "decode_bench.png", meta)
            written += f", {out / 'decode_bench.png'}"
    except ImportError:
        print("matplotlib is not installed: no plot written", flush=True)
    print(f"\nresults: {written}")
    print(f"device: {device}; torch {torch.__version__}; {args.rounds} rounds x {args.chunk} "
          "steps per way, interleaved")
    print(_table(results, cuda))
    if "deepseek_v4" in families:
        print(deepseek_v4_family.table(results, cuda))
    if llama:
        print(llama_family.table(results, cuda))
        if args.ttft:
            print(llama_family.ttft_table(output["ttft"]))


if __name__ == "__main__":
    main()
