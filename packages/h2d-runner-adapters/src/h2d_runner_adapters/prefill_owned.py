"""Context-parallel KV ownership of a prefill chunk: ``owns_slot``'s mask.

An engine that splits the KV cache across ranks passes ``owns_slot`` (a function of the
chunk's KV slots returning a bool mask of the ones this rank writes) to
:meth:`~h2d_runner_adapters.PrefillInputs.prepare`. The mask must be known, and checked,
before any source is written; the slots it reads come from the chunk's rows prepared into
a private table by the same layout rule as the published ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from block_tables import PageTableSnapshot
from h2d_core import RequestLayout

from .batch import PageRow
from .checks import bool_mask


class OwnedSlots:
    """The KV slots a chunk would write, laid out into private storage, and
    ``owns_slot``'s mask over them. Made on a chunk's first use of ``owns_slot``."""

    def __init__(self, group: str, page_size: int, table_shape: tuple[int, ...],
                 max_tokens: int, max_reqs: int, pool_limit: int | None) -> None:
        storage = np.zeros(table_shape, np.int32)
        self._slots = np.zeros(max_tokens, np.int64)
        self._layout = RequestLayout(group, page_size, storage,
                                     np.zeros(max_reqs, dtype=np.int32),
                                     slot_mapping=self._slots)
        self._table = PageTableSnapshot(storage, pool_limit=pool_limit)

    def mask(self, g: str, owns_slot: Callable[[np.ndarray], np.ndarray],
             rows: Sequence[PageRow], qlens: np.ndarray, ctx: np.ndarray, t: int
             ) -> np.ndarray:
        """``owns_slot``'s mask over the chunk's ``t`` KV slots, checked (1-D bool, one per
        token; a refusal names group ``g``). The chunk passed the same plan already; rows
        the published table would refuse raise here."""
        layout = self._layout
        layout.plan(qlens, ctx, qlens.size, t)
        self._table.prepare(rows, required_pages=layout.required_pages)
        layout.write()
        view = self._slots[:t]
        view.flags.writeable = False  # the function reads the slots; it owns nothing here
        return bool_mask(g, "owns_slot(slots)", owns_slot(view), size=t)
