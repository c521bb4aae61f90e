"""MHA decode metadata: slots, context lengths, block tables, KV prefix and positions.

The ``mha_decode`` producer group. Positions, KV slots, context lengths and the KV prefix
come from one :class:`h2d_core.RequestLayout` pass over the prepared table; the step
(plan, table rows, writes, counts, the table's stage) is one compiled
:class:`h2d_core.LayoutStep` call. First
consumer: KV-index generation (:func:`generate_kv_indices` builds ``kv_indices`` from the
block tables and ``kv_indptr``).
Block tables go through :func:`h2d_core.block_table_state`: unchanged tables are not
re-sent, appended pages travel as a few bytes inside the group's DMA, whole rows once the
changed spans pass the partial limits (more than 8 ranges, 32 for 4 MiB tables, half the
published rows' bytes, or the staging room: docs/design.md "Block tables").

Query widths may differ per request (uneven TBO ubatches, DSpark-style ragged verify): the
tokens are the requests' spans back to back, and the widest query (``max_query_len``, the
attention kernels' maximum query width) comes from the CPU lengths, never from a device
reduction or readback. Eager steps publish exactly the real tokens.

CUDA-graph padding (``padded`` = P > n real requests, q = the widest query): the graph grid
of ``P * q`` tokens, real tokens first:

* ``slot_mapping[:P*q]``: -1 for padding tokens (no KV write);
* ``context_lens[:P]``: 0 for padded requests;
* ``block_tables[:P]``: padded rows are empty (cleared to the fill value);
* ``kv_indptr[:P+1]``: the tail repeats the total, so padded requests own no pages;
* ``positions[:P*q]``: 0 for padding tokens.

A padded replay therefore reads nothing stale.

With ``mrope=True`` the group carries ``mrope_positions`` (three planes at the running
width, see :mod:`h2d_runner_adapters.mrope.inputs`) in place of ``positions``: the MRoPE
decode planes of a multimodal model.
Its ``mrope_deltas`` (one integer per request, int32 range in their own dtype) are
checked with the batch before any source is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from block_tables import BlockTable
from h2d_core import (
    OMITTED,
    PADDED_REQS,
    PADDED_TOKENS,
    CountError,
    CountRule,
    DeclarationError,
    FusedConsumer,
    H2DBuffer,
    H2DRunnerState,
    LayoutColumn,
    LayoutStep,
    RequestLayout,
    StepCounts,
    StepSpec,
    h2d_producer,
)

from ..batch import ScheduledBatch
from ..checks import AdapterInputError, int_value, padded_count, refuse_page_size, sub_plan
from ..consumers._launch import consumers_fusable, interpreted
from ..mrope.inputs import check_deltas, declare_mrope, mrope_planes
from ..mrope.inputs import layout_columns as mrope_layout_columns
from ..mrope.inputs import layout_outputs as mrope_layout_outputs
from ..mrope.positions import select_mrope_positions
from ..paged import PagedInputs
from ..plan_records import CountsPlan, slot_plans
from ..shape import StepShape, check_shape
from .kv_indices import _kv_indices_kernel, generate_kv_indices, launch_kv_indices_from_header

MHA_DECODE = "mha_decode"


class DecodePlan(CountsPlan):
    """What a decode step published: requests (real, padded), the widest query (from the
    CPU lengths), tokens (real, padded), KV pages and the block table's stage. A step's
    plan reads its record in place (valid until the slot's next step; see
    :mod:`~h2d_runner_adapters.plan_records`)."""

    __slots__ = ()
    FIELDS = ("num_reqs", "padded_reqs", "max_query_len", "num_tokens", "padded_tokens",
              "num_pages", "table_stage")
    COUNTS = (("num_pages", "kv_pages"),)
    num_reqs: int
    padded_reqs: int
    max_query_len: int
    num_tokens: int
    padded_tokens: int
    num_pages: int
    table_stage: str

    def __init__(self, num_reqs: int, padded_reqs: int, max_query_len: int,
                 num_tokens: int, padded_tokens: int, num_pages: int,
                 table_stage: str) -> None:
        self._counts = StepCounts(num_reqs, padded_reqs, max_query_len, num_tokens,
                                  padded_tokens, num_pages, table_stage)


def _joined(own: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """The adapter's layout arguments and its caller's, their registered outputs joined."""
    if not extra:
        return own
    joined = {**own, **extra}
    if "outputs" in own and "outputs" in extra:
        joined["outputs"] = [*own["outputs"], *extra["outputs"]]
    return joined


class MhaDecodeInputs(PagedInputs):
    """Declares the decode buffers, produces them, and runs KV-index generation.

    ``shape`` (a :class:`~h2d_runner_adapters.StepShape`) sizes them: ``max_reqs``
    requests, ``max_tokens`` tokens, block-table rows of ``max_pages_per_req`` pages of
    ``page_size`` tokens, page IDs in ``[0, num_pages)`` when given."""

    def __init__(
        self,
        state: H2DRunnerState,
        shape: StepShape,
        *,
        prefix: str = "",
        mrope: bool = False,
        group: str | None = None,
        fuse_kv_indices: bool | None = None,
    ) -> None:
        g = group or f"{prefix}{MHA_DECODE}"
        shape = check_shape(g, shape)
        super().__init__(state, shape, g, f"{prefix}block_tables")
        max_reqs, max_tokens = shape.max_reqs, shape.max_tokens
        buf = state.buffer
        self.slot_mapping = buf(f"{prefix}slot_mapping", (max_tokens,), torch.int64, group=g)
        self.context_lens = buf(f"{prefix}context_lens", (max_reqs,), torch.int32, group=g)
        self.kv_indptr = buf(f"{prefix}kv_indptr", (max_reqs + 1,), torch.int32, group=g)
        self.positions = buf(f"{prefix}positions", (max_tokens,), torch.int64, group=g)
        #: MRoPE planes (published instead of ``positions``), when declared with mrope=True
        self.mrope_positions: H2DBuffer | None = (
            declare_mrope(state, f"{prefix}mrope_positions", max_tokens, g) if mrope else None)
        # written on the device by the first consumer, never uploaded
        self.kv_indices = torch.zeros(max_reqs * shape.max_pages_per_req, dtype=torch.int32,
                                      device=state.device)
        # Padded requests get this adapter's own empty row: versioned, so padding costs
        # nothing on a hit; private, so nothing can append to it.
        self._pad_rows: list[BlockTable] = [BlockTable()] * max_reqs
        self._step: LayoutStep | None = None  # the compiled step, bound on first use
        self._plans: tuple[DecodePlan, ...] | None = None  # per slot, over its records
        #: KV-index generation fused into the publication (its graphs) when the packed
        #: group carries ``kv_indptr`` (see h2d_core.fused); None: launched by the caller
        self.kv_indices_consumer: FusedConsumer | None = None
        if fuse_kv_indices is None:  # the default: fused wherever the kernel can run there
            fuse_kv_indices = consumers_fusable(state.device)
        if fuse_kv_indices:
            if state.device.type == "cpu" and not interpreted(_kv_indices_kernel):
                raise DeclarationError(
                    f"{g}: fuse_kv_indices on a CPU state runs the Triton kernel in its "
                    "interpreter: set TRITON_INTERPRET=1 before triton is imported")
            self.kv_indices_consumer = state.fuse_consumer(
                f"{g}.kv_indices", [self.kv_indptr], self._enqueue_kv_indices)

    @h2d_producer(lambda self: self.group)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None, *,
                mrope_deltas: np.ndarray | None = None) -> DecodePlan:
        """Write and count the step's members (padding to ``padded`` requests of the
        widest query) and stage the block table. An MRoPE adapter needs ``mrope_deltas``
        (one integer per request). The batch is checked before any source is written."""
        return self._prepare(batch, padded, mrope_deltas)

    def request_layouts(
        self,
        name: str,
        *,
        cu_query: tuple[H2DBuffer, ...] = (),
        columns: Callable[[int], Sequence[LayoutColumn]] | None = None,
        outputs: Callable[[int], dict[str, Any]] | None = None,
    ) -> list[RequestLayout]:
        """One :class:`h2d_core.RequestLayout` per slot over this adapter's sources
        (positions, KV slots, context lengths, KV prefix), reading the slot's prepared
        table; plus the query prefix into each ``cu_query`` buffer, the columns
        ``columns(slot)`` gives over that slot's sources (a fused step's sampling and
        token columns) and the further outputs ``outputs(slot)`` names (a verify step's
        draft indices). After ``bind()``."""
        snapshots = self.tables.snapshots
        out = []
        for slot in range(self.h2d_state.num_slots):
            src = [b.source(slot).numpy() for b in (self.positions, self.slot_mapping,
                                                    self.context_lens, self.kv_indptr)]
            out.append(RequestLayout(
                name, self.page_size, snapshots[slot].storage,
                np.zeros(self.context_lens.spec.capacity, dtype=np.int32),
                positions=src[0], slot_mapping=src[1], context_lens=src[2],
                kv_page_indptr=src[3],
                cu_query=tuple(b.source(slot).numpy() for b in cu_query),
                columns=() if columns is None else columns(slot),
                **_joined(self._layout_outputs(slot), None if outputs is None else outputs(slot))))
        return out

    def _layout_outputs(self, slot: int) -> dict[str, Any]:
        """Further :class:`h2d_core.RequestLayout` outputs over ``slot``'s sources
        (a subclass's own members, e.g. MLA's last-page lengths): here the outputs MRoPE
        registers (:func:`~h2d_runner_adapters.mrope.inputs.layout_outputs`)."""
        if self.mrope_positions is None:
            return {}
        return {"outputs": mrope_layout_outputs(self.mrope_positions, slot)}

    def _layout_columns(self) -> list[LayoutColumn]:
        """The adapter's own request columns (values passed to each step): the one MRoPE
        registers, its per-request position deltas."""
        return mrope_layout_columns() if self.mrope_positions is not None else []

    def step_spec(self) -> StepSpec:
        """This adapter's part of a step (:class:`h2d_core.StepSpec`), what a fused step
        joins: the graph grid of tokens, padded requests (the KV prefix one more), MRoPE
        planes in place of the 1-D positions; the table and its empty padding rows."""
        rules = []
        positions = PADDED_TOKENS
        if self.mrope_positions is not None:  # three planes at the running width
            rules.append(CountRule(self.mrope_positions, PADDED_TOKENS, times=3))
            positions = OMITTED
        rules += [CountRule(self.positions, positions),
                  CountRule(self.slot_mapping, PADDED_TOKENS),
                  CountRule(self.context_lens, PADDED_REQS),
                  CountRule(self.kv_indptr, PADDED_REQS, 1)]
        return StepSpec(rules, self.tables, self._pad_rows)

    def _bind(self) -> LayoutStep:
        own = self._layout_columns()
        self._step = self.step_spec().bind(
            self.group, self.h2d_state, self.request_layouts(self.group, columns=lambda slot: own),
            error=CountError)
        return self._step

    def _prepare(self, batch: ScheduledBatch, padded: int | None,
                 mrope_deltas: np.ndarray | None = None) -> DecodePlan:
        if batch.page_size != self.page_size:
            refuse_page_size(self.group, batch.page_size, self.page_size)
        cols = batch.columns
        qlens = cols.query_lens
        n = qlens.size
        p = padded_count(self.group, n, padded)  # the capacity: the layout's check
        mrope = self.mrope_positions
        if mrope is not None:
            mrope_deltas = check_deltas(self.group, mrope_deltas, n)
        elif mrope_deltas is not None:
            raise AdapterInputError(
                f"{self.group}: mrope_deltas given but the adapter has no MRoPE planes; "
                "construct it with mrope=True")
        step = self._step
        if step is None:
            step = self._bind()
        # plan (every length checked; -1 tokens: the graph grid, p times the widest query,
        # exactly the real tokens when eager), prepare the rows, write, count and stage:
        # one call; nothing after it fails
        step.run(
            qlens, cols.context_lens, batch.block_tables, -1 if padded is None else p, -1,
            () if mrope is None else (mrope_deltas,))
        plans = self._plans
        if plans is None:
            plans = self._plans = slot_plans(self.h2d_state, step,
                                             lambda c, _: DecodePlan.over(c))
        return plans[self.h2d_state.current_slot]

    def mrope_planes(self, plan: DecodePlan) -> torch.Tensor:
        """The step's MRoPE planes as a ``(3, padded_tokens)`` view (the running width)."""
        if self.mrope_positions is None:
            raise AdapterInputError(f"{self.group}: no MRoPE planes; construct with mrope=True")
        if type(plan) is not DecodePlan:
            plan = sub_plan(self.group, "mrope_planes", plan, DecodePlan, "decode")
        width = int_value(self.group, "plan.padded_tokens", plan.padded_tokens, 0,
                          self.positions.spec.capacity)
        return mrope_planes(self.mrope_positions, width)

    def select_mrope_positions(self, plan: DecodePlan, sections: tuple[int, int, int],
                               out: torch.Tensor) -> torch.Tensor:
        """The MRoPE planes' first reader: each rotary frequency's position per token
        (:func:`~h2d_runner_adapters.mrope.positions.select_mrope_positions`)."""
        if type(plan) is not DecodePlan:
            plan = sub_plan(self.group, "select_mrope_positions", plan, DecodePlan, "decode")
        return select_mrope_positions(self.mrope_planes(plan), sections, out,
                                      plan.padded_tokens)

    def generate_kv_indices(self, plan: DecodePlan) -> torch.Tensor:
        """First consumer: ``kv_indices`` for the plan's rows (padding included). Fused
        (``fuse_kv_indices=True`` on a packed group), the publication already enqueued it,
        with the row count read on the device: this launches nothing. A fused step's plan
        (``DecodeStepPlan``) is read through its ``.decode``."""
        if type(plan) is not DecodePlan:
            plan = sub_plan(self.group, "generate_kv_indices", plan, DecodePlan, "decode")
        fused = self.kv_indices_consumer
        if fused is not None and fused.fused:
            return self.kv_indices
        generate_kv_indices(self.block_tables.gpu, self.kv_indptr.gpu, self.kv_indices,
                            plan.padded_reqs)
        return self.kv_indices

    def _enqueue_kv_indices(self, header: torch.Tensor, rows: tuple[int, ...]) -> None:
        launch_kv_indices_from_header(self.block_tables.gpu, self.kv_indptr.gpu,
                                      self.kv_indices, header, rows[0])
