"""Scheduler simulation: requests arrive, prefill in chunks, decode, finish.

Drives the integration decode runner with :class:`ScheduledBatch` steps the way an
engine's scheduler would, with the events that stress metadata publication:

* block tables grow by appends that keep their lineage (the scheduler hands every batch a
  :meth:`BlockTable.lineage_copy`, so older batches never change);
* tables are replaced by modification: a preempted request's table is truncated to nothing
  and refilled when it is re-admitted (recompute), and a migrated page is overwritten in
  place (the KV copy the runner must apply is in ``extras["kv_page_moves"]``);
* batch membership and order change: requests finish and arrive, and the running set is
  occasionally permuted.

The schedule depends only on the config (its seed); the sampled ids the caller feeds back
only fill the token contents. So the same config and the same sampled ids give the same
batches, and two runners that sample differently still see the same batch shapes.

Only numpy and ``block_tables``: no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from block_tables import BlockTable
from h2d_runner_adapters.batch import SamplingParams, ScheduledBatch, ScheduledRequest

__all__ = [
    "DEFERRED_PLACEHOLDER",
    "ArrivalPattern",
    "FeedbackError",
    "SamplingMix",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerError",
    "SchedulerStats",
    "padded_size",
    "steady_decode_batches",
    "steady_decode_num_pages",
]

DEFERRED_PLACEHOLDER = 0
"""Host-staged id of a deferred decode token; token assembly overwrites it on the GPU."""

_STALL_TICKS = 10_000


class SchedulerError(Exception):
    """Base class of the scheduler simulation's errors."""


class SchedulerConfigError(SchedulerError, ValueError):
    """A :class:`SchedulerConfig` field is out of range or inconsistent."""


class FeedbackError(SchedulerError, ValueError):
    """``Scheduler.step`` got sampled ids that do not match the previous batch."""


def padded_size(num_reqs: int, graph_sizes: Sequence[int]) -> int | None:
    """Smallest captured graph size ``>= num_reqs``; None above the largest (run eager)."""
    best: int | None = None
    for size in graph_sizes:
        if size >= num_reqs and (best is None or size < best):
            best = size
    return best


@dataclass(frozen=True)
class ArrivalPattern:
    """When requests arrive, in scheduler ticks.

    ``initial`` requests wait at tick 0. Then ``"poisson"`` draws Poisson(``rate``) arrivals
    per tick, and ``"burst"`` brings ``burst_size`` every ``burst_every`` ticks.
    """

    kind: Literal["poisson", "burst"] = "poisson"
    initial: int = 4
    rate: float = 0.5
    burst_size: int = 4
    burst_every: int = 16


