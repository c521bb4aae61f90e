"""Prefill attention mirrors and ordinary positions: the ``prefill_inputs`` producer group.

Members: ``cu_seqlens_k`` (exclusive prefix of key lengths = cached + new tokens),
``context_lens`` (keys per request), ``slot_mapping`` (KV slot of every query token; -1 for
a position this rank does not write), ``positions`` and the block tables (through
:func:`h2d_core.block_table_state`, its own state: prefill and decode tables are separate
buffers). The query prefix ``cu_seqlens_q`` comes from the token inputs.

First consumer: attention preparation (:func:`prepare_prefill_attention`), which derives
each token's request, the KV page prefix and ``kv_indices``. Prefill runs eagerly: no graph
padding. The block tables are needed by this runner's paged attention whether or not a
prefix hit exists; an engine whose prefill attention reads the current chunk directly can
omit them when no request has cached tokens (``publish_tables=False``) while still
preparing the CPU rows.

With ``mrope=True`` the group carries ``prefill_mrope_positions`` (three planes at the
chunk's token width, see :mod:`h2d_runner_adapters.mrope`) in place of the positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from block_tables import PageTableSnapshot, RequestLayout, RequestLayoutError
from block_tables.native import refuse_interpreted
from h2d_core import CountError, H2DBuffer, H2DRunnerState, h2d_producer

from .batch import BatchColumns, PageRow, ScheduledBatch
from .checks import INT32_MAX, AdapterInputError, bool_mask, describe
from .consumers import prepare_prefill_attention
from .mrope import check_prompt_positions, declare_mrope, mrope_planes, write_prefill_planes
from .paged import PagedInputs

PREFILL_INPUTS = "prefill_inputs"


@dataclass(frozen=True)
class PrefillPlan:
    num_reqs: int
    num_tokens: int
    table_stage: str


class PrefillInputs(PagedInputs):
    """Declares the prefill buffers, produces them, and runs attention preparation."""

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
        mrope: bool = False,
    ) -> None:
        g = PREFILL_INPUTS
        super().__init__(state, g, "prefill_block_tables", max_reqs=max_reqs,
                         max_pages_per_req=max_pages_per_req, page_size=page_size,
                         num_pages=num_pages, max_ranges=max_ranges)
        buf = state.buffer
        self.cu_seqlens_k = buf("prefill_cu_seqlens_k", (max_reqs + 1,), torch.int32, group=g)
        self.context_lens = buf("prefill_context_lens", (max_reqs,), torch.int32, group=g)
        self.slot_mapping = buf("prefill_slot_mapping", (max_tokens,), torch.int64, group=g)
        self.positions = buf("prefill_positions", (max_tokens,), torch.int64, group=g)
        self.mrope_positions: H2DBuffer | None = (
            declare_mrope(state, "prefill_mrope_positions", max_tokens, g) if mrope else None)
        dev = state.device
        self.token_request = torch.zeros(max_tokens, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(max_reqs + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(max_reqs * max_pages_per_req, dtype=torch.int32,
                                      device=dev)
        self._layouts: list[RequestLayout] = []  # per slot, made on first use
        # owns_slot's input, computed before any write: a private table the rows are
        # prepared into, and a layout writing only KV slots from it (made on first use)
        self._scratch: tuple[PageTableSnapshot, RequestLayout, np.ndarray] | None = None

    def _bind_layouts(self) -> list[RequestLayout]:
        refuse_interpreted(self.native, self.group)
        cls = RequestLayout
        out = []
        for slot, snap in enumerate(self.tables.snapshots):
            def src(b: H2DBuffer, slot: int = slot) -> np.ndarray:
                return b.source(slot).numpy()
            out.append(cls(self.group, self.page_size, snap.storage,
                           np.zeros(self.context_lens.spec.capacity, dtype=np.int32),
                           positions=src(self.positions), slot_mapping=src(self.slot_mapping),
                           context_lens=src(self.context_lens)))
        return out

    @h2d_producer(PREFILL_INPUTS)
    def prepare(
        self,
        batch: ScheduledBatch,
        *,
        publish_tables: bool = True,
        owns_slot: Callable[[np.ndarray], np.ndarray] | None = None,
        mrope_positions: Sequence[np.ndarray | None] | None = None,
    ) -> PrefillPlan:
        """Stage one prefill (chunk) batch.

        ``owns_slot`` (optional) maps the token positions' KV slots (an int64 array, one
        per token) to a 1-D bool mask of the ones this rank writes (context-parallel KV);
        the others get -1. An MRoPE adapter takes ``mrope_positions``: per request its
        ``[3, L]`` prompt positions, or None (text only: its ordinary positions on every
        plane). Every argument is checked, ``owns_slot``'s mask included, before any source
        is written: a refusal raises :class:`AdapterInputError` (or the block table's own
        error) and changes nothing.
        """
        g = self.group
        if not isinstance(batch, ScheduledBatch):
            raise AdapterInputError(f"{g}: batch must be a ScheduledBatch, got {describe(batch)}")
        if not isinstance(publish_tables, bool | np.bool_):
            raise AdapterInputError(
                f"{g}: publish_tables must be a bool, got {describe(publish_tables)}")
        if owns_slot is not None and not callable(owns_slot):
            raise AdapterInputError(
                f"{g}: owns_slot must be a function of the KV slots returning a bool mask "
                f"(or None), got {describe(owns_slot)}")
        cols = batch.columns
        qlens, ctx = _lengths(g, cols)
        n = qlens.size
        rows = batch.block_tables
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence | np.ndarray) \
                or len(rows) != n:
            got = len(rows) if isinstance(rows, Sequence | np.ndarray) else describe(rows)
            raise AdapterInputError(
                f"{g}: batch.block_tables must hold one row per request ({n}), got {got}")
        st = self.h2d_state
        mrope = self.mrope_positions
        if mrope is None and mrope_positions is not None:
            raise CountError(
                f"{g}: mrope_positions given but the adapter has no MRoPE planes; "
                "construct it with mrope=True")
        if not self._layouts:
            self._layouts = self._bind_layouts()
        layout = self._layouts[st.current_slot]
        t = int(np.add.reduce(qlens, dtype=np.int64)) if n else 0
        try:  # positions and KV slots: the same rule as decode, one compiled pass
            layout.plan(qlens, ctx, n, max(t, 0))
        except RequestLayoutError as exc:
            raise AdapterInputError(str(exc)) from exc
        ids = cols.token_ids
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.size != t:
            raise AdapterInputError(
                f"{g}: batch.columns.token_ids must be a 1-D array of the chunk's {t} query "
                f"tokens (one id per token), got {describe(ids)}")
        if n > 1 and int(np.add.reduce(ctx, dtype=np.int64)) > INT32_MAX:  # one fits int32
            raise AdapterInputError(
                f"{g}: the batch's context lengths sum to "
                f"{int(np.add.reduce(ctx, dtype=np.int64))} keys, more than the int32 key "
                "prefix (cu_seqlens_k) holds; split the batch")
        sources: list[np.ndarray | None] = []
        if mrope is not None:
            sources = check_prompt_positions(
                g, [None] * n if mrope_positions is None else mrope_positions, ctx, qlens)
        mask = None if owns_slot is None else self._owned(owns_slot, rows, qlens, ctx, t)
        tables = self.tables
        tables.prepare(rows, required_pages=layout.required_pages)  # validates every row
        layout.write()  # nothing below can fail
        cu = self.cu_seqlens_k.np
        cu[0] = 0
        np.cumsum(ctx, out=cu[1 : n + 1])
        st.set_count(self.cu_seqlens_k, n + 1)
        st.set_count(self.context_lens, n)
        if mrope is not None:  # the planes replace the 1-D positions
            write_prefill_planes(mrope.np, self.positions.np, qlens, ctx, sources, t)
            st.set_count(mrope, 3 * t)
            st.set_count(self.positions, None)
        else:
            st.set_count(self.positions, t)
        if mask is not None:
            self.slot_mapping.np[:t][~mask] = -1
        st.set_count(self.slot_mapping, t)
        stage = tables.stage(n) if publish_tables else ""
        if not publish_tables:
            st.set_count(self.block_tables, None)
        return PrefillPlan(n, t, stage)

    def _owned(self, owns_slot: Callable[[np.ndarray], np.ndarray], rows: Sequence[PageRow],
               qlens: np.ndarray, ctx: np.ndarray, t: int) -> np.ndarray:
        """``owns_slot``'s mask over this chunk's KV slots, checked (1-D bool, one per
        token) before any source is written: the slots come from the rows prepared into a
        private table, by the same layout rule as the published ones. Refused rows raise
        here, as the published table's preparation would."""
        if self._scratch is None:
            storage = np.zeros(self.block_tables.spec.shape, np.int32)
            slots = np.zeros(self.slot_mapping.spec.capacity, np.int64)
            layout = RequestLayout(
                self.group, self.page_size, storage,
                np.zeros(self.context_lens.spec.capacity, dtype=np.int32), slot_mapping=slots)
            snap = PageTableSnapshot(storage, pool_limit=self.pool_limit, native=self.native)
            self._scratch = (snap, layout, slots)
        snap, layout, slots = self._scratch
        layout.plan(qlens, ctx, qlens.size, t)  # the batch passed the same plan already
        snap.prepare(rows, required_pages=layout.required_pages)
        layout.write()
        view = slots[:t]
        view.flags.writeable = False  # the function reads the slots; it owns nothing here
        return bool_mask(self.group, "owns_slot(slots)", owns_slot(view), size=t)

    def mrope_planes(self, plan: PrefillPlan) -> torch.Tensor:
        """The chunk's MRoPE planes as a ``(3, num_tokens)`` view."""
        if self.mrope_positions is None:
            raise CountError(f"{self.group}: no MRoPE planes; construct with mrope=True")
        return mrope_planes(self.mrope_positions, plan.num_tokens)

    def prepare_attention(self, plan: PrefillPlan, cu_seqlens_q: torch.Tensor) -> None:
        """First consumer: token owners, KV page prefix and ``kv_indices``."""
        prepare_prefill_attention(
            cu_seqlens_q, self.cu_seqlens_k.gpu, self.block_tables.gpu, self.page_size,
            plan.num_reqs, self.token_request[: plan.num_tokens], self.kv_indptr,
            self.kv_indices,
        )


def _lengths(group: str, cols: BatchColumns) -> tuple[np.ndarray, np.ndarray]:
    """The batch's query and context lengths: 1-D C-contiguous int32 arrays of one length
    (the layout pass checks their values)."""
    out = []
    for name in ("query_lens", "context_lens"):
        a = getattr(cols, name, None)
        if (not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.int32
                or not a.flags.c_contiguous or not a.flags.aligned):
            raise AdapterInputError(
                f"{group}: batch.columns.{name} must be a 1-D C-contiguous int32 numpy array "
                f"with one entry per request, got {describe(a)}; build it with "
                "np.ascontiguousarray(values, dtype=np.int32)")
        out.append(a)
    q, c = out
    if q.size != c.size:
        raise AdapterInputError(
            f"{group}: batch.columns.context_lens has {c.size} entries but query_lens "
            f"{q.size}; pass one of each per request")
    return q, c
