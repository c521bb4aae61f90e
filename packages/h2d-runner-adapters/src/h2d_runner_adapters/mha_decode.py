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

from typing import NamedTuple

import numpy as np
import torch

from block_tables import BlockTable
from h2d_core import CountError, H2DRunnerState, h2d_producer

from .batch import ScheduledBatch
from .consumers import generate_kv_indices
from .paged import PagedInputs
from .token_inputs import _padded

MHA_DECODE = "mha_decode"


def _ceil_div(values: np.ndarray, page: int) -> np.ndarray:
    """Pages needed for ``values`` tokens (a shift when ``page`` is a power of two)."""
    if page & (page - 1) == 0:
        return (values + (page - 1)) >> (page.bit_length() - 1)
    return (values + (page - 1)) // page


class DecodePlan(NamedTuple):
    num_reqs: int
    padded_reqs: int
    tokens_per_req: int
    padded_tokens: int
    num_pages: int
    table_stage: str


class MhaDecodeInputs(PagedInputs):
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
        g = MHA_DECODE if not prefix else f"{prefix}{MHA_DECODE}"
        super().__init__(state, g, f"{prefix}block_tables", max_reqs=max_reqs,
                         max_pages_per_req=max_pages_per_req, page_size=page_size,
                         num_pages=num_pages, max_ranges=max_ranges)
        buf = state.buffer
        self.slot_mapping = buf(f"{prefix}slot_mapping", (max_tokens,), torch.int64, group=g)
        self.context_lens = buf(f"{prefix}context_lens", (max_reqs,), torch.int32, group=g)
        self.kv_indptr = buf(f"{prefix}kv_indptr", (max_reqs + 1,), torch.int32, group=g)
        self.positions = buf(f"{prefix}positions", (max_tokens,), torch.int64, group=g)
        # written on the device by the first consumer, never uploaded
        self.kv_indices = torch.zeros(max_reqs * max_pages_per_req, dtype=torch.int32,
                                      device=state.device)
        # Padded requests get this adapter's own empty row: versioned, so padding costs
        # nothing on a hit; private, so nothing can append to it.
        self._pad_rows: list[BlockTable] = [BlockTable()] * max_reqs
        # fixed helpers of the hot path, made once
        self._zeros = np.zeros(max_reqs, dtype=np.int32)
        self._rows = np.arange(max_reqs)

    @h2d_producer(lambda self: self.group)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None) -> DecodePlan:
        return self._prepare(batch, padded)

    def _prepare(self, batch: ScheduledBatch, padded: int | None) -> DecodePlan:
        cols = batch.columns
        qlens = cols.query_lens
        n = qlens.size
        p = _padded(self.group, n, padded)
        q = int(qlens[0]) if n else 1
        if n and qlens.tobytes() != qlens[:1].tobytes() * n:
            raise CountError(
                f"{self.group}: decode expects the same number of tokens per request, got "
                f"{sorted(set(qlens.tolist()))}"
            )
        page = self.page_size
        st = self.h2d_state
        ctx = cols.context_lens
        pages = _ceil_div(ctx, page)
        rows = batch.block_tables
        if p > n:
            rows = [*rows, *self._pad_rows[: p - n]]
            required = np.concatenate((pages, self._zeros[: p - n]))
        else:
            required = pages
        tables = self.tables
        tables.prepare(rows, required_pages=required)

        # token positions and KV slots, from the freshly prepared (pinned) CPU table
        t, pt = n * q, p * q
        pos = self.positions.np
        if q == 1:
            np.subtract(ctx, 1, out=pos[:t])
            req = self._rows[:n]
        else:
            pos[:t] = np.repeat(ctx - q, q) + np.tile(np.arange(q), n)
            req = np.repeat(self._rows[:n], q)
        pos[t:pt] = 0
        token_pos = pos[:t]
        slots = self.slot_mapping.np
        self.kv_slots(req, token_pos, slots[:t])
        slots[t:pt] = -1
        lens = self.context_lens.np
        lens[:n] = ctx
        lens[n:p] = 0
        indptr = self.kv_indptr.np
        indptr[0] = 0
        np.add.accumulate(pages, out=indptr[1 : n + 1])
        total = int(indptr[n])
        indptr[n + 1 : p + 1] = total
        st.set_count(self.positions, pt)
        st.set_count(self.slot_mapping, pt)
        st.set_count(self.context_lens, p)
        st.set_count(self.kv_indptr, p + 1)
        stage = tables.stage(p)
        return DecodePlan(n, p, q, pt, total, stage)

    def generate_kv_indices(self, plan: DecodePlan) -> torch.Tensor:
        """First consumer: ``kv_indices`` for the plan's rows (padding included)."""
        generate_kv_indices(self.block_tables.gpu, self.kv_indptr.gpu, self.kv_indices,
                            plan.padded_reqs)
        return self.kv_indices
