"""DeepSeek-V4/V4.1 decode metadata: the ``v41_metadata`` group and its producer.

One group, one DMA and one scatter per step (with ``token_inputs``: the spec's "two H2Ds
and two scatters" of an ordinary V4.1 DSpark decode), graph padding included:

* ``v41_positions`` (int64, per token): ``ctx_i - L_i + j`` for token ``j`` of request ``i``
  (tail-anchored, as the plans); 0 for padding tokens;
* ``v41_token_batch_ids`` (int32, per token): the owning request; -1 for padding tokens;
* ``v41_seq_lens`` (int32, per request): committed context after this step (visibility);
  0 for padded requests;
* ``v41_state_slot_out`` / ``v41_state_slot_in`` (int32, per request): the physical state
  slot written, and the one read (a fork source, else the same); padded requests get the
  adapter's private dummy slot;
* ``v41_compress_plan_{r}`` / ``v41_write_plan_{r}`` for each ratio ``r`` (int32 rows of
  ``[ragged_id, batch_id, position, window_len]``, counted in rows with ``set_count``): the
  graph form, ``P * ceil(q/r)`` compress rows and ``P * min(q, K)`` write rows, real rows
  first and ``-1`` rows after them;
* ``v41_block_tables`` (int32 ``[S, B]``, 256-token blocks): through the shared
  ``block_table_state`` (changed rows travel as byte ranges inside the DMA); padded requests
  get a private row holding the dummy block;
* ``v41_qo_indptr`` (fp8 KV only, int32 ``[T + 1]``): ``arange(t + 1)``, then ``t`` repeated.

Rows, per token and per request, come from one :class:`block_tables.RequestLayout` pass
over the prepared table. First consumer: step indptr generation
(:func:`generate_v4_step_indptrs`, :func:`expand_v4_token_tables`), which derives the
per-token SWA/CSA/HCA prefixes, committed counts, per-token block tables and HCA index
head on the GPU. Further consumers: the decode window tails
(:meth:`V41MetadataInputs.write_decode_window_indices`), prefill indptrs with context
parallelism (:meth:`~V41MetadataInputs.generate_prefill_indptrs`), the sparse (Opus)
prefill indices and the FP8 DSpark indexer rectangle; ``prefix=`` declares a TBO ubatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from block_tables import (
    BlockTable,
    LayoutColumn,
    LayoutPlan,
    RequestLayout,
    RequestLayoutError,
)
from h2d_core import (
    CountBatch,
    CountError,
    DeclarationError,
    H2DBuffer,
    H2DRunnerState,
    h2d_producer,
)

from .batch import PageRow
from .consumers import (
    DecodeWindowIndices,
    PrefillIndices,
    PrefillIndptrs,
    StepIndptrs,
    WindowGeometry,
    expand_v4_token_tables,
    generate_v4_prefill_indptrs,
    generate_v4_step_indptrs,
    write_v4_decode_window_indices,
    write_v4_prefill_indices,
)
from .mha_decode import select_layout
from .paged import PagedInputs

V41_METADATA = "v41_metadata"
#: V4 block size (tokens per block-table entry)
V4_BLOCK = 256
#: (ratio, window K): ratio 4 pools an overlapping window of 2 * 4, ratio 128 one of 128
V4_RATIOS: tuple[tuple[int, int], ...] = ((4, 8), (128, 128))


@dataclass(frozen=True)
class RequestSpan:
    """One request's interval in a V4.1 step and its state slot; nothing about its pages
    (they arrive separately, as rows, in :meth:`V41MetadataInputs.begin_step`).

    ``num_tokens`` query tokens run this step, ending at ``context_len`` (the committed
    length after the step). ``fork_source`` (a physical state slot, or -1) is the slot whose
    compressor ring this step reads instead of ``state_slot``.
    """

    num_tokens: int
    context_len: int
    state_slot: int
    fork_source: int = -1


@dataclass(frozen=True)
class SpanColumns:
    """A batch of spans as int32 columns: what a scheduler that keeps arrays passes."""

    query_lens: np.ndarray
    context_lens: np.ndarray
    state_slots_out: np.ndarray
    state_slots_in: np.ndarray

    @classmethod
    def from_spans(cls, spans: Sequence[RequestSpan]) -> SpanColumns:
        n = len(spans)
        out = np.fromiter((s.state_slot for s in spans), np.int32, n)
        fork = np.fromiter((s.fork_source for s in spans), np.int32, n)
        return cls(
            query_lens=np.fromiter((s.num_tokens for s in spans), np.int32, n),
            context_lens=np.fromiter((s.context_len for s in spans), np.int32, n),
            state_slots_out=out,
            state_slots_in=np.where(fork >= 0, fork, out).astype(np.int32),
        )


class V41Plan(NamedTuple):
    num_reqs: int
    padded_reqs: int
    num_tokens: int
    padded_tokens: int
    max_query_len: int
    #: per ratio, in ``ratios`` order: (real compress rows, published compress rows,
    #: real write rows, published write rows)
    plan_rows: tuple[tuple[int, int, int, int], ...]
    table_stage: str


class V41MetadataInputs(PagedInputs):
    """Declares the ``v41_metadata`` buffers, produces them, and runs the first consumer.

    ``dummy_state_slot`` and ``dummy_block`` are the engine's reserved padding storage:
    padded requests point only at them. ``fp8`` adds ``v41_qo_indptr`` to the group.
    ``prefix`` (e.g. ``"ub0_"``) declares a two-batch-overlap ubatch's own buffers and
    group (``ub0_v41_metadata``): its consumers keep views of them, and its widest query
    comes from the CPU lengths (``V41Plan.max_query_len``), never a device reduction.
    ``envelope_rows`` (compressed rows per block over all compressed layers) enables the
    per-token expansion of the first consumer (per-token block tables and the HCA index
    head, device buffers of ``max_tokens`` rows).
    """

    def __init__(
        self,
        state: H2DRunnerState,
        *,
        max_reqs: int,
        max_tokens: int,
        max_blocks_per_req: int,
        dummy_state_slot: int,
        dummy_block: int,
        num_blocks: int | None = None,
        ratios: Sequence[tuple[int, int]] = V4_RATIOS,
        window: int = 128,
        index_topk: int = 1024,
        fp8: bool = False,
        envelope_rows: int | None = None,
        max_ranges: int = 64,
        native: bool | None = None,
        prefix: str = "",
    ) -> None:
        g = f"{prefix}{V41_METADATA}"
        self.prefix = prefix
        super().__init__(state, g, f"{prefix}v41_block_tables", max_reqs=max_reqs,
                         max_pages_per_req=max_blocks_per_req, page_size=V4_BLOCK,
                         num_pages=num_blocks, max_ranges=max_ranges)
        self.native = native
        self.ratios = tuple(ratios)
        self.window = window
        self.index_topk = index_topk
        self.dummy_state_slot = dummy_state_slot
        buf = state.buffer
        self.positions = buf(f"{prefix}v41_positions", (max_tokens,), torch.int64, group=g)
        self.token_batch_ids = buf(f"{prefix}v41_token_batch_ids", (max_tokens,),
                                   torch.int32, group=g)
        self.seq_lens = buf(f"{prefix}v41_seq_lens", (max_reqs,), torch.int32, group=g)
        self.state_slot_out = buf(f"{prefix}v41_state_slot_out", (max_reqs,), torch.int32,
                                  group=g)
        self.state_slot_in = buf(f"{prefix}v41_state_slot_in", (max_reqs,), torch.int32,
                                 group=g)
        self.compress_plans: list[H2DBuffer] = []
        self.write_plans: list[H2DBuffer] = []
        for r, k in self.ratios:
            self.compress_plans.append(buf(
                f"{prefix}v41_compress_plan_{r}", (max_tokens // r + max_reqs, 4), torch.int32,
                group=g, unit="rows"))
            self.write_plans.append(buf(
                f"{prefix}v41_write_plan_{r}", (min(max_tokens, max_reqs * k), 4), torch.int32,
                group=g, unit="rows"))
        # prefill only (omitted from decode publications): each request's chunk start
        self.chunk_starts = buf(f"{prefix}v41_chunk_starts", (max_reqs,), torch.int32,
                                group=g)
        self.qo_indptr = (buf(f"{prefix}v41_qo_indptr", (max_tokens + 1,), torch.int32,
                              group=g) if fp8 else None)
        dev = state.device
        # written on the device by the first consumer, never uploaded
        def zeros(k: int) -> torch.Tensor:
            return torch.zeros(k, dtype=torch.int32, device=dev)
        self.step_indptrs = StepIndptrs(zeros(max_tokens + 1), zeros(max_tokens + 1),
                                        zeros(max_tokens + 1), zeros(max_tokens),
                                        zeros(max_reqs))
        self.prefill_indptrs = PrefillIndptrs(zeros(max_tokens + 1), zeros(max_tokens + 1),
                                              zeros(max_tokens + 1), zeros(max_tokens + 1),
                                              zeros(max_reqs + 1), zeros(max_tokens),
                                              zeros(max_tokens), zeros(max_tokens))
        self.envelope_rows = envelope_rows
        self.block_tables_per_token: torch.Tensor | None = None
        self.hca_indices: torch.Tensor | None = None
        if envelope_rows is not None:
            self.block_tables_per_token = torch.zeros(max_tokens, max_blocks_per_req,
                                                      dtype=torch.int32, device=dev)
            self.hca_indices = torch.zeros(max_tokens * (window + 2 * max_blocks_per_req),
                                           dtype=torch.int32, device=dev)
        # padded requests read only the dummy block (private: nothing appends to it)
        self._pad_rows: list[BlockTable] = [BlockTable([dummy_block])] * max_reqs
        self._layouts: list[RequestLayout] = []
        self._prefill_layouts: list[RequestLayout] = []
        self._tokens = np.arange(max_tokens + 1, dtype=np.int32)
        self._counts: CountBatch | None = None
        self._qo_written: list[tuple[int, int] | None] = [None] * state.num_slots

    # -- binding -------------------------------------------------------------------------
    def _bind(self) -> None:
        cls = select_layout(self.native, self.group)
        snapshots = self.tables.snapshots
        for slot in range(self.h2d_state.num_slots):
            def src(b: H2DBuffer, slot: int = slot) -> np.ndarray:
                return b.source(slot).numpy()

            def layout(graph: bool, slot: int = slot) -> RequestLayout:
                # decode: the graph grid, padding to the dummy slot; prefill: eager plans,
                # no padding, plus the chunk starts
                pad = self.dummy_state_slot if graph else None
                extra = [] if graph else [LayoutColumn("chunk_starts", src(self.chunk_starts),
                                                       pad=None)]
                return cls(
                    self.group, V4_BLOCK, snapshots[slot].storage,
                    np.zeros(self.seq_lens.spec.capacity, dtype=np.int32),
                    positions=src(self.positions), token_requests=src(self.token_batch_ids),
                    context_lens=src(self.seq_lens),
                    columns=[LayoutColumn("state_slot_out", src(self.state_slot_out), pad=pad),
                             LayoutColumn("state_slot_in", src(self.state_slot_in), pad=pad),
                             *extra],
                    plans=[LayoutPlan(b.name, src(b), r, k, tail, graph)
                           for (r, k), cb, wb in zip(self.ratios, self.compress_plans,
                                                     self.write_plans, strict=True)
                           for b, tail in ((cb, False), (wb, True))])
            self._layouts.append(layout(True))
            self._prefill_layouts.append(layout(False))
        members = [self.positions, self.token_batch_ids, self.seq_lens, self.state_slot_out,
                   self.state_slot_in, self.chunk_starts]
        for cb, wb in zip(self.compress_plans, self.write_plans, strict=True):
            members += [cb, wb]
        if self.qo_indptr is not None:
            members.append(self.qo_indptr)
        self._counts = self.h2d_state.count_batch(members, native=self.native)

    # -- the producer --------------------------------------------------------------------
    @h2d_producer(lambda self: self.group)
    def begin_step(
        self,
        spans: Sequence[RequestSpan] | SpanColumns,
        *,
        block_tables: Sequence[PageRow],
        padded: int | None = None,
    ) -> V41Plan:
        """Write and count every member for this step's ``spans`` (padded to ``padded``
        requests of the widest query: the graph grid) and stage the block table from
        ``block_tables`` (one row per span, versioned or not). Everything is checked, rows
        included, before any source is written."""
        cols = spans if isinstance(spans, SpanColumns) else SpanColumns.from_spans(spans)
        if not self._layouts:
            self._bind()
        st = self.h2d_state
        slot = st.current_slot
        layout = self._layouts[slot]
        n = len(cols.query_lens)
        if padded is not None and (isinstance(padded, bool) or not isinstance(padded, int)
                                   or padded < n):
            raise CountError(
                f"{self.group}: padded={padded!r} must be an int >= the batch's {n} "
                "requests (pad up to a captured graph size, never down)")
        if len(block_tables) != n:
            raise CountError(
                f"{self.group}: {len(block_tables)} block-table rows for {n} spans; pass "
                "one row per span")
        try:
            layout.plan(cols.query_lens, cols.context_lens, -1 if padded is None else padded,
                        -1, (cols.state_slots_out, cols.state_slots_in))
        except RequestLayoutError as exc:
            raise CountError(str(exc)) from exc
        p, t, pt = layout.padded_reqs, layout.num_tokens, layout.padded_tokens
        rows = block_tables if p == n else [*block_tables, *self._pad_rows[: p - n]]
        tables = self.tables
        tables.prepare(rows, required_pages=layout.required_pages)  # validates every row
        layout.write()  # rows, columns and plans; nothing below can fail
        counts: list[int | None] = [pt, pt, p, p, p, None]
        plan_rows = self._plan_rows(layout, counts)
        if self.qo_indptr is not None:
            # only this producer writes the slot's source: same shape, same bytes
            if self._qo_written[slot] != (t, pt):
                qo = self.qo_indptr.np
                qo[: t + 1] = self._tokens[: t + 1]
                qo[t + 1 : pt + 1] = t
                self._qo_written[slot] = (t, pt)
            counts.append(pt + 1)
        self._counts.set(*counts)  # type: ignore[union-attr]
        stage = tables.stage(p)
        return V41Plan(layout.num_reqs, p, t, pt, layout.max_query_len or 1, plan_rows,
                       stage)

    @h2d_producer(lambda self: self.group)
    def begin_prefill(
        self,
        spans: Sequence[RequestSpan] | SpanColumns,
        *,
        block_tables: Sequence[PageRow],
    ) -> V41Plan:
        """V4 prefill (eager, no graph padding): every token of each span's chunk, the
        chunk starts, and the eager plans (the real compression rows; the whole state-write
        array, -1 after the real rows), into the same pinned, bound buffers as decode."""
        cols = spans if isinstance(spans, SpanColumns) else SpanColumns.from_spans(spans)
        if not self._layouts:
            self._bind()
        layout = self._prefill_layouts[self.h2d_state.current_slot]
        n = len(cols.query_lens)
        if len(block_tables) != n:
            raise CountError(
                f"{self.group}: {len(block_tables)} block-table rows for {n} spans; pass "
                "one row per span")
        qlens, ctx = cols.query_lens, cols.context_lens
        try:
            t = int(np.add.reduce(qlens, dtype=np.int64)) if n else 0
            starts = np.subtract(ctx, qlens, dtype=np.int32) if n else qlens
            layout.plan(qlens, ctx, n, t, (cols.state_slots_out, cols.state_slots_in, starts))
        except (RequestLayoutError, TypeError, ValueError) as exc:
            raise CountError(f"{self.group}: {exc}") from exc
        tables = self.tables
        tables.prepare(block_tables, required_pages=layout.required_pages)
        layout.write()
        counts: list[int | None] = [t, t, n, n, n, n]
        plan_rows = self._plan_rows(layout, counts)
        if self.qo_indptr is not None:
            counts.append(None)
        self._counts.set(*counts)  # type: ignore[union-attr]
        stage = tables.stage(n)
        return V41Plan(n, n, t, t, layout.max_query_len, plan_rows, stage)

    def generate_prefill_indptrs(self, plan: V41Plan, *, pcp_rank: int = 0,
                                 pcp_size: int = 1) -> PrefillIndptrs:
        """V4 prefill's first consumer: the extend and prefix SWA/CSA/HCA indptrs and the
        indexer's committed prefix, on the GPU (:func:`generate_v4_prefill_indptrs`); with
        context parallelism, over this rank's strided queries of the same publication."""
        return generate_v4_prefill_indptrs(
            self.positions.gpu, self.token_batch_ids.gpu, self.seq_lens.gpu,
            self.chunk_starts.gpu, self.prefill_indptrs, num_tokens=plan.num_tokens,
            num_reqs=plan.num_reqs, window=self.window, index_topk=self.index_topk,
            pcp_rank=pcp_rank, pcp_size=pcp_size)

    def _plan_rows(self, layout: RequestLayout, counts: list[int | None]
                   ) -> tuple[tuple[int, int, int, int], ...]:
        """Per ratio (real compress rows, published, real write rows, published) of the
        written batch; appends the published counts to ``counts`` in member order."""
        out = []
        for k in range(0, 2 * len(self.ratios), 2):
            real_c, c = layout.plan_rows(k)
            real_w, w = layout.plan_rows(k + 1)
            counts += [c, w]
            out.append((real_c, c, real_w, w))
        return tuple(out)

    def write_decode_window_indices(self, plan: V41Plan, geometry: WindowGeometry,
                                    out: DecodeWindowIndices) -> DecodeWindowIndices:
        """The window tails of each decode token's SWA/CSA/HCA slices and its own rows
        (``dest``), after :meth:`generate_step_indptrs`
        (:func:`write_v4_decode_window_indices`); pass :attr:`hca_indices` as
        ``out.hca_indices`` to complete the HCA slices the expansion began."""
        return write_v4_decode_window_indices(
            self.positions.gpu, self.token_batch_ids.gpu, self.state_slot_out.gpu,
            self.step_indptrs, out, geometry, num_tokens=plan.padded_tokens,
            num_reqs=plan.num_reqs, window=self.window)

    def write_prefill_indices(self, plan: V41Plan, cu_seqlens_q: torch.Tensor,
                              geometry: WindowGeometry, out: PrefillIndices
                              ) -> PrefillIndices:
        """The sparse (Opus) prefill indices after :meth:`generate_prefill_indptrs`
        (:func:`write_v4_prefill_indices`); ``cu_seqlens_q`` is the token inputs' query
        prefix, ``out`` the four index arrays sized by the indptrs' capacities."""
        if self.envelope_rows is None:
            raise DeclarationError(
                f"{self.group}: write_prefill_indices needs envelope_rows (the compressed "
                "rows per block); pass it to the constructor")
        return write_v4_prefill_indices(
            self.positions.gpu, self.token_batch_ids.gpu, self.seq_lens.gpu,
            self.chunk_starts.gpu, self.state_slot_out.gpu, cu_seqlens_q,
            self.block_tables.gpu, self.prefill_indptrs, out, geometry,
            num_tokens=plan.num_tokens, num_reqs=plan.num_reqs, window=self.window,
            index_topk=self.index_topk, envelope_rows=self.envelope_rows)

    # -- the first consumer --------------------------------------------------------------
    def generate_step_indptrs(self, plan: V41Plan) -> StepIndptrs:
        """Step indptr generation: per-token SWA/CSA/HCA prefixes and committed counts,
        then (with ``envelope_rows``) the per-token block tables and the HCA index head,
        on the GPU from the published rows (:func:`generate_v4_step_indptrs`,
        :func:`expand_v4_token_tables`)."""
        out = generate_v4_step_indptrs(
            self.positions.gpu, self.token_batch_ids.gpu, self.seq_lens.gpu,
            self.step_indptrs, num_tokens=plan.padded_tokens, num_reqs=plan.num_reqs,
            padded_reqs=plan.padded_reqs, window=self.window, index_topk=self.index_topk)
        if self.envelope_rows is not None:
            assert self.block_tables_per_token is not None and self.hca_indices is not None
            expand_v4_token_tables(
                self.token_batch_ids.gpu, self.seq_lens.gpu, self.block_tables.gpu,
                out.hca_indptr, self.block_tables_per_token, self.hca_indices,
                num_tokens=plan.padded_tokens, num_reqs=plan.num_reqs, window=self.window,
                envelope_rows=self.envelope_rows)
        return out
