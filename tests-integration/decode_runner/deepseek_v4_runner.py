"""The decode runner for DeepSeek-V4: ``token_inputs`` + ``v41_metadata``, prefill included.

:class:`DecodeRunner`'s step loop with V4's two groups (the spec's "two H2Ds and two
scatters" of an ordinary V4.1 decode). Per decode step::

    state.begin()
    TokenStepInputs.prepare(batch, padded)                    # token_inputs
    V41MetadataInputs.begin_step(spans, block_tables=rows, padded=padded)   # v41_metadata
    state.publish("token_inputs"); state.publish("v41_metadata"); state.finish()
    token assembly; step indptr generation (+ per-token tables, HCA head);
    decode window indices                                     (first consumers)
    model (:class:`~decode_runner.deepseek_v4.DeepseekV4PagedDecoder`) -> sampler

and per prefill chunk sampling, ids and the query prefix (one producer call each: V4's
prefill metadata is its own adapter, not the ``PrefillInputs`` the fused prefill step
composes) with ``V41MetadataInputs.begin_prefill`` in one combined ``prefill_step`` group
(a second ``V41MetadataInputs``, prefix ``prefill_``: a producer group covered by a
combined one is published by direct copies, so decode's own ``v41_metadata`` stays out of
it), then the prefill indptrs and the sparse prefill indices. Spans carry each request's state slot:
this runner is the engine's slot allocator (a request gets a free slot when first
scheduled and keeps it through recompute preemptions; a finished request's slot is
poisoned and handed out again). A state fork (:attr:`~DeepseekV4Runner.forks`, set before
the forked request's step) publishes the source request's slot as the span's
``state_slot_in`` for that one step. Block tables are the scheduler's, at V4's 256-token block
size; the adapter's private dummy block and dummy slot lie past the scheduler's pool.
``pad_eager`` pads eager decode steps to the scheduler's graph size, so padded rows (batch
id -1, the dummy slot and block) are published and read on CPU too. :meth:`~DeepseekV4Runner.
verify` runs a DSpark-style verify step (ragged query widths) through the same groups and
consumers. No graphs or TBO.

For the main job's ATOM-style baseline, :attr:`~DeepseekV4Runner.metadata_hook` (as on
:class:`~decode_runner.v41.V41Runner`): when set, a decode step calls it with the step's
spans and page lists in place of the publication and the first consumers, and the model
runs over the destinations as last published (its values are not consumed). A batch may
carry the scheduler side's ``extras["spans"]`` (this runner's :meth:`~DeepseekV4Runner.
slot_spans`) and ``extras["page_lists"]``, built before the step, outside its timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    TOKEN_INPUTS,
    V41_METADATA,
    ScheduledBatch,
    SpanColumns,
    TokenPlan,
    TokenStepInputs,
    V41MetadataInputs,
    V41Plan,
)
from h2d_runner_adapters.consumers import DecodeWindowIndices, PrefillIndices

from .deepseek_v4 import DeepseekV4PagedDecoder, V4StepInputs
from .runner import PREFILL_STEP, DecodeRunner, RunnerConfig


class V4Metadata:
    """:class:`V41MetadataInputs` and the buffers its later consumers write, with the two
    entry points :class:`DecodeRunner` calls on its decode and prefill adapters
    (``generate_kv_indices`` after a decode publication, ``prepare_attention`` after a
    prefill one)."""

    def __init__(self, st: H2DRunnerState, cfg: RunnerConfig, model: DeepseekV4PagedDecoder,
                 prefix: str = "") -> None:
        w, k, b = model.window, model.topk, cfg.max_pages_per_req
        self.geometry = model.geometry
        self.v4 = V41MetadataInputs(
            st, max_reqs=cfg.max_reqs, max_tokens=cfg.max_tokens, max_blocks_per_req=b,
            dummy_state_slot=model.slots - 1, dummy_block=cfg.num_pages,
            num_blocks=cfg.num_pages + 1, window=w, index_topk=k,
            envelope_rows=model.envelope_rows, prefix=prefix)
        self.group = self.v4.group
        assert self.v4.hca_indices is not None
        dev, t = st.device, cfg.max_tokens

        def cells(per_token: int) -> torch.Tensor:
            return torch.full((t * per_token,), -1, dtype=torch.int32, device=dev)

        # sized by each token's longest slice: the window, plus the CSA top-k or the HCA
        # entries of a full table; the HCA output is the adapter's own buffer, whose head
        # (the compressed rows) step indptr generation already wrote
        self.window_out = DecodeWindowIndices(
            cells(w), cells(w + k), self.v4.hca_indices, cells(1), cells(1), cells(1))
        self.prefill_out = PrefillIndices(cells(w), cells(w), cells(w + k), cells(w + 2 * b))

    def generate_kv_indices(self, plan: V41Plan) -> None:
        self.v4.generate_step_indptrs(plan)
        self.v4.write_decode_window_indices(plan, self.geometry, self.window_out)

    def prepare_attention(self, plan: V41Plan, cu_seqlens_q: torch.Tensor) -> None:
        self.v4.generate_prefill_indptrs(plan)
        self.v4.write_prefill_indices(plan, cu_seqlens_q, self.geometry, self.prefill_out)

    def step_inputs(self, plan: V41Plan, input_ids: torch.Tensor, *, prefill: bool
                    ) -> V4StepInputs:
        """The model's view of the step just published and consumed."""
        v4 = self.v4
        t, p = plan.padded_tokens, plan.padded_reqs
        plans = {r: (cb.gpu[: rows[1]], wb.gpu[: rows[3]])
                 for (r, _), cb, wb, rows in zip(v4.ratios, v4.compress_plans,
                                                 v4.write_plans, plan.plan_rows, strict=True)}
        common: dict[str, Any] = {
            "input_ids": input_ids[:t], "positions": v4.positions.gpu[:t],
            "batch_ids": v4.token_batch_ids.gpu[:t], "seq_lens": v4.seq_lens.gpu[:p],
            "slot_in": v4.state_slot_in.gpu[:p], "slot_out": v4.state_slot_out.gpu[:p],
            "block_tables": v4.block_tables.gpu, "plans": plans}
        ind = v4.step_indptrs
        if not prefill:
            out, tables = self.window_out, v4.block_tables_per_token
            assert tables is not None
            return V4StepInputs(
                **common, prefill=False, committed=ind.n_committed_per_token[:t],
                slices=((ind.swa_indptr[: t + 1], out.swa_indices),
                        (ind.csa_indptr[: t + 1], out.csa_indices),
                        (ind.hca_indptr[: t + 1], out.hca_indices)),
                tables_per_token=tables[:t],
                dest=(out.dest_dense[:t], out.dest_csa[:t], out.dest_hca[:t]))
        pre, out_p = v4.prefill_indptrs, self.prefill_out
        return V4StepInputs(
            **common, prefill=True, committed=pre.indexer_visible_end[:t],
            slices=((pre.prefix_swa_indptr[: t + 1], out_p.prefix_swa),
                    (pre.prefix_csa_indptr[: t + 1], out_p.prefix_csa),
                    (pre.prefix_hca_indptr[: t + 1], out_p.prefix_hca)),
            extend=(pre.extend_indptr[: t + 1], out_p.extend),
            window_writes=v4.window_write_plan.gpu[: plan.window_rows[1]])