@dataclass(frozen=True)
class SamplingMix:
    """Per-request sampling parameters drawn at arrival.

    A ``greedy_fraction`` of requests are greedy; of the rest, ``per_request_fraction``
    draw their own top-k/top-p (uploaded per request), the others share the uniform
    ``uniform_top_k``/``uniform_top_p`` (CPU scalars when a whole batch shares them).
    """

    greedy_fraction: float = 0.5
    per_request_fraction: float = 0.5
    uniform_top_k: int = -1
    uniform_top_p: float = 1.0
    temperature_range: tuple[float, float] = (0.5, 1.5)


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything that shapes a simulated run; ranges are inclusive ``(low, high)``."""

    seed: int = 0
    page_size: int = 16
    num_pages: int = 256
    #: most requests running (prefilling or decoding) at once, so the largest decode batch
    max_batch: int = 8
    #: query tokens of one prefill step, summed over its requests
    prefill_chunk_tokens: int = 64
    prompt_len: tuple[int, int] = (1, 48)
    output_len: tuple[int, int] = (1, 32)
    num_requests: int = 32
    arrival: ArrivalPattern = field(default_factory=ArrivalPattern)
    sampling: SamplingMix = field(default_factory=SamplingMix)
    vocab_size: int = 1000
    #: captured decode graph sizes; decode batches get ``padded_size`` from them
    graph_sizes: tuple[int, ...] = (1, 2, 4, 8)
    #: while requests decode, a prefill step runs at most once per this many steps
    prefill_interval: int = 2
    #: per-tick chance of preempting a running request (recompute: a new table version)
    preempt_prob: float = 0.02
    #: per-tick chance of migrating one page of a running request (a new table version)
    migrate_prob: float = 0.05
    #: per-tick chance of permuting the running requests' order
    reorder_prob: float = 0.1

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise SchedulerConfigError(f"SchedulerConfig.{what}; fix the config")

        need(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        need(self.num_pages >= 1, f"num_pages must be >= 1, got {self.num_pages}")
        need(self.max_batch >= 1, f"max_batch must be >= 1, got {self.max_batch}")
        need(self.prefill_chunk_tokens >= 1,
             f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            need(1 <= lo <= hi, f"{name} must be (low, high) with 1 <= low <= high, got "
                 f"{(lo, hi)}")
        need(self.num_requests >= 0, f"num_requests must be >= 0, got {self.num_requests}")
        need(self.vocab_size >= 1, f"vocab_size must be >= 1, got {self.vocab_size}")
        need(all(s >= 1 for s in self.graph_sizes),
             f"graph_sizes must be >= 1, got {self.graph_sizes}")
        need(self.prefill_interval >= 1,
             f"prefill_interval must be >= 1, got {self.prefill_interval}")
        for name in ("preempt_prob", "migrate_prob", "reorder_prob"):
            p = getattr(self, name)
            need(0.0 <= p <= 1.0, f"{name} must lie in [0, 1], got {p}")
        a = self.arrival
        need(a.kind in ("poisson", "burst"), f"arrival.kind must be 'poisson' or 'burst', "
             f"got {a.kind!r}")
        need(a.initial >= 0, f"arrival.initial must be >= 0, got {a.initial}")
        if self.num_requests > a.initial:
            if a.kind == "poisson":
                need(a.rate > 0.0, f"arrival.rate must be > 0 to bring {self.num_requests} "
                     f"requests, got {a.rate}")
            else:
                need(a.burst_size >= 1 and a.burst_every >= 1,
                     f"arrival.burst_size and burst_every must be >= 1, got "
                     f"{a.burst_size}, {a.burst_every}")
        s = self.sampling
        need(0.0 <= s.greedy_fraction <= 1.0 and 0.0 <= s.per_request_fraction <= 1.0,
             "sampling fractions must lie in [0, 1]")
        need(0.0 < s.temperature_range[0] <= s.temperature_range[1],
             f"sampling.temperature_range must be (low, high) with 0 < low <= high, got "
             f"{s.temperature_range}")
        need(self.max_pages_per_request <= self.num_pages,
             f"num_pages={self.num_pages} cannot hold one request of the longest prompt and "
             f"output ({self.max_pages_per_request} pages); raise num_pages or shorten them")

    @property
    def max_context_len(self) -> int:
        """Longest context any step can have (the last sampled token is never fed back)."""
        return self.prompt_len[1] + self.output_len[1] - 1

    @property
    def max_pages_per_request(self) -> int:
        """Most pages one request's table holds: the model's ``max_pages`` bound."""
        return -(-self.max_context_len // self.page_size)


class _Request:
    """Mutable per-request state; never leaves the scheduler."""

    __slots__ = (
        "admitted",
        "generated",
        "in_prefill",
        "last_sample",
        "num_computed",
        "output_len",
        "req_id",
        "sampling",
        "table",
        "tokens",
    )

    def __init__(self, req_id: int, prompt: list[int], output_len: int,
                 sampling: SamplingParams) -> None:
        self.req_id = req_id
        self.tokens = prompt  # prompt + every sampled output so far
        self.output_len = output_len
        self.sampling = sampling
        self.generated = 0
        self.num_computed = 0  # tokens whose K/V a scheduled step writes
        self.in_prefill = True
        self.table = BlockTable()
        self.admitted = -1  # admission order; the latest admitted is preempted first
        self.last_sample: tuple[int, int] = (-1, -1)  # (batch index, row) of the last sample


@dataclass
class SchedulerStats:
    """Counters of the events a run went through."""

    batches: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    deferred_rows: int = 0
    host_rows: int = 0
    finished: int = 0
    preemptions: int = 0
    migrations: int = 0
    reorders: int = 0


class Scheduler:
    """Simulated continuous-batching scheduler; see the module docstring.

    Call :meth:`step` with ``None`` first, then with the sampled ids of each returned batch
    (one per row, in row order; prefill rows whose prompt is not complete yet are ignored
    but still need a value) until it returns None.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self._free: deque[int] = deque(range(config.num_pages))
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._arrived = 0
        self._admissions = 0
        self._tick = 0
        self._batch_index = 0
        self._steps_since_prefill = config.prefill_interval
        self._prev: list[tuple[_Request, bool]] | None = None  # rows of the last batch
        self._moves: list[tuple[int, int]] = []
        self._preempted: list[int] = []
        self._migrated: list[int] = []
        self._finished: list[int] = []
        #: finished requests: their tokens (prompt + outputs) and how many were generated
        self._sequences: dict[int, tuple[list[int], int]] = {}
        self._arrived_ids: list[int] = []
        self.stats = SchedulerStats()

    # -- public ---------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every request arrived and finished."""
        return (self._arrived == self.config.num_requests and not self._waiting
                and not self._running)

    def finished_sequences(self) -> dict[int, tuple[list[int], list[int]]]:
        """Every finished request's (prompt, generated tokens), by request id."""
        return {i: (t[: len(t) - g], t[len(t) - g:]) for i, (t, g) in self._sequences.items()}

    @property
    def free_page_count(self) -> int:
        return len(self._free)

    def page_owners(self) -> dict[int, int]:
        """Page id -> req_id of every page a request's table holds (pages may not repeat)."""
        owners: dict[int, int] = {}
        for req in (*self._running, *self._waiting):
            for page in req.table.tolist():
                if page in owners:
                    raise SchedulerError(
                        f"page {page} is held by requests {owners[page]} and {req.req_id}; "
                        "the page pool lost track of it"
                    )
                owners[page] = req.req_id
        return owners

    def step(self, sampled: Sequence[int] | None = None) -> ScheduledBatch | None:
        """Feed back the previous batch's sampled ids; return the next batch or None."""
        self._check_feedback(sampled)
        self._apply_feedback(sampled)
        stalled = 0
        while not self.done:
            self._arrive()
            self._events()
            batch = self._schedule()
            self._tick += 1
            if batch is not None:
                return batch
            stalled = stalled + 1 if self._running else 0
            if stalled > _STALL_TICKS:
                raise SchedulerError(
                    f"no batch for {_STALL_TICKS} ticks with {len(self._running)} requests "
                    "running; the page pool is too small for the running set"
                )
        self._prev = None
        return None

    # -- feedback -------------------------------------------------------------------------

    def _check_feedback(self, sampled: Sequence[int] | None) -> None:
        if self._prev is None:
            if sampled is not None:
                raise FeedbackError(
                    f"step() got {len(sampled)} sampled ids but no batch is outstanding; "
                    "pass None on the first call and after step() returned None"
                )
            return
        if sampled is None:
            raise FeedbackError(
                f"step() got None but batch {self._batch_index - 1} has {len(self._prev)} "
                "rows; pass one sampled id per row of the previous batch"
            )
        if len(sampled) != len(self._prev):
            raise FeedbackError(
                f"step() got {len(sampled)} sampled ids for batch {self._batch_index - 1} of "
                f"{len(self._prev)} rows; pass one id per row, in row order"
            )
        vocab = self.config.vocab_size
        for row, tok in enumerate(sampled):
            if not 0 <= int(tok) < vocab:
                raise FeedbackError(
                    f"sampled id {int(tok)} of row {row} lies outside the vocabulary "
                    f"[0, {vocab}); pass the ids the runner sampled"
                )

    def _apply_feedback(self, sampled: Sequence[int] | None) -> None:
        if self._prev is None or sampled is None:
            return
        for (req, samples), tok in zip(self._prev, sampled, strict=True):
            if not samples or req not in self._running:
                continue
            req.tokens.append(int(tok))
            req.generated += 1
            if req.generated >= req.output_len:
                self._finish(req)
        self._prev = None

    def _finish(self, req: _Request) -> None:
        self._running.remove(req)
        self._free.extend(req.table.tolist())
        req.table.clear()
        self._finished.append(req.req_id)
        self._sequences[req.req_id] = (list(req.tokens), req.generated)
        self.stats.finished += 1

    # -- arrivals and random events -------------------------------------------------------

    def _arrive(self) -> None:
        a = self.config.arrival
        if self._tick == 0:
            count = a.initial
        elif a.kind == "poisson":
            count = int(self._rng.poisson(a.rate))
        else:
            count = a.burst_size if self._tick % a.burst_every == 0 else 0
        count = min(count, self.config.num_requests - self._arrived)
        for _ in range(count):
            self._waiting.append(self._new_request())

    def _new_request(self) -> _Request:
        cfg, rng = self.config, self._rng
        prompt_len = int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
        output_len = int(rng.integers(cfg.output_len[0], cfg.output_len[1] + 1))
        prompt = rng.integers(0, cfg.vocab_size, size=prompt_len).tolist()
        mix = cfg.sampling
        if rng.random() < mix.greedy_fraction:
            sampling = SamplingParams(temperature=0.0)
        else:
            temperature = float(rng.uniform(*mix.temperature_range))
            if rng.random() < mix.per_request_fraction:
                sampling = SamplingParams(
                    temperature=temperature,
                    top_k=int(rng.integers(1, cfg.vocab_size + 1)),
                    top_p=float(rng.uniform(0.5, 1.0)),
                )
            else:
                sampling = SamplingParams(temperature=temperature, top_k=mix.uniform_top_k,
                                          top_p=mix.uniform_top_p)
        req = _Request(self._arrived, prompt, output_len, sampling)
        self._arrived += 1
        self._arrived_ids.append(req.req_id)
        return req

    def _events(self) -> None:
        cfg, rng = self.config, self._rng
        # Three draws every tick whatever happens, so one event never shifts the others.
        u_preempt, u_migrate, u_reorder = rng.random(3)
        if u_preempt < cfg.preempt_prob and self._running:
            self._preempt(self._running[int(rng.integers(len(self._running)))])
        if u_migrate < cfg.migrate_prob and self._free:
            holders = [r for r in self._running if len(r.table)]
            if holders:
                self._migrate(holders[int(rng.integers(len(holders)))])
        if u_reorder < cfg.reorder_prob and len(self._running) > 1:
            order = rng.permutation(len(self._running))
            self._running = [self._running[i] for i in order]
            self.stats.reorders += 1

    def _preempt(self, req: _Request) -> None:
        """Drop the request's KV and requeue it to recompute everything it knows."""
        self._running.remove(req)
        self._free.extend(req.table.tolist())
        req.table.clear()  # the same table object, a new version: a modification
        req.num_computed = 0
        req.in_prefill = True
        self._waiting.appendleft(req)
        self._preempted.append(req.req_id)
        self.stats.preemptions += 1

    def _migrate(self, req: _Request) -> None:
        index = int(self._rng.integers(len(req.table)))
        new = self._free.popleft()
        old = req.table[index]
        req.table[index] = new  # item assignment draws a new version
        self._free.append(old)
        self._moves.append((old, new))
        self._migrated.append(req.req_id)
        self.stats.migrations += 1

    # -- scheduling -----------------------------------------------------------------------

    def _pages_for(self, context_len: int) -> int:
        return -(-context_len // self.config.page_size)

    def _admit(self) -> None:
        cfg = self.config
        while self._waiting and len(self._running) < cfg.max_batch:
            req = self._waiting[0]
            # The whole prefill plus the first decode token must fit now.
            if self._pages_for(len(req.tokens) + 1) > len(self._free):
                break
            self._waiting.popleft()
            req.admitted = self._admissions
            self._admissions += 1
            self._running.append(req)

    def _grow(self, req: _Request, context_len: int, protected: list[_Request]) -> bool:
        """Give ``req`` pages for ``context_len`` tokens, preempting the latest admitted
        unprotected request while the pool is short; False if ``req`` itself was."""
        need = self._pages_for(context_len) - len(req.table)
        while need > len(self._free):
            victims = [r for r in self._running if r is not req and r not in protected]
            victim = max(victims, key=lambda r: r.admitted) if victims else req
            self._preempt(victim)
            if victim is req:
                return False
        if need == 1:
            req.table.append_one(self._free.popleft())
        elif need > 1:
            req.table.append([self._free.popleft() for _ in range(need)])
        return True

    def _schedule(self) -> ScheduledBatch | None:
        self._admit()
        prefilling = [r for r in self._running if r.in_prefill]
        decoding = [r for r in self._running if not r.in_prefill]
        if prefilling and (not decoding
                           or self._steps_since_prefill >= self.config.prefill_interval):
            rows = self._prefill_rows(prefilling)
            if rows:
                return self._emit(rows, is_prefill=True)
        if decoding:
            rows = self._decode_rows(decoding)
            if rows:
                return self._emit(rows, is_prefill=False)
        return None

    def _prefill_rows(self, prefilling: list[_Request]) -> list[tuple[_Request, ScheduledRequest,
                                                                      bool]]:
        budget = self.config.prefill_chunk_tokens
        rows: list[tuple[_Request, ScheduledRequest, bool]] = []
        scheduled: list[_Request] = []
        for req in prefilling:
            if budget == 0:
                break
            if req not in self._running:  # preempted to make room for an earlier row
                continue
            start = req.num_computed
            n = min(len(req.tokens) - start, budget)
            if not self._grow(req, start + n, scheduled):
                continue
            budget -= n
            scheduled.append(req)
            req.num_computed = start + n
            completes = req.num_computed == len(req.tokens)
            if completes:
                req.in_prefill = False
            rows.append((req, ScheduledRequest(
                req_id=req.req_id,
                num_tokens=n,
                context_len=start + n,
                block_table=req.table.lineage_copy(),
                sampling=req.sampling,
                token_ids=tuple(req.tokens[start:start + n]),
            ), completes))
        return rows

    def _decode_rows(self, decoding: list[_Request]) -> list[tuple[_Request, ScheduledRequest,
                                                                    bool]]:
        rows: list[tuple[_Request, ScheduledRequest, bool]] = []
        scheduled: list[_Request] = []
        previous = self._batch_index - 1
        for req in decoding:
            if req not in self._running:
                continue
            context_len = len(req.tokens)  # the last sampled token is fed now
            if not self._grow(req, context_len, scheduled):
                continue
            scheduled.append(req)
            req.num_computed = context_len
            batch_index, row = req.last_sample
            if batch_index == previous:
                prev_row, token_ids = row, (DEFERRED_PLACEHOLDER,)
                self.stats.deferred_rows += 1
            else:
                prev_row, token_ids = -1, (req.tokens[-1],)
                self.stats.host_rows += 1
            rows.append((req, ScheduledRequest(
                req_id=req.req_id,
                num_tokens=1,
                context_len=context_len,
                block_table=req.table.lineage_copy(),
                sampling=req.sampling,
                token_ids=token_ids,
                prev_sample_row=prev_row,
            ), True))
        return rows

    def _emit(self, rows: list[tuple[_Request, ScheduledRequest, bool]],
              is_prefill: bool) -> ScheduledBatch:
        index = self._batch_index
        input_ids: list[int] = []
        for row, (req, sreq, samples) in enumerate(rows):
            input_ids.extend(req.tokens[sreq.first_position:sreq.context_len])
            if samples:
                req.last_sample = (index, row)
        extras: dict[str, object] = {
            # the ids the step's input_ids must hold once deferred ids are assembled
            "input_ids": tuple(input_ids),
            # which rows' sampled ids the scheduler uses (prefill rows mid-prompt do not)
            "sample_rows": tuple(samples for _, _, samples in rows),
            # apply in order, before this step's forward: copy KV page src -> dst
            "kv_page_moves": tuple(self._moves),
            "preempted": tuple(self._preempted),
            "migrated": tuple(self._migrated),
            "finished": tuple(self._finished),
            "arrived": tuple(self._arrived_ids),
        }
        self._moves, self._preempted, self._migrated = [], [], []
        self._finished, self._arrived_ids = [], []
        self._prev = [(req, samples) for req, _, samples in rows]
        self._batch_index += 1
        self.stats.batches += 1
        if is_prefill:
            self._steps_since_prefill = 0
            self.stats.prefill_batches += 1
        else:
            self._steps_since_prefill += 1
            self.stats.decode_batches += 1
        return ScheduledBatch(
            requests=tuple(sreq for _, sreq, _ in rows),
            is_prefill=is_prefill,
            page_size=self.config.page_size,
            padded_size=None if is_prefill else padded_size(len(rows), self.config.graph_sizes),
            step=index,
            extras=extras,
        )


# -- steady decode for the benchmark --------------------------------------------------------


_GREEDY = SamplingParams(temperature=0.0)


def steady_decode_num_pages(bs: int, context_len: int, append_every: int = 16,
                            window: int = 1024) -> int:
    """KV pool pages :func:`steady_decode_batches` uses with the same arguments."""
    return bs * _steady_row_pages(context_len, append_every, window)


def _steady_row_pages(context_len: int, append_every: int, window: int) -> int:
    # a row starts at most append_every - 1 tokens past context_len and decodes window more
    return -(-(context_len + append_every - 1 + window) // append_every)


def steady_decode_batches(
    bs: int,
    context_len: int,
    append_every: int = 16,
    *,
    window: int = 1024,
    graph_sizes: Sequence[int] = (),
    sampling: SamplingParams = _GREEDY,
    vocab_size: int = 1000,
    seed: int = 0,
) -> Iterator[ScheduledBatch]:
    """Decode batches of ``bs`` requests forever, for the steady-state benchmark.

    The page size is ``append_every`` tokens, so each row appends one page every
    ``append_every`` steps; row ``r`` starts at ``context_len + r % append_every`` tokens so
    the appends are staggered: ``1/append_every`` of the rows cross a page boundary each
    step, the rest hit. Every ``window`` steps all rows restart at their starting context
    (tables truncated: new versions, the fully replaced batch of a restart). Row order is
    fixed; after the first batch every row is deferred (``prev_sample_row`` = its own row).
    Page ids are a seeded permutation of ``steady_decode_num_pages(...)`` pages.
    """
    if bs < 1 or context_len < 1 or append_every < 1 or window < 1:
        raise SchedulerConfigError(
            f"steady_decode_batches needs bs, context_len, append_every and window >= 1, got "
            f"{bs}, {context_len}, {append_every}, {window}"
        )
    rng = np.random.default_rng(seed)
    per_row = _steady_row_pages(context_len, append_every, window)
    pages = rng.permutation(bs * per_row).astype(np.int32).reshape(bs, per_row)
    start = [context_len + r % append_every for r in range(bs)]
    start_pages = [-(-(s - 1) // append_every) for s in start]  # before the first token
    first_ids = rng.integers(0, vocab_size, size=bs).tolist()
    tables = [BlockTable(pages[r, : start_pages[r]]) for r in range(bs)]
    pad = padded_size(bs, graph_sizes) if graph_sizes else None
    step = 0
    while True:
        offset = step % window
        if offset == 0 and step > 0:
            for r in range(bs):
                tables[r].truncate(start_pages[r])
        requests = []
        for r in range(bs):
            ctx = start[r] + offset
            table = tables[r]
            if len(table) * append_every < ctx:
                table.append_one(int(pages[r, len(table)]))
            deferred = step > 0
            requests.append(ScheduledRequest(
                req_id=r,
                num_tokens=1,
                context_len=ctx,
                block_table=table.lineage_copy(),
                sampling=sampling,
                token_ids=(DEFERRED_PLACEHOLDER,) if deferred else (first_ids[r],),
                prev_sample_row=r if deferred else -1,
            ))
        yield ScheduledBatch(requests=tuple(requests), is_prefill=False,
                             page_size=append_every, padded_size=pad, step=step)
        step += 1
