"""The main job's decode loops: one per model family and way (``decode_bench.py`` times
them). Import after ``repo_paths.use_sources()`` and, on CPU, with ``TRITON_INTERPRET=1``
set (``decode_bench`` does both)."""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from decode_runner.mtp import MtpConfig, MtpRunner
from decode_runner.runner import DecodeRunner, RunnerConfig
from decode_runner.scheduler import steady_decode_batches, steady_decode_num_pages
from decode_runner.v41 import V41Config, V41Runner
from peers.atom_style import PageLists

from block_tables import BlockTable
from h2d_runner_adapters import (
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
    work (its waits left out); ``extra(row, args)``, family-specific CUDA figures;
    ``isolated()``, the next step's metadata alone (publication and first consumers, no
    model: the isolated step, measured in the same process as the loop)."""

    runner: Any
    step: Callable[[], float]
    wait_ns: Callable[[], int]
    counters: Callable[[], dict[str, float]] = field(default=lambda: {})
    prefetch: Callable[[int], None] = field(default=lambda n: None)
    host_step_ns: Callable[[], int] | None = None
    extra: Callable[[dict[str, Any], argparse.Namespace], dict[str, Any]] | None = None
    isolated: Callable[[], None] | None = None


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
                prefetch, isolated=None if runner.atom else lambda: runner.decode_metadata(take()))


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
def _model_loop(d: Any, groups: tuple[str, ...],
                isolated: Callable[[], None] | None = None) -> Loop:
    """The ``Loop`` of a model family's decode (``llama_family.LlamaDecode`` or its
    subclass), the library's counters over ``groups``."""
    return Loop(d.runner, d.step, d.wait_ns,
                lambda: _library_counters(d.runner.state, groups), d.prefetch,
                d.host_step_ns, d.extra, isolated)


def llama_loop(way: str, bs: int, args: argparse.Namespace, sync: bool) -> Loop:
    """The Llama-3.2-1B-shaped decode loop on ``way`` (``llama_family.LlamaDecode``)."""
    import llama_family

    d = llama_family.LlamaDecode(way, bs, args, sync=sync)
    return _model_loop(d, (DECODE_STEP,), None if way == "atom" else d.isolated)


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