class DeepseekV4Runner(DecodeRunner):
    """:class:`DecodeRunner` publishing V4's two groups (see the module docstring) over
    ``model``'s storage of ``num_state_slots`` slots."""

    decode: V4Metadata  # type: ignore[assignment]
    prefill: V4Metadata  # type: ignore[assignment]

    def __init__(self, cfg: RunnerConfig, device: str | torch.device, backend: str, *,
                 model: DeepseekV4PagedDecoder, num_state_slots: int,
                 pad_eager: bool = False) -> None:
        assert not cfg.graph_sizes, "eager only: no captured graphs"
        assert cfg.page_size == 256, "V4 block tables hold 256-token blocks"
        assert model.slots == num_state_slots + 1
        self.pad_eager = pad_eager
        self._decoder = model
        self.slot_of: dict[int, int] = {}
        self.free_slots = list(range(num_state_slots))[::-1]  # pop(): lowest first
        self._ever: set[int] = set()
        #: slots handed out again after a release; decode steps with padded rows; real
        #: compress rows per ratio in decode steps (windows closed while decoding)
        self.reused_slots = 0
        self.padded_steps = 0
        self.decode_compress_rows: dict[int, int] = {}
        #: the main job's ATOM-style baseline (see the module docstring): called with
        #: (spans, page lists) instead of the decode publication and first consumers
        self.metadata_hook: Callable[[SpanColumns, list[list[int]]], int | None] | None = None
        #: state forks the engine asks for: request id -> the request whose state slot its
        #: next step reads (``fork_source``); consumed by that step
        self.forks: dict[int, int] = {}
        self._last_decode: V4StepInputs | None = None
        super().__init__(cfg, device, backend, model=model)

    def _declare(self, st: H2DRunnerState, tbo: bool) -> None:
        caps: dict[str, Any] = {"max_reqs": self.cfg.max_reqs,
                                "max_tokens": self.cfg.max_tokens}
        self.publish_groups = (TOKEN_INPUTS, V41_METADATA)
        self.token_step = TokenStepInputs(st, **caps)
        self.sampling, self.tokens = self.token_step.sampling, self.token_step.tokens
        # decode's v41_metadata is its own packed group (one DMA + one scatter); prefill's
        # members ride in prefill_step, so they are a second adapter's
        self.decode = V4Metadata(st, self.cfg, self._decoder)
        self.prefill = V4Metadata(st, self.cfg, self._decoder, prefix="prefill_")
        st.combine(PREFILL_STEP,
                   ["sampling", *self.tokens.producer_groups, self.prefill.group])
        self.ubatches = []

    # -- the engine's state slots ------------------------------------------------------------
    def _spans(self, batch: ScheduledBatch) -> SpanColumns:
        slots = []
        for r in batch.requests:
            s = self.slot_of.get(r.req_id)
            if s is None:
                s = self.slot_of[r.req_id] = self.free_slots.pop()
                self.reused_slots += s in self._ever
                self._ever.add(s)
            slots.append(s)
        cols = batch.columns
        out = np.array(slots, np.int32)
        inp = out  # one array for both columns: no forks, one check
        if any(r.req_id in self.forks for r in batch.requests):
            inp = np.array([self.slot_of[self.forks.pop(r.req_id)] if r.req_id in self.forks
                            else s for r, s in zip(batch.requests, slots, strict=True)],
                           np.int32)
        return SpanColumns(np.ascontiguousarray(cols.query_lens, np.int32),
                           np.ascontiguousarray(cols.context_lens, np.int32), out, inp)

    def slot_spans(self, batch: ScheduledBatch) -> SpanColumns:
        """The batch's spans, its requests' state slots allocated (the scheduler side: a
        caller may build them ahead into ``batch.extras["spans"]``)."""
        return self._spans(batch)

    def _step_spans(self, batch: ScheduledBatch) -> SpanColumns:
        given = batch.extras.get("spans")
        return given if isinstance(given, SpanColumns) else self._spans(batch)

    def release(self, req_ids: Any) -> None:
        """Finished requests give their slots back (their rings become garbage)."""
        freed = [self.slot_of.pop(i) for i in req_ids if i in self.slot_of]
        self._decoder.poison_slots(freed)
        self.free_slots.extend(freed)

    # -- steps -------------------------------------------------------------------------------
    def step(self, batch: ScheduledBatch, *, tbo: bool = False) -> Any:
        self.release(batch.extras.get("finished", ()))
        return super().step(batch, tbo=tbo)

    # V4's decode plan stands where the MHA runner's DecodePlan does: the parent reads
    # only its padded_reqs
    def _prepare_decode(self, batch: ScheduledBatch, padded: int | None  # type: ignore[override]
                        ) -> tuple[TokenPlan, V41Plan]:
        tok = self.token_step.prepare(batch, padded)
        self._sampling_plan = tok.sampling
        self._plan = self.decode.v4.begin_step(self._step_spans(batch),
                                               block_tables=batch.block_tables, padded=padded)
        return tok.tokens, self._plan

    def _decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, Any, bool]:
        hook = self.metadata_hook
        if hook is None or self._last_decode is None:
            logits, published, sampled = super()._decode(batch)
            self._last_decode = cast(V4StepInputs, published)  # _decode_inputs' value
            return logits, published, sampled
        spans = self._step_spans(batch)
        given = batch.extras.get("page_lists")
        lists = (cast(list[list[int]], given) if given is not None
                 else [list(row) for row in batch.block_tables])
        events = self.span_events
        if events is not None:
            events[0].record()
        t0 = time.perf_counter_ns()
        waited = hook(spans, lists)  # ns it waited for a free source set: left out
        self.host_metadata_ns = time.perf_counter_ns() - t0 - (waited or 0)
        inputs = self._last_decode
        if events is not None:
            if self.span_through_model:  # the model's first kernel, eagerly
                self._decoder.embed.index_select(0, inputs.input_ids.long())
            events[1].record()
        return self._decoder(inputs), inputs, False

    def _decoded(self, batch: ScheduledBatch, dplan: Any) -> None:
        self.padded_steps += dplan.padded_reqs > dplan.num_reqs
        for (r, _), rows in zip(self.decode.v4.ratios, dplan.plan_rows, strict=True):
            self.decode_compress_rows[r] = self.decode_compress_rows.get(r, 0) + rows[0]

    def _decode_inputs(self, d: Any, rows: int, first_token: int) -> Any:
        return self.decode.step_inputs(self._plan, self.tokens.input_ids.gpu, prefill=False)

    # the V4 prefill's plan is its own adapter's (a V41Plan), not the base's PrefillPlan
    def _prepare_prefill(self, batch: ScheduledBatch) -> tuple[TokenPlan, Any]:
        tok = self.token_step.prepare(batch)  # sampling, ids and query prefix: one call
        self._sampling_plan, tplan = tok.sampling, tok.tokens
        self._plan = self.prefill.v4.begin_prefill(self._spans(batch),
                                                   block_tables=batch.block_tables)
        return tplan, self._plan

    def _prepare_attention(self, pplan: Any) -> None:
        self.prefill.prepare_attention(pplan, self.tokens.cu_seqlens_q.gpu)

    def verify(self, batch: ScheduledBatch, padded: int | None = None) -> torch.Tensor:
        """A DSpark-style verify step: ragged query widths (each request's tokens staged from
        the host, its drafts after its first token), padded to ``padded`` requests of the
        widest query. The same two groups and first consumers as a decode step; returns the
        logits of every real token, flat in request order (acceptance is the caller's)."""
        st = self.state
        st.begin()
        tok = self.token_step.prepare(batch, padded)
        plan = self.decode.v4.begin_step(self._spans(batch), block_tables=batch.block_tables,
                                         padded=padded)
        for group in self.publish_groups:
            st.publish(group)
        st.finish()
        self.tokens.assemble(tok.tokens, self.sampled)
        self.decode.generate_kv_indices(plan)
        self._decoded(batch, plan)
        inputs = self.decode.step_inputs(plan, self.tokens.input_ids.gpu, prefill=False)
        logits = self._decoder(inputs)
        return logits[: plan.num_tokens]

    def _prefill_inputs(self, batch: ScheduledBatch, pplan: Any) -> Any:
        return self.prefill.step_inputs(pplan, self.tokens.input_ids.gpu, prefill=True)
