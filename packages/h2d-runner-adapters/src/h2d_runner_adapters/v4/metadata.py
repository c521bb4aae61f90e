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
  adapter's private dummy slot. Everything a step reads of positions before its own
  tokens (the compressor rings the plans read, the window rows of the decode tails and
  the prefill prefix indices) is ``state_slot_in``'s; everything it writes, and its own
  tokens' window rows, ``state_slot_out``'s;
* ``v41_compress_plan_{r}`` / ``v41_write_plan_{r}`` for each ratio ``r`` (int32 rows of
  ``[ragged_id, batch_id, position, window_len]``, counted in rows with ``set_count``): the
  graph form, ``P * ceil(q/r)`` compress rows and ``P * min(q, K)`` write rows, real rows
  first and ``-1`` rows after them;
* ``v41_window_write_plan`` (prefill only; int32 rows as the plans'): one row per token
  among its request's last ``window`` positions, the window ring rows the chunk writes
  (at the geometry's row of ``state_slot_out`` and the position, each layer's view base
  added); eager form: the real rows, then ``-1`` rows up to the whole array, all
  published. Decode's own window rows are the consumers' ``dest``;
* ``v41_block_tables`` (int32 ``[S, B]``, 256-token blocks): through the shared
  ``block_table_state`` (changed rows travel as byte ranges inside the DMA); padded requests
  get a private row holding the dummy block;
* ``v41_qo_indptr`` (fp8 KV only, int32 ``[T + 1]``): ``arange(t + 1)``, then ``t`` repeated.

Rows, per token and per request, come from one :class:`h2d_core.RequestLayout` pass
over the prepared table; a decode step (plan, table rows, writes, ``qo_indptr``, counts
and the table's stage) is one compiled :class:`h2d_core.LayoutStep` call after the
adapter's own input checks. First consumer: step indptr generation
(:func:`generate_v4_step_indptrs`, :func:`expand_v4_token_tables`), which derives the
per-token SWA/CSA/HCA prefixes, committed counts, per-token block tables and HCA index
head on the GPU; with ``fuse_step_indptrs`` both run inside the group's publication (its
CUDA graphs), reading the step's counts from the ``v41_step_counts`` member on the device.
Further consumers: the decode window tails
(:meth:`V41MetadataInputs.write_decode_window_indices`), prefill indptrs with context
parallelism (:meth:`~V41MetadataInputs.generate_prefill_indptrs`), the sparse (Opus)
prefill indices and the FP8 DSpark indexer rectangle; ``prefix=`` declares a TBO ubatch.
The spans (:class:`RequestSpan`, :class:`SpanColumns`) and their checks live in
:mod:`~h2d_runner_adapters.v4.spans`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from block_tables import BlockTable
from h2d_core import (
    DeclarationError,
    FusedConsumer,
    H2DBuffer,
    H2DRunnerState,
    LayoutStep,
    RequestLayout,
    StepSpec,
    h2d_producer,
)

from ..batch import PageRow
from ..checks import (
    AdapterInputError,
    padded_count,
)
from ..consumers._launch import consumers_fusable, interpreted
from ..paged import PagedInputs
from ..plan_records import slot_plans
from ..shape import StepShape, check_capacity
from .decode_steps import _step_indptrs_kernel, launch_v4_decode_steps_from_counts
from .layouts import V4_BLOCK, count_rules, v41_layout
from .plans import V41Plan
from .spans import (
    V41_METADATA,
    RequestSpan,
    SpanColumns,
    check_dummies,
    check_rows,
    span_columns,
)
from .step_indptrs import (  # the room's own kernels (consumers re-exports them)
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

__all__ = [
    "V4_BLOCK",
    "V4_RATIOS",
    "V41_METADATA",
    "RequestSpan",
    "SpanColumns",
    "V41MetadataInputs",
    "V41Plan",
]
#: (ratio, window K): ratio 4 pools an overlapping window of 2 * 4, ratio 128 one of 128
V4_RATIOS: tuple[tuple[int, int], ...] = ((4, 8), (128, 128))


class V41MetadataInputs(PagedInputs):
    """Declares the ``v41_metadata`` buffers, produces them, and runs the first consumer.

    ``dummy_state_slot`` and ``dummy_block`` are the engine's reserved padding storage:
    padded requests point only at them. ``fp8`` adds ``v41_qo_indptr`` to the group.
    ``prefix`` (e.g. ``"ub0_"``) declares a two-batch-overlap ubatch's own buffers and
    group (``ub0_v41_metadata``): its consumers keep views of them, and its widest query
    comes from the CPU lengths (``V41Plan.max_query_len``), never a device reduction.
    ``envelope_rows`` (compressed rows per block over all compressed layers) enables the
    per-token expansion of the first consumer (per-token block tables and the HCA index
    head, device buffers of ``max_tokens`` rows). Every row in the consumers' slices and
    ``dest`` outputs (HCA head, window tails, prefill indices) is a VIEW ROW: relative to
    the reading layer's view base (a compressed layer's offset in the block envelope), so
    one published HCA head serves every HCA layer, each adding its own base; see
    :class:`~h2d_runner_adapters.consumers.WindowGeometry`. ``fuse_step_indptrs`` (default None:
    wherever :func:`consumers_fusable` says the kernels run there) puts that first
    consumer inside the group's publication (a packed group: its CUDA graphs), with the
    step's counts published as ``v41_step_counts`` and read on the device;
    :meth:`generate_step_indptrs` then launches nothing.
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
        prefix: str = "",
        fuse_step_indptrs: bool | None = None,
    ) -> None:
        g = f"{prefix}{V41_METADATA}"
        # StepShape's rules, blocks (V4_BLOCK-token pages) refused under their own names
        check_capacity("max_blocks_per_req", max_blocks_per_req, rule="max_pages_per_req", owner=g)
        check_capacity("num_blocks", num_blocks, rule="num_pages", owner=g)
        shape = StepShape(max_reqs, max_tokens, max_blocks_per_req, V4_BLOCK, num_blocks,
                          max_ranges)
        check_dummies(g, dummy_state_slot, dummy_block, num_blocks)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise DeclarationError(
                f"{g}: window must be an int >= 1 (the sliding window: positions each "
                f"token sees, and each prefill's window-write rows), got {window!r}")
        self.prefix = prefix
        # the dummy block is the table's reserved page: its snapshots refuse a real row
        # bringing it, checking each row's new pages as they arrive
        super().__init__(state, shape, g, f"{prefix}v41_block_tables", reserved_page=dummy_block)
        self.ratios = tuple(ratios)
        self.window = window
        self.index_topk = index_topk
        self.dummy_state_slot = int(dummy_state_slot)  # an int subclass: its value
        self.dummy_block = int(dummy_block)
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
        # prefill only (omitted from decode publications): each request's chunk start, and
        # the window-write rows (at most min(q, window) per request)
        self.chunk_starts = buf(f"{prefix}v41_chunk_starts", (max_reqs,), torch.int32,
                                group=g)
        self.window_write_plan = buf(
            f"{prefix}v41_window_write_plan", (min(max_tokens, max_reqs * window), 4),
            torch.int32, group=g, unit="rows")
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
        #: the step's counts (n, P, t, T) for the fused first consumer, and that consumer
        #: (None: not declared; its ``fused`` says whether the publication runs it)
        self.step_counts: H2DBuffer | None = None
        self.step_indptrs_consumer: FusedConsumer | None = None
        if fuse_step_indptrs is None:  # the default: fused wherever the kernels run there
            fuse_step_indptrs = consumers_fusable(dev)
        if fuse_step_indptrs:
            if dev.type == "cpu" and not interpreted(_step_indptrs_kernel):
                raise DeclarationError(
                    f"{g}: fuse_step_indptrs on a CPU state runs the Triton kernels in their "
                    "interpreter: set TRITON_INTERPRET=1 before triton is imported")
            self.step_counts = buf(f"{prefix}v41_step_counts", (4,), torch.int32, group=g)
            self.step_indptrs_consumer = state.fuse_consumer(
                f"{g}.step_indptrs", [self.step_counts], self._enqueue_step_indptrs)
        # padded requests read only the dummy block (private: nothing appends to it)
        self._pad_rows: list[BlockTable] = [BlockTable([dummy_block])] * max_reqs
        self._layouts: list[RequestLayout] = []
        self._prefill_layouts: list[RequestLayout] = []
        self._step: LayoutStep | None = None  # the decode step, bound on first use
        self._prefill_step: LayoutStep | None = None  # the prefill step, bound with it
        self._plans: tuple[V41Plan, ...] = ()  # per slot: the decode step's plan
        # the decode layout's column values (state slots out, in), refilled each step
        self._values: list[np.ndarray | None] = [None, None]

    # -- binding -------------------------------------------------------------------------
    def _bind(self) -> LayoutStep:
        slots = range(self.h2d_state.num_slots)
        self._layouts = [v41_layout(self, slot, graph=True) for slot in slots]
        self._prefill_layouts = [v41_layout(self, slot, graph=False) for slot in slots]
        decode, prefill = count_rules(self)
        # plan_rows: per ratio (real compress rows, published, real write rows, published)
        self._step = StepSpec(decode, self.tables, self._pad_rows).bind(
            self.group, self.h2d_state, self._layouts, error=AdapterInputError, plan_group=2)
        # one plan_rows entry per plan: begin_prefill regroups the ratios' pairs
        self._prefill_step = StepSpec(prefill, self.tables).bind(
            self.group, self.h2d_state, self._prefill_layouts, error=AdapterInputError,
            plan_group=1)
        step = self._step
        self._plans = slot_plans(self.h2d_state, step,
                                 lambda counts, slot: V41Plan.over_step(counts, step, slot))
        return self._step

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
        included, before any source is written: a refusal raises
        :class:`AdapterInputError` (or the block table's own error: a real row naming the
        dummy block raises :class:`block_tables.ReservedPageError`) and changes nothing.
        The plan is the slot's own, refreshed in place: valid until the slot's next
        step."""
        cols = span_columns(self.group, spans)
        n = cols.query_lens.size
        # eager (no padding) keeps the graph grid of n requests: n, not -1
        p = n if padded is None else padded_count(self.group, n, padded)
        check_rows(self.group, block_tables, n)
        step = self._step
        if step is None:
            step = self._bind()
        values = self._values
        values[0] = cols.state_slots_out
        values[1] = cols.state_slots_in
        # plan (every length and state slot checked), prepare the rows (each validated,
        # the dummy block refused), write every member (qo_indptr included), count and
        # stage: one call; nothing after it fails
        step.run(cols.query_lens, cols.context_lens, block_tables, p, -1, values)
        return self._plans[self.h2d_state.current_slot]

    @h2d_producer(lambda self: self.group)
    def begin_prefill(
        self,
        spans: Sequence[RequestSpan] | SpanColumns,
        *,
        block_tables: Sequence[PageRow],
    ) -> V41Plan:
        """V4 prefill (eager, no graph padding): every token of each span's chunk, the
        chunk starts, and the eager plans (the real compression rows; the whole state-write
        array, -1 after the real rows), into the same pinned, bound buffers as decode.
        Checked whole before any write, as :meth:`begin_step`."""
        cols = span_columns(self.group, spans)
        n = cols.query_lens.size
        check_rows(self.group, block_tables, n)
        if self._step is None:
            self._bind()
        qlens, ctx = cols.query_lens, cols.context_lens
        # int32 columns, so the difference fits int64; a negative start (context shorter
        # than the chunk) is refused by the plan below before this array is copied anywhere
        starts = np.subtract(ctx, qlens, dtype=np.int32) if n else qlens
        # plan (eager: exactly the tokens), prepare the rows, write, count, stage: one call
        # (qo_indptr and the fused decode consumer's counts are left out)
        n, _, q, t, _, _, stage, _, _ = self._prefill_step.run(  # type: ignore[union-attr]
            qlens, ctx, block_tables, -1, -1,
            (cols.state_slots_out, cols.state_slots_in, starts)).astuple()
        rows = self._prefill_step.plan_rows  # type: ignore[union-attr]
        # (real, published) per plan: the ratios' (compress, write) pairs, then the window
        ratios = tuple(rows[k] + rows[k + 1] for k in range(0, len(rows) - 1, 2))
        return V41Plan(n, n, t, t, q if n else 0, ratios, stage, rows[-1])

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

    def write_decode_window_indices(self, plan: V41Plan, geometry: WindowGeometry,
                                    out: DecodeWindowIndices) -> DecodeWindowIndices:
        """The window tails of each decode token's SWA/CSA/HCA slices and its own rows
        (``dest``), after :meth:`generate_step_indptrs`
        (:func:`write_v4_decode_window_indices`); pass :attr:`hca_indices` as
        ``out.hca_indices`` to complete the HCA slices the expansion began."""
        return write_v4_decode_window_indices(
            self.positions.gpu, self.token_batch_ids.gpu, self.state_slot_out.gpu,
            self.state_slot_in.gpu, self.step_indptrs, out, geometry,
            num_tokens=plan.padded_tokens, num_reqs=plan.num_reqs, window=self.window,
            max_query_len=plan.max_query_len)

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
            self.chunk_starts.gpu, self.state_slot_in.gpu, cu_seqlens_q,
            self.block_tables.gpu, self.prefill_indptrs, out, geometry,
            num_tokens=plan.num_tokens, num_reqs=plan.num_reqs, window=self.window,
            index_topk=self.index_topk, envelope_rows=self.envelope_rows)

    # -- the first consumer --------------------------------------------------------------
    def generate_step_indptrs(self, plan: V41Plan) -> StepIndptrs:
        """Step indptr generation: per-token SWA/CSA/HCA prefixes and committed counts,
        then (with ``envelope_rows``) the per-token block tables and the HCA index head,
        on the GPU from the published rows (:func:`generate_v4_step_indptrs`,
        :func:`expand_v4_token_tables`). Fused (``fuse_step_indptrs=True`` on a packed
        group), the publication already enqueued both, with the counts read on the device:
        this launches nothing."""
        fused = self.step_indptrs_consumer
        if fused is not None and fused.fused:
            return self.step_indptrs
        out = generate_v4_step_indptrs(
            self.positions.gpu, self.token_batch_ids.gpu, self.seq_lens.gpu,
            self.step_indptrs, num_tokens=plan.padded_tokens, num_reqs=plan.num_reqs,
            padded_reqs=plan.padded_reqs, window=self.window, index_topk=self.index_topk)
        if self.envelope_rows is not None:
            assert self.block_tables_per_token is not None and self.hca_indices is not None
            expand_v4_token_tables(
                self.positions.gpu, self.token_batch_ids.gpu, self.seq_lens.gpu,
                self.block_tables.gpu, out.hca_indptr, self.block_tables_per_token,
                self.hca_indices,
                num_tokens=plan.padded_tokens, num_reqs=plan.num_reqs, window=self.window,
                envelope_rows=self.envelope_rows)
        return out

    def _enqueue_step_indptrs(self, header: torch.Tensor, rows: tuple[int, ...]) -> None:
        assert self.step_counts is not None
        expansion = None
        if self.envelope_rows is not None:
            assert self.block_tables_per_token is not None and self.hca_indices is not None
            expansion = (self.block_tables.gpu, self.block_tables_per_token, self.hca_indices,
                         self.envelope_rows)
        launch_v4_decode_steps_from_counts(
            self.positions.gpu, self.token_batch_ids.gpu, self.seq_lens.gpu, self.step_indptrs,
            self.step_counts.gpu, header, rows[0], max_tokens=self.positions.spec.capacity,
            max_reqs=self.seq_lens.spec.capacity, window=self.window,
            index_topk=self.index_topk, expansion=expansion)
