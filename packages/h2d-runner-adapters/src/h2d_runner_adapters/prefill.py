"""Prefill attention inputs and ordinary positions: the ``prefill_inputs`` producer group.

Members: ``cu_seqlens_k`` (exclusive prefix of key lengths = cached + new tokens),
``context_lens`` (keys per request), ``slot_mapping`` (KV slot of every query token; -1 for
a position this rank does not write), ``positions``, the KV page prefix ``kv_indptr``
(``kv_indptr[r+1] - kv_indptr[r] = ceil(context_len / page)``, as decode's ``kv_indptr``),
each token's request ``token_request`` and the block tables (through
:func:`h2d_core.block_table_state`, its own state: prefill and decode tables are separate
buffers). The query prefix ``cu_seqlens_q`` comes from the token inputs.

One compiled :class:`h2d_core.LayoutStep` call plans the chunk (every length checked),
prepares the rows, writes positions, KV slots, context lengths, ``cu_seqlens_k`` (the
layout's ``context_prefix``), the page prefix and the token owners, counts every member and
stages the table; the adapter's own checks that need the planned chunk (token ids,
``owns_slot``'s mask, MRoPE prompt positions) run inside it, before anything is written.

Each member publishes the chunk's entries only: ``num_tokens`` per-token entries,
``num_reqs`` (+1 for a prefix) per-request ones. Past them a destination is undefined (it
keeps whatever an earlier chunk published): read ``token_request[:num_tokens]`` and
``kv_indptr[:num_reqs + 1]``.

First consumer: KV-index generation (:meth:`PrefillInputs.prepare_attention`, decode's
kernel over the published page prefix and block tables). An engine that derives the page
prefix and the token owners on the device instead can call
:func:`prepare_prefill_attention` on the published ``cu_seqlens_q``, ``cu_seqlens_k`` and
block tables with tensors of its own.

Prefill runs eagerly: no graph padding. The block tables are needed by this runner's paged
attention whether or not a prefix hit exists; an engine whose prefill attention reads the
current chunk directly can omit them when no request has cached tokens
(``publish_tables=False``) while still preparing the CPU rows; such a chunk has no KV
indices (:meth:`PrefillInputs.prepare_attention` refuses it: the GPU table is an earlier
chunk's).

With ``mrope=True`` the group carries ``prefill_mrope_positions`` (three planes at the
chunk's token width, see :mod:`h2d_runner_adapters.mrope.inputs`) in place of the positions.
With ``last_page_lens=True`` it also carries ``prefill_kv_last_page_lens`` (int32 per
request: tokens in each request's last page after the chunk, ``(ctx - 1) % page + 1``, the
convention MLA kernels such as AITER's read with the page prefix and indices), from the
same layout pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from h2d_core import (
    OMITTED,
    PADDED_REQS,
    PADDED_TOKENS,
    CountError,
    CountRule,
    EpochError,
    H2DBuffer,
    H2DRunnerState,
    LayoutColumn,
    LayoutStep,
    RequestLayout,
    StepCounts,
    StepSpec,
    describe_value,
)

from .batch import ScheduledBatch
from .checks import (
    AdapterInputError,
    length_column,
    page_rows,
    refuse_page_size,
    sub_plan,
)
from .consumers import generate_kv_indices
from .mrope.inputs import (
    check_deltas,
    check_prompt_positions,
    declare_mrope,
    mrope_planes,
    write_prefill_planes,
)
from .paged import PagedInputs
from .plan_records import CountsPlan, slot_plans
from .prefill_entry import OwnsSlot, chunk_producer
from .prefill_owned import OwnedSlots
from .shape import StepShape, check_shape


class PrefillPlan(CountsPlan):
    """What a prefill chunk published: requests, tokens, the block table's stage ("" when
    the chunk left the table out: ``publish_tables=False``) and the chunk's KV pages (the
    page prefix's total, from the CPU lengths). A chunk's plan is its slot's record, read
    in place: valid until the slot's next step (see
    :mod:`~h2d_runner_adapters.plan_records`)."""

    __slots__ = ()
    FIELDS = ("num_reqs", "num_tokens", "table_stage", "num_pages")
    COUNTS = (("num_pages", "kv_pages"),)
    num_reqs: int
    num_tokens: int
    table_stage: str
    num_pages: int

    def __init__(self, num_reqs: int, num_tokens: int, table_stage: str,
                 num_pages: int) -> None:
        self._counts = StepCounts(num_reqs, num_reqs, 1, num_tokens, num_tokens, num_pages,
                                  table_stage)


PREFILL_INPUTS = "prefill_inputs"
#: isinstance's class tuple, built once (a ``A | B`` union is an object per call)
_BOOLS = (bool, np.bool_)


class PrefillInputs(PagedInputs):
    """Declares the prefill buffers, produces them, and runs attention preparation.

    ``shape`` (a :class:`~h2d_runner_adapters.StepShape`) sizes them: chunks of at most
    ``max_reqs`` requests and ``max_tokens`` tokens, rows of ``max_pages_per_req`` pages.

    Every member is an :class:`H2DBuffer` read through ``.gpu``, the KV page prefix
    ``kv_indptr`` and the token owners ``token_request`` included, as decode's
    ``kv_indptr`` is: the producer computes them on the host in the same layout pass as
    the positions. Entries past the chunk's ``num_tokens`` (``num_reqs + 1`` for the
    prefixes) are undefined: an earlier chunk's.

    Why published rather than derived on the device: the host has the lengths in hand,
    so they cost one store per token and per request in the compiled pass and 4 bytes each
    in the DMA that already carries 20 bytes per token; in return attention preparation is
    one launch (KV-index generation, decode's consumer) where the device derivation takes
    two, and the chunk's KV page count is a host value (``PrefillPlan.num_pages``). An
    engine that derives them on the device anyway calls
    :func:`~h2d_runner_adapters.prepare_prefill_attention` with tensors of its own.
    """

    def __init__(
        self,
        state: H2DRunnerState,
        shape: StepShape,
        *,
        mrope: bool = False,
        last_page_lens: bool = False,
    ) -> None:
        g = PREFILL_INPUTS
        shape = check_shape(g, shape)
        super().__init__(state, shape, g, "prefill_block_tables")
        max_reqs, max_tokens = shape.max_reqs, shape.max_tokens
        buf = state.buffer
        self.cu_seqlens_k = buf("prefill_cu_seqlens_k", (max_reqs + 1,), torch.int32, group=g)
        self.context_lens = buf("prefill_context_lens", (max_reqs,), torch.int32, group=g)
        self.slot_mapping = buf("prefill_slot_mapping", (max_tokens,), torch.int64, group=g)
        self.positions = buf("prefill_positions", (max_tokens,), torch.int64, group=g)
        self.mrope_positions: H2DBuffer | None = (
            declare_mrope(state, "prefill_mrope_positions", max_tokens, g) if mrope else None)
        self.kv_last_page_lens: H2DBuffer | None = (
            buf("prefill_kv_last_page_lens", (max_reqs,), torch.int32, group=g)
            if last_page_lens else None)
        # computed by the layout pass, carried by the group (see the class docstring)
        self.kv_indptr = buf("prefill_kv_indptr", (max_reqs + 1,), torch.int32, group=g)
        self.token_request = buf("prefill_token_request", (max_tokens,), torch.int32, group=g)
        #: KV-index generation's output (a device tensor, never uploaded)
        self.kv_indices = torch.zeros(max_reqs * shape.max_pages_per_req, dtype=torch.int32,
                                      device=state.device)
        self._step: LayoutStep | None = None  # the compiled step, bound on first use
        self._epoch_groups = state.groups  # what the open epoch produced and published
        self._plans: tuple[PrefillPlan, ...] = ()  # per slot, over the step's records
        # the call's inputs the planned-chunk checks read (set by run_chunk, per call):
        # group, token ids, rows, query and context lengths, owns_slot, MRoPE positions
        # and deltas, whether the ids are this adapter's to check (no fused layout column)
        self._call: list[Any] = [None] * 9
        # what those checks found, for after the write: owns_slot's mask, MRoPE sources
        self._mask: np.ndarray | None = None
        self._sources: Sequence[np.ndarray | None] = ()
        #: owns_slot's input, computed before any write (made on first use)
        self._owned: OwnedSlots | None = None

    def request_layouts(
        self,
        name: str,
        *,
        cu_query: tuple[H2DBuffer, ...] = (),
        columns: Callable[[int], Sequence[LayoutColumn]] | None = None,
    ) -> list[RequestLayout]:
        """One :class:`h2d_core.RequestLayout` per slot over this adapter's sources
        (positions, KV slots, context lengths, the key and KV page prefixes, the token
        owners and last-page lengths when declared), reading the slot's prepared table; plus
        the query prefix into each ``cu_query`` buffer and the columns ``columns(slot)``
        gives over that slot's sources (a fused step's sampling and token columns). After
        ``bind()``."""
        last = self.kv_last_page_lens
        layouts = []
        for slot, snap in enumerate(self.tables.snapshots):
            def src(b: H2DBuffer, slot: int = slot) -> np.ndarray:
                return b.source(slot).numpy()
            extra: dict[str, Any] = {} if last is None else {"last_page_lens": src(last)}
            layouts.append(RequestLayout(
                name, self.page_size, snap.storage,
                np.zeros(self.context_lens.spec.capacity, dtype=np.int32),
                positions=src(self.positions), slot_mapping=src(self.slot_mapping),
                context_lens=src(self.context_lens), context_prefix=src(self.cu_seqlens_k),
                kv_page_indptr=src(self.kv_indptr), token_requests=src(self.token_request),
                cu_query=tuple(src(b) for b in cu_query),
                columns=() if columns is None else columns(slot), **extra))
        return layouts

    def step_spec(self) -> StepSpec:
        """This adapter's part of a chunk's step (:class:`h2d_core.StepSpec`), what a fused
        step joins: each member's count (eager: the padded counts are the real ones; MRoPE
        planes replace the positions, their count set after the pass), the table, and the
        checks that need the planned chunk. A step bound over it runs through
        :meth:`run_chunk`, which hands those checks the call's arguments."""
        positions = OMITTED if self.mrope_positions is not None else PADDED_TOKENS
        rules = [CountRule(self.positions, positions),
                 CountRule(self.slot_mapping, PADDED_TOKENS),
                 CountRule(self.context_lens, PADDED_REQS),
                 CountRule(self.cu_seqlens_k, PADDED_REQS, 1),
                 CountRule(self.kv_indptr, PADDED_REQS, 1),
                 CountRule(self.token_request, PADDED_TOKENS)]
        if self.kv_last_page_lens is not None:
            rules.append(CountRule(self.kv_last_page_lens, PADDED_REQS))
        return StepSpec(rules, self.tables, check=self._check_planned)

    def _bind(self) -> LayoutStep:
        step = self.step_spec().bind(self.group, self.h2d_state,
                                     self.request_layouts(self.group), error=AdapterInputError)
        self._plans = slot_plans(self.h2d_state, step, lambda c, slot: PrefillPlan.over(c))
        self._step = step
        return step

    prepare = chunk_producer(PREFILL_INPUTS, owner="PrefillInputs", doc="""Stage one prefill
        (chunk) batch: ``prepare(batch, *, publish_tables=True, owns_slot=None,
        mrope_positions=None, mrope_deltas=None)``, the adapter's plan returned.

        ``owns_slot`` (optional) maps the token positions' KV slots (an int64 array, one
        per token) to a 1-D bool mask of the ones this rank writes (context-parallel KV);
        the others get -1. An MRoPE adapter takes ``mrope_positions``: per request its
        ``[3, L]`` prompt positions, or None (text only: its ordinary positions on every
        plane); with ``mrope_deltas`` (one int32 delta per request, as decode takes) a
        prompt may be shorter than the context: a recompute's re-prefill of generated
        tokens gets ``position + delta`` past the prompt, as decode gives them. Every
        argument is checked, ``owns_slot``'s mask included, before any source is written: a
        refusal raises :class:`AdapterInputError` (or the block table's own error) and
        changes nothing.
        """)

    _fused_values = None  # no fused columns: the adapter checks the token ids itself

    def run_chunk(
        self,
        step: LayoutStep,
        batch: ScheduledBatch,
        values: Sequence[Any],
        publish_tables: bool,
        owns_slot: OwnsSlot | None,
        mrope_positions: Sequence[np.ndarray | None] | None,
        mrope_deltas: np.ndarray | None,
        g: str,
    ) -> None:
        """Check the arguments, run ``step`` (bound over :meth:`step_spec`: this adapter's
        layout pass, or a fused step's over the same sources with its ``values`` columns,
        ``token_ids`` among them), then write what the pass does not (MRoPE planes,
        ``owns_slot``'s -1 slots, an omitted table); the caller returns its slot's plan
        over the step's record. A refusal raises naming group ``g`` (the step's
        publication group) and changes nothing. Outside a producer entry of
        ``prefill_inputs`` (the group not entered this epoch, or published already) it
        raises :class:`h2d_core.EpochError` and writes nothing."""
        groups = self._epoch_groups  # an entry of prefill_inputs open: produced, unsent
        if PREFILL_INPUTS not in groups.produced or PREFILL_INPUTS in groups.published:
            raise EpochError(
                f"{g}: a prefill chunk writes {PREFILL_INPUTS}'s sources, but no producer "
                "entry of that group is open this epoch; call run_chunk inside a "
                f"@h2d_producer method that declares {PREFILL_INPUTS}")
        if not isinstance(batch, ScheduledBatch):
            raise AdapterInputError(
                f"{g}: batch must be a ScheduledBatch, got {describe_value(batch)}")
        if batch.page_size != self.page_size:
            refuse_page_size(g, batch.page_size, self.page_size)
        if type(publish_tables) is not bool and not isinstance(publish_tables, _BOOLS):
            raise AdapterInputError(
                f"{g}: publish_tables must be a bool, got {describe_value(publish_tables)}")
        if owns_slot is not None and not callable(owns_slot):
            raise AdapterInputError(
                f"{g}: owns_slot must be a function of the KV slots returning a bool mask "
                f"(or None), got {describe_value(owns_slot)}")
        cols = batch.columns
        qlens = length_column(g, cols, "query_lens")
        ctx = length_column(g, cols, "context_lens")
        if qlens.size != ctx.size:
            raise AdapterInputError(
                f"{g}: batch.columns.context_lens has {ctx.size} entries but query_lens "
                f"{qlens.size}; pass one of each per request")
        n = qlens.size
        rows = page_rows(g, batch.block_tables, n)
        mrope = self.mrope_positions
        if mrope is None and (mrope_positions is not None or mrope_deltas is not None):
            given = "mrope_positions" if mrope_positions is not None else "mrope_deltas"
            raise CountError(
                f"{g}: {given} given but the adapter has no MRoPE planes; construct it with "
                "mrope=True")
        deltas = None if mrope_deltas is None else check_deltas(g, mrope_deltas, n)
        call = self._call
        call[0] = g
        call[1] = cols.token_ids
        call[2] = rows
        call[3] = qlens
        call[4] = ctx
        call[5] = owns_slot
        call[6] = mrope_positions
        call[7] = deltas
        call[8] = not values  # a fused step's layout checks the ids as a column
        try:
            # plan (every length and column checked; eager: exactly the real tokens), the
            # checks of the planned chunk (_check_planned), prepare the rows, write, count,
            # stage
            out = step.run(qlens, ctx, rows, -1, -1, values, bool(publish_tables))
        except BaseException:
            self._mask, self._sources = None, ()  # a refused call leaves no findings
            raise
        finally:
            # keep no caller object past the call
            call[1] = call[2] = call[3] = call[4] = call[5] = call[6] = call[7] = None
        mask, sources = self._mask, self._sources
        self._mask, self._sources = None, ()
        st = self.h2d_state
        if mrope is not None:  # the planes replace the 1-D positions (omitted above)
            t = out.num_tokens
            write_prefill_planes(mrope.np, self.positions.np, qlens, ctx, sources, t,
                                 deltas)
            st.set_count(mrope, 3 * t)
        if mask is not None:
            self.slot_mapping.np[: out.num_tokens][~mask] = -1
        if not publish_tables:
            st.set_count(self.block_tables, None)

    _run_chunk = run_chunk  # chunk_producer's entry calls it (no frame more)

    def _check_planned(self, layout: RequestLayout) -> None:
        """The checks that need the planned chunk (its token count), before any write:
        one token id per token (the layout refused a key prefix past int32; a fused step's
        layout checked the ids as a column already), MRoPE prompt positions,
        ``owns_slot``'s mask (kept for after the write). A steady chunk without them reads
        no count here (a count above 256 read from Python makes an int object)."""
        g, ids, rows, qlens, ctx, owns_slot, mrope_positions, deltas, own_ids = self._call
        # this call's findings only: a refused earlier call may have left its own
        self._mask, self._sources = None, ()
        if own_ids:
            t = layout.num_tokens
            if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.size != t:
                raise AdapterInputError(
                    f"{g}: batch.columns.token_ids must be a 1-D array of the chunk's {t} "
                    f"query tokens (one id per token), got {describe_value(ids)}")
        if self.mrope_positions is not None:
            n = layout.num_reqs
            self._sources = check_prompt_positions(
                g, [None] * n if mrope_positions is None else mrope_positions, ctx, qlens,
                deltas)
        if owns_slot is not None:
            owned = self._owned
            if owned is None:
                owned = self._owned = OwnedSlots(
                    self.group, self.page_size, self.block_tables.spec.shape,
                    self.slot_mapping.spec.capacity, self.context_lens.spec.capacity,
                    self.pool_limit)
            self._mask = owned.mask(g, owns_slot, rows, qlens, ctx, layout.num_tokens)

    def mrope_planes(self, plan: PrefillPlan) -> torch.Tensor:
        """The chunk's MRoPE planes as a ``(3, num_tokens)`` view."""
        if self.mrope_positions is None:
            raise CountError(f"{self.group}: no MRoPE planes; construct with mrope=True")
        if type(plan) is not PrefillPlan:
            plan = sub_plan(self.group, "mrope_planes", plan, PrefillPlan, "prefill")
        return mrope_planes(self.mrope_positions, plan.num_tokens)

    def prepare_attention(self, plan: PrefillPlan, group: str | None = None) -> torch.Tensor:
        """First consumer: ``kv_indices`` (returned) from the published block tables and
        ``kv_indptr``, decode's KV-index generation; its first ``plan.num_pages`` entries
        are the chunk's pages, request after request.

        A chunk prepared with ``publish_tables=False`` (``plan.table_stage == ""``) left
        the table out of its publication: the GPU table holds an earlier chunk's rows, so
        its indices would be that chunk's pages. It is refused with
        :class:`AdapterInputError` before any launch (``kv_indices`` unchanged). A refusal
        names ``group`` (default: this adapter's; a fused step passes its own)."""
        g = self.group if group is None else group
        if type(plan) is not PrefillPlan:
            plan = sub_plan(g, "prepare_attention", plan, PrefillPlan, "prefill")
        if plan.table_stage == "":
            raise AdapterInputError(
                f"{g}: prepare_attention reads the published block tables, but this chunk "
                "was prepared with publish_tables=False, so the GPU table still holds an "
                "earlier chunk's rows and its KV indices would be that chunk's pages; "
                "prepare the chunk with publish_tables=True to generate its KV indices (or "
                "read its keys through slot_mapping without them)")
        generate_kv_indices(self.block_tables.gpu, self.kv_indptr.gpu, self.kv_indices,
                            plan.num_reqs)
        return self.kv_indices


