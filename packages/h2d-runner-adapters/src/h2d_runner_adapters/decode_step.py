"""A plain decode step in one producer call and one publication.

:class:`DecodeStepInputs` composes :class:`SamplingInputs`, :class:`TokenInputs` and
:class:`MhaDecodeInputs` (the ten uploads of a plain-MHA decode step: temperatures, top-k,
top-p, input IDs, token prefix, deferred sources, query prefix, positions, slots, context
lengths, KV prefix and block tables), combines their groups into one publication group
``decode_step`` (one DMA, one scatter) and produces all of them with one
``@h2d_producer`` call.

The adapter is plain Python on the public API. The per-token work (positions, KV slots,
context lengths, the KV and query prefixes) is one :class:`h2d_core.RequestLayout`
pass over the prepared table, compiled when the block-tables wheel is built; the
sampling and token columns are copied by the same pass, which checks their values
first (see :func:`~h2d_runner_adapters.token_step.step_columns`); every count goes in one
:class:`h2d_core.CountBatch` store. The batch and its block-table rows are checked before
any source is written, so a rejected batch (a specific :class:`h2d_core.CountError`, e.g.
:class:`~h2d_runner_adapters.checks.AdapterInputError` naming the request and the column,
or :class:`block_tables.BlockTableError`) changes nothing.

Padding and first consumers are those of the composed adapters: ``plan.tokens`` feeds
``tokens.assemble``, ``plan.decode`` feeds ``decode.generate_kv_indices`` and
``plan.sampling`` feeds ``sampling.sample``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from h2d_core import (
    DeclarationError,
    H2DRunnerState,
    LayoutStep,
    h2d_producer,
)

from .batch import ScheduledBatch
from .checks import AdapterInputError, padded_count, refuse_page_size
from .mha.inputs import MHA_DECODE, DecodePlan, MhaDecodeInputs
from .mla_decode import MLA_DECODE, MlaDecodeInputs
from .plan_records import CompositePlan, slot_plans
from .sampling.inputs import SAMPLING, SamplingInputs, SamplingPlan
from .shape import StepShape, check_shape
from .token_inputs import (
    QUERY_PREFIX,
    SPEC_INDICES,
    TOKEN_IDS,
    TokenInputs,
    TokenPlan,
)
from .token_step import (
    FusedStep,
    sampling_plan,
    step_columns,
    token_step_spec,
    verify_outputs,
)

DECODE_STEP = "decode_step"
MLA_DECODE_STEP = "mla_decode_step"


class DecodeStepPlan(CompositePlan):
    """The three adapters' plans for one step (valid until the slot's next step)."""

    __slots__ = FIELDS = ("sampling", "tokens", "decode")
    sampling: SamplingPlan
    tokens: TokenPlan
    decode: DecodePlan


class DecodeStepInputs(FusedStep):
    """Sampling, token inputs and MHA decode metadata as one producer and one group.

    Declares the three adapters on ``state`` (reachable as ``.sampling``, ``.tokens`` and
    ``.decode``) and combines their producer groups into ``DECODE_STEP``; construct before
    ``state.bind()``. ``shape`` (a :class:`~h2d_runner_adapters.StepShape`) sizes all
    three: the sampling and token inputs take its ``max_reqs`` and ``max_tokens``, the
    decode adapter the whole shape. :meth:`from_adapters` composes adapters the caller
    declared (e.g. shared with a prefill path). ``fuse_kv_indices`` (default None: wherever
    :func:`consumers_fusable` says the kernel runs there) puts KV-index generation inside
    the step's publication (its CUDA graphs, counts read on the device):
    ``decode.generate_kv_indices(plan)`` then launches nothing (see
    :class:`MhaDecodeInputs`). ``fuse_token_assembly`` (the engine's persistent int32
    ``[rows, W]`` buffer of the previous step's sampled tokens) puts token assembly there
    too: ``tokens.assemble(plan, that_buffer)`` then launches nothing (see
    :meth:`TokenInputs.fuse_assembly`). ``prev_rows`` is :class:`TokenInputs`' (the rows of
    the previous step's sampled tokens a deferred request may name; default ``max_reqs``).
    """

    #: the decode group the step produces, and its adapter's class
    _DECODE_GROUP = MHA_DECODE
    _DECODE_ADAPTER: type[MhaDecodeInputs] = MhaDecodeInputs

    def __init__(
        self,
        state: H2DRunnerState,
        shape: StepShape,
        *,
        max_drafts: int = 0,
        extra_groups: Sequence[str] = (),
        fuse_kv_indices: bool | None = None,
        fuse_token_assembly: torch.Tensor | None = None,
        prev_rows: int | None = None,
    ) -> None:
        shape = check_shape(DECODE_STEP, shape)
        self._compose(
            SamplingInputs(state, shape.max_reqs),
            TokenInputs(state, max_reqs=shape.max_reqs, max_tokens=shape.max_tokens,
                        max_drafts=max_drafts, prev_rows=prev_rows),
            MhaDecodeInputs(state, shape, fuse_kv_indices=fuse_kv_indices),
            DECODE_STEP, tuple(extra_groups),
        )
        if fuse_token_assembly is not None:
            self.tokens.fuse_assembly(fuse_token_assembly)

    @classmethod
    def from_adapters(
        cls,
        sampling: SamplingInputs,
        tokens: TokenInputs,
        decode: MhaDecodeInputs,
        *,
        group: str = DECODE_STEP,
        extra_groups: Sequence[str] = (),
    ) -> DecodeStepInputs:
        """Compose adapters declared on one state and combine their groups into ``group``
        (before ``bind()``). The decode adapter must be the plain (unprefixed) one."""
        self = cls.__new__(cls)
        self._compose(sampling, tokens, decode, group, tuple(extra_groups))
        return self

    def _compose(self, sampling: SamplingInputs, tokens: TokenInputs, decode: MhaDecodeInputs,
                 group: str, extra_groups: tuple[str, ...]) -> None:
        if decode.mrope_positions is not None:
            raise DeclarationError(
                "DecodeStepInputs: the decode adapter carries MRoPE planes; the fused step "
                "publishes 1-D positions (use the adapters separately for MRoPE models)"
            )
        want = self._DECODE_GROUP
        if decode.group != want or not isinstance(decode, self._DECODE_ADAPTER):
            raise DeclarationError(
                f"{type(self).__name__}: the decode adapter publishes {decode.group!r}; the "
                f"fused step produces the plain {want!r} group (of a "
                f"{self._DECODE_ADAPTER.__name__}; use the adapters separately for prefixed "
                "two-batch-overlap ubatches)"
            )
        # speculative verification indices belong to the token inputs (the spec's group
        # table): with drafts they ride in the same DMA, produced by
        # tokens.prepare_spec_indices; extra groups (e.g. GDN state indices) likewise
        spec = (SPEC_INDICES,) if tokens.max_drafts else ()
        self._combine(sampling, tokens, decode, "decode", group,
                      [SAMPLING, TOKEN_IDS, QUERY_PREFIX, *spec, want, *extra_groups])
        self.decode = decode
        self._verify: LayoutStep | None = None  # prepare_verify's, bound on first use
        self._plans_of: dict[LayoutStep, tuple[DecodeStepPlan, ...]] = {}

    @h2d_producer(SAMPLING, TOKEN_IDS, QUERY_PREFIX, MHA_DECODE)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None) -> DecodeStepPlan:
        """Write and count every member of the step (padding to ``padded`` requests);
        stage the block table. Publish with ``state.publish(DECODE_STEP)``.

        The whole batch is checked, and the block table's rows validated, before any
        source is written: a rejected batch raises a specific error and changes nothing.
        """
        step = self._step
        if step is None:
            step = self._step = self._bind()
        return self._run(step, batch, padded)

    @h2d_producer(SAMPLING, TOKEN_IDS, QUERY_PREFIX, SPEC_INDICES, MHA_DECODE)
    def prepare_verify(self, batch: ScheduledBatch, padded: int | None = None
                       ) -> DecodeStepPlan:
        """A speculative verify step in one call: :meth:`prepare` plus the verification
        indices :meth:`TokenInputs.prepare_spec_indices` writes (target and bonus logits
        rows, the draft prefix), from ``batch.columns.num_drafts``; the indices ride in the
        same DMA. Needs ``max_drafts > 0``. Checked whole before any write, as
        :meth:`prepare`."""
        return self._run_verify(batch, padded)

    def _run_verify(self, batch: ScheduledBatch, padded: int | None) -> DecodeStepPlan:
        step = self._verify
        if step is None:
            if not self.tokens.max_drafts:
                raise DeclarationError(
                    f"{self.group}: prepare_verify needs speculative buffers; construct "
                    "with max_drafts=k")
            step = self._verify = self._bind(verify=True)
        plan = self._run(step, batch, padded)
        # the step wrote the slot's verification sources, not prepare_spec_indices (an
        # attribute, not a call: no frame per step)
        self.tokens.spec_written[self.h2d_state.current_slot] = None
        return plan

    def _run(self, step: LayoutStep, batch: ScheduledBatch, padded: int | None
             ) -> DecodeStepPlan:
        if batch.page_size != self.decode.page_size:
            refuse_page_size(self.group, batch.page_size, self.decode.page_size)
        cols = batch.columns
        n = len(cols.query_lens)
        p = -1 if padded is None else padded_count(self.group, n, padded)
        # plan (every column checked), prepare the rows, write, count and stage: one call
        step.run(cols.query_lens, cols.context_lens, batch.block_tables, p, -1,
                 self._values.of(cols))
        return self._plans_of[step][self.h2d_state.current_slot]

    def _bind(self, verify: bool = False) -> LayoutStep:
        s, t, d = self.sampling, self.tokens, self.decode

        def drafts(slot: int) -> dict[str, object]:
            return {"outputs": verify_outputs(t, slot)}

        layouts = d.request_layouts(
            self.group, cu_query=(t.cu_seqlens_q, t.decode_cu),
            columns=lambda slot: step_columns(s, t, slot), outputs=drafts if verify else None)
        # the decode adapter's part: tokens' grid, padded requests, MLA's last-page lengths
        # and sparse prefix, the table and its padding rows
        spec = token_step_spec(s, t) + d.step_spec()
        if verify:  # the verification indices: real requests, the step's draft tokens
            spec += t.verify_spec()
        step = spec.bind(self.group, self.h2d_state, layouts, sum_column=5,
                         error=AdapterInputError)
        # per slot, the step's plans over its records (prepare's and prepare_verify's
        # steps each have their own)
        self._plans_of[step] = slot_plans(self.h2d_state, step, lambda c, slot: DecodeStepPlan(
            sampling_plan(s, c, slot), TokenPlan.over(c), DecodePlan.over(c)))
        return step


class MlaDecodeStepInputs(DecodeStepInputs):
    """:class:`DecodeStepInputs` over MLA decode metadata: sampling, token inputs and
    :class:`MlaDecodeInputs` (its last-page lengths and DSA sparse prefix included) as one
    producer call and one group, ``MLA_DECODE_STEP`` (one DMA, one scatter). Declares the
    three adapters on ``state`` (``.sampling``, ``.tokens``, ``.decode``), all sized by
    ``shape`` (a :class:`~h2d_runner_adapters.StepShape` at MLA's page size); construct
    before ``state.bind()``; :meth:`from_adapters` composes adapters the caller declared. The
    first consumer is ``decode.generate_kv_indices(plan.decode)`` at MLA's page size."""

    _DECODE_GROUP = MLA_DECODE
    _DECODE_ADAPTER = MlaDecodeInputs

    def __init__(
        self,
        state: H2DRunnerState,
        shape: StepShape,
        *,
        index_topk: int | None = None,
        max_drafts: int = 0,
        group: str = MLA_DECODE_STEP,
        extra_groups: Sequence[str] = (),
        prev_rows: int | None = None,
        fuse_kv_indices: bool | None = None,
    ) -> None:
        shape = check_shape(group, shape)
        self._compose(
            SamplingInputs(state, shape.max_reqs),
            TokenInputs(state, max_reqs=shape.max_reqs, max_tokens=shape.max_tokens,
                        max_drafts=max_drafts, prev_rows=prev_rows),
            MlaDecodeInputs(state, shape, index_topk=index_topk,
                            fuse_kv_indices=fuse_kv_indices),
            group, tuple(extra_groups),
        )

    @h2d_producer(SAMPLING, TOKEN_IDS, QUERY_PREFIX, MLA_DECODE)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None) -> DecodeStepPlan:
        """Write and count every member of the MLA step; stage the block table. Publish
        with ``state.publish(self.group)``. Checked whole before any write."""
        step = self._step
        if step is None:
            step = self._step = self._bind()
        return self._run(step, batch, padded)

    @h2d_producer(SAMPLING, TOKEN_IDS, QUERY_PREFIX, SPEC_INDICES, MLA_DECODE)
    def prepare_verify(self, batch: ScheduledBatch, padded: int | None = None
                       ) -> DecodeStepPlan:
        """A speculative verify step of the MLA step in one call (see
        :meth:`DecodeStepInputs.prepare_verify`)."""
        return self._run_verify(batch, padded)
