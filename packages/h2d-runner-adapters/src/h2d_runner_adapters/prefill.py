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

from block_tables import RequestLayout, RequestLayoutError
from h2d_core import CountError, H2DBuffer, H2DRunnerState, h2d_producer

from .batch import ScheduledBatch
from .consumers import prepare_prefill_attention
from .mha_decode import select_layout
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

    def _bind_layouts(self) -> list[RequestLayout]:
        cls = select_layout(self.native, self.group)
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

        ``owns_slot`` (optional) maps the token positions' KV slots to a bool mask of the
        ones this rank writes (context-parallel KV); the others get -1. An MRoPE adapter
        takes ``mrope_positions``: per request its ``[3, L]`` prompt positions, or None
        (text only: its ordinary positions on every plane).
        """
        cols = batch.columns
        n = cols.query_lens.size
        st = self.h2d_state
        mrope = self.mrope_positions
        sources: list[np.ndarray | None] = []
        if mrope is not None:
            sources = check_prompt_positions(
                self.group, [None] * n if mrope_positions is None else mrope_positions,
                cols.context_lens)
        elif mrope_positions is not None:
            raise CountError(
                f"{self.group}: mrope_positions given but the adapter has no MRoPE planes; "
                "construct it with mrope=True")
        if not self._layouts:
            self._layouts = self._bind_layouts()
        layout = self._layouts[st.current_slot]
        try:  # positions and KV slots: the same rule as decode, one compiled pass
            layout.plan(cols.query_lens, cols.context_lens, n, cols.token_ids.size)
        except RequestLayoutError as exc:
            raise CountError(str(exc)) from exc
        t = layout.padded_tokens
        tables = self.tables
        tables.prepare(batch.block_tables, required_pages=layout.required_pages)
        layout.write()
        cu = self.cu_seqlens_k.np
        cu[0] = 0
        np.cumsum(cols.context_lens, out=cu[1 : n + 1])
        st.set_count(self.cu_seqlens_k, n + 1)
        st.set_count(self.context_lens, n)
        if mrope is not None:  # the planes replace the 1-D positions
            write_prefill_planes(mrope.np, self.positions.np, cols.query_lens,
                                 cols.context_lens, sources, t)
            st.set_count(mrope, 3 * t)
            st.set_count(self.positions, None)
        else:
            st.set_count(self.positions, t)
        slots = self.slot_mapping.np[:t]
        if owns_slot is not None:
            slots[~owns_slot(slots)] = -1
        st.set_count(self.slot_mapping, t)
        stage = tables.stage(n) if publish_tables else ""
        if not publish_tables:
            st.set_count(self.block_tables, None)
        return PrefillPlan(n, t, stage)

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
