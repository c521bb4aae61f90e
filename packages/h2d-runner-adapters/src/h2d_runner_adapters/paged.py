"""What the attention adapters share: a block table published through its page-map state
(token positions and KV slots come from :class:`h2d_core.RequestLayout` over it)."""

from __future__ import annotations

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
        reserved_page: int | None = None,
    ) -> None:
        self.h2d_state = state
        self.group = group
        self.page_size = page_size
        self.pool_limit = num_pages
        #: the page only graph padding rows hold (None: none); real rows bringing it are
        #: refused by the table's snapshots before any write
        self.reserved_page = reserved_page
        self.block_tables = state.buffer(table_name, (max_reqs, max_pages_per_req),
                                         torch.int32, group=group, unit="rows",
                                         max_ranges=max_ranges)
        self._tables: BlockTableState | None = None

    @property
    def tables(self) -> BlockTableState:
        """The block-table state (created on first use, after ``bind()``)."""
        if self._tables is None:
            self._tables = block_table_state(self.block_tables, pool_limit=self.pool_limit,
                                             reserved_page=self.reserved_page)
        return self._tables
