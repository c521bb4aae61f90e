"""MHA decode metadata: slots, context lengths, block tables, KV prefix and positions.

The ``mha_decode`` producer group. First consumer: KV-index generation
(:func:`generate_kv_indices` builds ``kv_indices`` from the block tables and ``kv_indptr``).
Block tables go through :func:`h2d_core.block_table_state`: unchanged tables are not
re-sent, appended pages travel as a few bytes, whole tables only when most rows changed.

CUDA-graph padding (``padded`` = P > n real requests, q tokens per request):

* ``slot_mapping[:P*q]``: -1 for padding tokens (no KV write);
* ``context_lens[:P]``: 0 for padded requests;
* ``block_tables[:P]``: padded rows are empty (cleared to the fill value);
* ``kv_indptr[:P+1]``: the tail repeats the total, so padded requests own no pages;
* ``positions[:P*q]``: 0 for padding tokens.

A padded replay therefore reads nothing stale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from block_tables import BlockTable
from h2d_core import BlockTableState, H2DRunnerState, block_table_state, h2d_producer

from .batch import ScheduledBatch
from .consumers import generate_kv_indices

MHA_DECODE = "mha_decode"
#: the empty row padded requests get: versioned, so padding costs nothing on a hit
EMPTY_ROW = BlockTable()


@dataclass(frozen=True)
class DecodePlan:
    num_reqs: int
    padded_reqs: int
    tokens_per_req: int
    padded_tokens: int
    num_pages: int
    table_stage: str


class MhaDecodeInputs:
    """Declares the decode buffers, produces them, and runs KV-index generation."""

    def __init__(
        self,
        state: H2DRunnerState,
        *,
        max_reqs: int,
        max_tokens: int,
        max_pages_per_req: int,
        page_size: int,
        num_pages: int | None = None,
        max_ranges: int = 64,
        prefix: str = "",
    ) -> None:
        self.h2d_state = state
        self.page_size = page_size
        self.pool_limit = num_pages
        buf = state.buffer
        g = MHA_DECODE if not prefix else f"{prefix}{MHA_DECODE}"
        self.group = g
        self.slot_mapping = buf(f"{prefix}slot_mapping", (max_tokens,), torch.int64, group=g)
        self.context_lens = buf(f"{prefix}context_lens", (max_reqs,), torch.int32, group=g)
        self.block_tables = buf(f"{prefix}block_tables", (max_reqs, max_pages_per_req),
                                torch.int32, group=g, unit="rows", max_ranges=max_ranges)
        self.kv_indptr = buf(f"{prefix}kv_indptr", (max_reqs + 1,), torch.int32, group=g)
        self.positions = buf(f"{prefix}positions", (max_tokens,), torch.int64, group=g)
        # written on the device by the first consumer, never uploaded
        self.kv_indices = torch.zeros(max_reqs * max_pages_per_req, dtype=torch.int32,
                                      device=state.device)
        self._tables: BlockTableState | None = None
        self._pad_rows: list[BlockTable] = [EMPTY_ROW] * max_reqs

    @property
    def tables(self) -> BlockTableState:
        """The block-table state (created on first use, after ``bind()``)."""
        if self._tables is None:
            self._tables = block_table_state(self.block_tables, pool_limit=self.pool_limit)
        return self._tables

    @h2d_producer(lambda self: self.group)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None) -> DecodePlan:
        return self._prepare(batch, padded)

    def _prepare(self, batch: ScheduledBatch, padded: int | None) -> DecodePlan:
        cols = batch.columns
        n = cols.query_lens.size
        p = n if padded is None else padded
        q = int(cols.query_lens[0]) if n else 1
        if n and not bool((cols.query_lens == q).all()):
            raise ValueError(
                f"{self.group}: decode expects the same number of tokens per request, got "
                f"{sorted(set(cols.query_lens.tolist()))}"
            )
        page = self.page_size
        st = self.h2d_state
        ctx = cols.context_lens.astype(np.int64)
        pages = (ctx + page - 1) // page

        rows = list(batch.block_tables)
        if p > n:
            rows += self._pad_rows[: p - n]
            required = np.concatenate((pages, np.zeros(p - n, dtype=np.int64)))
        else:
            required = pages
        tables = self.tables
        tables.prepare(rows, required_pages=required)

        # token positions and KV slots, from the freshly prepared (pinned) CPU table
        t, pt = n * q, p * q
        pos = self.positions.np
        first = ctx - q
        pos[:t] = (np.repeat(first, q) + np.tile(np.arange(q), n)) if q > 1 else first
        pos[t:pt] = 0
        st.set_count(self.positions, pt)
        token_pos = pos[:t]
        req = np.repeat(np.arange(n), q) if q > 1 else np.arange(n)
        snapshot_rows = tables.snapshot.storage
        slots = self.slot_mapping.np
        slots[:t] = snapshot_rows[req, token_pos // page].astype(np.int64) * page + token_pos % page
        slots[t:pt] = -1
        st.set_count(self.slot_mapping, pt)

        lens = self.context_lens.np
        lens[:n] = cols.context_lens
        lens[n:p] = 0
        st.set_count(self.context_lens, p)
        indptr = self.kv_indptr.np
        indptr[0] = 0
        np.cumsum(pages, out=indptr[1 : n + 1])
        indptr[n + 1 : p + 1] = indptr[n]
        st.set_count(self.kv_indptr, p + 1)
        stage = tables.stage(p)
        return DecodePlan(n, p, q, pt, int(indptr[n]), stage)

    def generate_kv_indices(self, plan: DecodePlan) -> torch.Tensor:
        """First consumer: ``kv_indices`` for the plan's rows (padding included)."""
        generate_kv_indices(self.block_tables.gpu, self.kv_indptr.gpu, self.kv_indices,
                            plan.padded_reqs)
        return self.kv_indices
