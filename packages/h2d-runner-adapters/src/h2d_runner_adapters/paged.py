"""What the attention adapters share: a block table published through its page-map state,
and token -> KV slot mapping from the prepared CPU table."""

from __future__ import annotations

import numpy as np
import torch

from h2d_core import BlockTableState, H2DRunnerState, block_table_state


class PagedInputs:
    """Base of the adapters whose tokens reach the paged KV cache through a block table.

    Declares the group's block-table buffer (2-D int32, counted in rows, ranged so changed
    spans can travel inside the group's DMA) and owns its :class:`BlockTableState`.
    """

    def __init__(
        self,
        state: H2DRunnerState,
        group: str,
        table_name: str,
        *,
        max_reqs: int,
        max_pages_per_req: int,
        page_size: int,
        num_pages: int | None,
        max_ranges: int,
    ) -> None:
        self.h2d_state = state
        self.group = group
        self.page_size = page_size
        self.pool_limit = num_pages
        self.block_tables = state.buffer(table_name, (max_reqs, max_pages_per_req),
                                         torch.int32, group=group, unit="rows",
                                         max_ranges=max_ranges)
        self._tables: BlockTableState | None = None
        #: the snapshots' compiled common step: None = when available, False = never
        self.native: bool | None = None
        pow2 = page_size & (page_size - 1) == 0
        self._page_shift = page_size.bit_length() - 1 if pow2 else -1

    @property
    def tables(self) -> BlockTableState:
        """The block-table state (created on first use, after ``bind()``)."""
        if self._tables is None:
            self._tables = block_table_state(self.block_tables, pool_limit=self.pool_limit,
                                             native=self.native)
        return self._tables

    def kv_slots(self, rows: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        """``out[t] = page(rows[t], positions[t] // page) * page + positions[t] % page``,
        read from the current slot's prepared CPU table (prepare the rows first)."""
        page = self.page_size
        table = self.tables.snapshot.storage
        if self._page_shift >= 0:
            np.multiply(table[rows, positions >> self._page_shift], page, out=out)
            out += positions & (page - 1)
        else:
            np.multiply(table[rows, positions // page], page, out=out)
            out += positions % page
