"""The ATOM-style way to publish a decode step, for the main job's same-process baseline.

What an engine that uploads its metadata one array at a time does each decode step (the
catalogue's plain-MHA path): the host builds every array (block-table rows rebuilt at full
width from the requests' Python page lists, positions, KV slots, lengths, the KV prefix,
the query prefix, sampling temperatures, the token ids and their deferred sources) in
pinned tensors, then issues one ``copy_`` per array: ten host-to-device copies. They land in
the same destinations the library's publication fills, so the same first consumers (token
assembly, KV-index generation) and the same model graphs run after them, and a step's
logits must equal the packed step's bit for bit (the tests check it).

Source reuse is made safe the way the library's slots make it safe: two sets of pinned
sources, each rewritten only after the GPU finished the copies that read it (an event per
set); the wait is reported apart, as for the library.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from h2d_runner_adapters import DecodePlan, SamplingPlan, ScheduledBatch, TokenPlan
from h2d_runner_adapters.sampling import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from .runner import DecodeRunner

__all__ = ["AtomStyleDecode", "AtomStyleError"]


class AtomStyleError(ValueError):
    """A batch the ATOM-style decode way does not handle (it models plain decode)."""


class AtomStyleDecode:
    """Per-array host build and copies into a :class:`DecodeRunner`'s destinations."""

    def __init__(self, runner: DecodeRunner, num_sets: int = 2) -> None:
        cfg = runner.cfg
        self.page_size = cfg.page_size
        self.max_reqs = cfg.max_reqs
        r, pages = cfg.max_reqs, cfg.max_pages_per_req
        pin = runner.device.type == "cuda"
        dec, tok = runner.decode, runner.tokens
        # (destination, dtype, shape) of the ten members, in ATOM's upload order
        self.members = {
            "input_ids": (tok.input_ids.gpu, torch.int32, (r,)),
            "decode_cu": (tok.decode_cu.gpu, torch.int32, (r + 1,)),
            "decode_src": (tok.decode_src.gpu, torch.int32, (r,)),
            "temperatures": (runner.sampling.temperatures.gpu, torch.float32, (r,)),
            "slot_mapping": (dec.slot_mapping.gpu, torch.int64, (r,)),
            "context_lens": (dec.context_lens.gpu, torch.int32, (r,)),
            "cu_seqlens_q": (tok.cu_seqlens_q.gpu, torch.int32, (r + 1,)),
            "kv_indptr": (dec.kv_indptr.gpu, torch.int32, (r + 1,)),
            "positions": (dec.positions.gpu, torch.int64, (r,)),
            "block_tables": (dec.block_tables.gpu, torch.int32, (r, pages)),
        }
        self.sets = []
        for _ in range(num_sets):
            host = {k: torch.zeros(shape, dtype=dt, device="cpu", pin_memory=pin)
                    for k, (_, dt, shape) in self.members.items()}
            self.sets.append((host, {k: t.numpy() for k, t in host.items()}))
        self.done: list[torch.cuda.Event | None] = [None] * num_sets
        self.cuda = pin
        self.turn = 0
        #: each request's pages as a Python list (the engine's per-sequence block table),
        #: kept by the scheduler side: :meth:`sync_lists` runs outside the timed step
        self.lists: list[list[int]] = []
        self.versions: list[tuple[int, int] | None] = []
        self.last_wait_ns = 0

    def sync_lists(self, batch: ScheduledBatch) -> None:
        """The scheduler's bookkeeping: each row's page list follows its block table (a
        row is re-listed when its append-lineage version or length changed, or always when
        it has no version)."""
        rows = batch.block_tables
        if len(self.versions) != len(rows):
            self.lists = [[] for _ in rows]
            self.versions = [None] * len(rows)
        for i, row in enumerate(rows):
            version = getattr(row, "version", None)
            key = None if version is None else (version, len(row))
            if key is None or key != self.versions[i]:
                self.lists[i] = list(row)
                self.versions[i] = key

    def publish(self, batch: ScheduledBatch,
                padded: int | None) -> tuple[SamplingPlan, TokenPlan, DecodePlan]:
        """Build the ten arrays on the host and copy each; returns the plans the first
        consumers and the sampler take."""
        cols = batch.columns
        n = cols.query_lens.size
        if n and int(cols.query_lens.max()) != 1:
            raise AtomStyleError("the ATOM-style decode way models one token per request")
        top_k, top_p = cols.top_k, cols.top_p
        if n and ((top_k != top_k[0]).any() or (top_p != top_p[0]).any()):
            raise AtomStyleError("the ATOM-style decode way models batch-uniform top-k/top-p")
        if len(self.lists) != n:
            raise AtomStyleError(f"{len(self.lists)} page lists for {n} requests: call "
                                 "sync_lists(batch) first")
        sampling = SamplingPlan(n, int(top_k[0]) if n and top_k[0] > 0 else None,
                                float(top_p[0]) if n and top_p[0] < 1.0 else None, False, False)
        p = n if padded is None else padded
        k = self.turn
        self.turn = (k + 1) % len(self.sets)
        event = self.done[k]
        t0 = time.perf_counter_ns()
        if event is not None:
            event.synchronize()  # the copies that read this set have run
        self.last_wait_ns = time.perf_counter_ns() - t0
        host, a = self.sets[k]
        ps = self.page_size
        ctx = cols.context_lens
        pos = a["positions"]
        pos[:n] = ctx
        pos[:n] -= 1
        pos[n:p] = 0
        bt = a["block_tables"]
        for i, row in enumerate(self.lists):  # the per-row full-width rebuild
            bt[i, :] = 0
            bt[i, : len(row)] = row
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
        np.maximum(cols.temperatures, GREEDY_TEMPERATURE, out=a["temperatures"][:n])
        for name, (dst, _, _) in self.members.items():
            rows = p + 1 if name in ("decode_cu", "cu_seqlens_q", "kv_indptr") else p
            dst[:rows].copy_(host[name][:rows], non_blocking=True)
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self.done[k] = done
        return (sampling, TokenPlan(n, p, n, p, 0),
                DecodePlan(n, p, 1, n, p, int(indptr[n]), "atom"))
