"""ATOM's per-step metadata path, re-created once for every benchmark: its primitives and
the plain-MHA decode step (the MTP, GDN and V4 steps are in :mod:`peers.atom_families`).

Written from the ATOM metadata catalog (a survey of ROCm/ATOM's runner), not from ATOM's
code. What an ATOM decode step does, and so what every step here does:

* **scheduler side, outside the timed step**: each sequence's block table is a Python list
  of page ids (:class:`PageLists` keeps them, following the engine's rows);
* **worker side, each step**: wait until the step's pinned host sources are free again,
  rebuild every scheduled row of the block table at full width from its list (zero the
  row, assign the list: :func:`rebuild_block_tables`), build every other array with numpy,
  then one ``non_blocking`` ``copy_`` per array into a fixed device destination, its
  leading rows only (ATOM's ``CpuGpuBuffer.copy_to_gpu(n)``: :func:`copy_fields`).

ATOM keeps one pinned set per name and waits for the previous step's staging event before
reusing it; here there are ``num_sets`` sets (two by default, as the library's two slots)
rotated per step, each with its event (:class:`SourceSets`), and the wait is reported
apart (``last_wait_ns``) as the library's is. On CPU nothing is pinned and no event is kept.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: a field's dtype and host shape
Field = tuple[torch.dtype, tuple[int, ...]]

__all__ = [
    "MHA_FIELDS",
    "AtomStyleError",
    "Field",
    "MhaDecodeStep",
    "MhaStaged",
    "PageLists",
    "SourceSets",
    "copy_fields",
    "rebuild_block_tables",
]


class AtomStyleError(ValueError):
    """A batch or a destination the ATOM-style step does not handle."""


class SourceSets:
    """``num_sets`` sets of host sources, one tensor per field (pinned on CUDA), rotated
    per step; a set is rewritten only after the copies that read it ran (its event).

    :meth:`acquire` waits for the next set and returns its numpy views; :meth:`release`
    records the set's event after the step's copies were enqueued."""

    def __init__(self, fields: Mapping[str, Field], device: str | torch.device,
                 num_sets: int = 2) -> None:
        if num_sets < 1:
            raise AtomStyleError(f"num_sets must be >= 1, got {num_sets}")
        self.cuda = torch.device(device).type == "cuda"
        self.sets = [{name: torch.zeros(shape, dtype=dt, pin_memory=self.cuda)
                      for name, (dt, shape) in fields.items()} for _ in range(num_sets)]
        self.arrays = [{name: t.numpy() for name, t in s.items()} for s in self.sets]
        self.done: list[torch.cuda.Event | None] = [None] * num_sets
        self.turn = 0  # the set the next step takes
        self.current = 0
        #: ns the last :meth:`acquire` waited for its set's copies (GPU time, not host work)
        self.last_wait_ns = 0

    def acquire(self) -> dict[str, np.ndarray]:
        k = self.current = self.turn
        self.turn = (k + 1) % len(self.sets)
        event = self.done[k]
        t0 = time.perf_counter_ns()
        if event is not None:
            event.synchronize()  # the copies that read this set have run
        self.last_wait_ns = time.perf_counter_ns() - t0
        return self.arrays[k]

    @property
    def host(self) -> dict[str, torch.Tensor]:
        """The set :meth:`acquire` took, as tensors (the copies' sources)."""
        return self.sets[self.current]

    def fill(self, name: str, value: float) -> None:
        """Every set's ``name`` filled with ``value`` (sentinels written once, at init)."""
        for arrays in self.arrays:
            arrays[name][...] = value

    def release(self) -> None:
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self.done[self.current] = done


def rebuild_block_tables(table: np.ndarray, lists: Sequence[Sequence[int]]) -> None:
    """ATOM's per-row rebuild, every step: each scheduled row zeroed at full width, then its
    Python page list assigned into the row's prefix (no dirty-row tracking)."""
    for i, row in enumerate(lists):
        table[i, :] = 0
        table[i, : len(row)] = row


def copy_fields(host: Mapping[str, torch.Tensor], dests: Mapping[str, torch.Tensor],
                counts: Mapping[str, int]) -> int:
    """One ``non_blocking`` ``copy_`` per field (in ``counts``' order) of its leading
    ``counts[name]`` rows into ``dests[name]``; returns the bytes copied."""
    nbytes = 0
    for name, n in counts.items():
        src = host[name][:n]
        dests[name][:n].copy_(src, non_blocking=True)
        nbytes += src.numel() * src.element_size()
    return nbytes


class PageLists:
    """The scheduler's per-sequence block tables as Python lists, upkept outside the timed
    step: a row is re-listed when its append-lineage version or its length changed (or
    always, when the row has no version)."""

    def __init__(self) -> None:
        self.lists: list[list[int]] = []
        self._keys: list[tuple[int, int] | None] = []

    def sync(self, rows: Sequence[Sequence[int]]) -> list[list[int]]:
        if len(self._keys) != len(rows):
            self.lists = [[] for _ in rows]
            self._keys = [None] * len(rows)
        for i, row in enumerate(rows):
            version = getattr(row, "version", None)
            key = None if version is None else (version, len(row))
            if key is None or key != self._keys[i]:
                self.lists[i] = list(row)
                self._keys[i] = key
        return self.lists


#: the plain-MHA decode step's ten arrays in ATOM's upload order (catalog §3a: sampling,
#: the token group, the five attention uploads, then positions)
MHA_FIELDS: dict[str, torch.dtype] = {
    "temperatures": torch.float32, "input_ids": torch.int32, "decode_cu": torch.int32,
    "decode_src": torch.int32, "slot_mapping": torch.int64, "context_lens": torch.int32,
    "cu_seqlens_q": torch.int32, "block_tables": torch.int32, "kv_indptr": torch.int32,
    "positions": torch.int64,
}
_PREFIXES = ("decode_cu", "cu_seqlens_q", "kv_indptr")  # n + 1 entries
#: clamp of greedy temperatures (the library's sampler uses the same value)
GREEDY_TEMPERATURE = 1e-10


@dataclass(frozen=True)
class MhaStaged:
    """A built MHA step: real and padded requests, KV pages (``kv_indptr[n]``)."""

    num_reqs: int
    padded_reqs: int
    num_pages: int


class MhaDecodeStep:
    """The plain-MHA decode step (one token per request, catalog §2.3 / §3a) into the
    caller's ten destinations (``dests``, keyed as :data:`MHA_FIELDS`): positions,
    full-width block-table rows, KV slots, lengths, the KV prefix, the query prefix, the
    sampling temperatures, the token ids and their deferred sources, ten copies.

    Padded requests ``[n, padded)`` are published as the library publishes them (zero
    positions and rows, slot ``-1``, zero lengths, repeated prefixes, token id 0, source
    ``-1``), so a DecodeRunner fed either way sees the same bytes."""

    def __init__(self, dests: Mapping[str, torch.Tensor], page_size: int,
                 num_sets: int = 2, greedy_temperature: float = GREEDY_TEMPERATURE) -> None:
        missing = sorted(set(MHA_FIELDS) - set(dests))
        if missing:
            raise AtomStyleError(f"MhaDecodeStep needs destinations for {missing}")
        r, pages = dests["block_tables"].shape
        fields: dict[str, Field] = {}
        for name, dt in MHA_FIELDS.items():
            shape = (r, pages) if name == "block_tables" else (r + (name in _PREFIXES),)
            d = dests[name]
            if d.dtype != dt or d.shape[0] < shape[0] or d.shape[1:] != shape[1:]:
                raise AtomStyleError(f"destination {name} is {d.dtype} {tuple(d.shape)}; the "
                                     f"step writes {dt} {shape}: give one at least that long")
            fields[name] = (dt, shape)
        self.dests = dict(dests)
        self.page_size, self.max_reqs = page_size, r
        self.greedy_temperature = greedy_temperature
        self.sources = SourceSets(fields, dests["block_tables"].device, num_sets)
        self.last_bytes = 0

    @property
    def last_wait_ns(self) -> int:
        return self.sources.last_wait_ns

    def stage(self, cols: Any, lists: Sequence[Sequence[int]],
              padded: int | None = None) -> MhaStaged:
        """The host build: wait for the next source set, write the ten arrays. ``cols``:
        the batch's columns (``BatchColumns``); ``lists``: each request's page list."""
        n = cols.query_lens.size
        if n and int(cols.query_lens.max()) != 1:
            raise AtomStyleError("the ATOM-style decode step models one token per request")
        if len(lists) != n:
            raise AtomStyleError(f"{len(lists)} page lists for {n} requests: sync the "
                                 "scheduler's lists (PageLists.sync) first")
        p = n if padded is None else padded
        if not n <= p <= self.max_reqs:
            raise AtomStyleError(f"{n} requests padded to {p}: the destinations hold "
                                 f"{self.max_reqs}")
        a = self.sources.acquire()
        ps = self.page_size
        ctx = cols.context_lens
        pos = a["positions"]
        pos[:n] = ctx
        pos[:n] -= 1
        pos[n:p] = 0
        bt = a["block_tables"]
        rebuild_block_tables(bt, lists)
        bt[n:p] = 0
        slots = a["slot_mapping"]
        slots[:n] = bt[np.arange(n), pos[:n] // ps]
        slots[:n] *= ps
        slots[:n] += pos[:n] % ps
        slots[n:p] = -1
        a["context_lens"][:n] = ctx
        a["context_lens"][n:p] = 0
        indptr = a["kv_indptr"]
        indptr[0] = 0
        np.cumsum((ctx + ps - 1) // ps, out=indptr[1 : n + 1])
        indptr[n + 1 : p + 1] = indptr[n]
        a["cu_seqlens_q"][: p + 1] = np.minimum(np.arange(p + 1), n)
        a["decode_cu"][: p + 1] = a["cu_seqlens_q"][: p + 1]
        a["input_ids"][:n] = cols.token_ids
        a["input_ids"][n:p] = 0
        a["decode_src"][:n] = cols.prev_sample_rows
        a["decode_src"][n:p] = -1
        np.maximum(cols.temperatures, self.greedy_temperature, out=a["temperatures"][:n])
        return MhaStaged(n, p, int(indptr[n]))

    def copy(self, staged: MhaStaged) -> None:
        """One copy per array (temperatures: real rows only, catalog §2.1), then the set's
        event."""
        n, p = staged.num_reqs, staged.padded_reqs
        counts = {name: (p + 1 if name in _PREFIXES else n if name == "temperatures" else p)
                  for name in MHA_FIELDS}
        self.last_bytes = copy_fields(self.sources.host, self.dests, counts)
        self.sources.release()

    def publish(self, cols: Any, lists: Sequence[Sequence[int]],
                padded: int | None = None) -> MhaStaged:
        staged = self.stage(cols, lists, padded)
        self.copy(staged)
        return staged
