"""What the attention adapters share: a block table published through its page-map state
(token positions and KV slots come from :class:`h2d_core.RequestLayout` over it)."""

from __future__ import annotations

import torch

from h2d_core import BlockTableState, H2DRunnerState, block_table_state

from .shape import StepShape, check_shape


class PagedInputs:
    """Base of the adapters whose tokens reach the paged KV cache through a block table.

    Declares the group's block-table buffer (``shape.max_reqs`` rows of
    ``shape.max_pages_per_req`` pages: 2-D int32, counted in rows, ranged up to
    ``shape.max_ranges`` so changed spans can travel inside the group's DMA) and owns its
    :class:`BlockTableState` (page IDs checked against ``shape.num_pages``).
    """

    def __init__(
        self,
        state: H2DRunnerState,
        shape: StepShape,
        group: str,
        table_name: str,
        *,
        reserved_page: int | None = None,
    ) -> None:
        shape = check_shape(group, shape)
        #: the capacities the adapter was declared with
        self.shape = shape
        self.h2d_state = state
        self.group = group
        self.page_size = shape.page_size
        self.pool_limit = shape.num_pages
        #: the page only graph padding rows hold (None: none); real rows bringing it are
        #: refused by the table's snapshots before any write
        self.reserved_page = reserved_page
        self.block_tables = state.buffer(table_name, (shape.max_reqs, shape.max_pages_per_req),
                                         torch.int32, group=group, unit="rows",
                                         max_ranges=shape.max_ranges)
        self._tables: BlockTableState | None = None

    @property
    def tables(self) -> BlockTableState:
        """The block-table state (created on first use, after ``bind()``)."""
        if self._tables is None:
            self._tables = block_table_state(self.block_tables, pool_limit=self.pool_limit,
                                             reserved_page=self.reserved_page)
        return self._tables
