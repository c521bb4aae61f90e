"""Sampling and token inputs as one producer call and one group.

:class:`TokenStepInputs` composes :class:`SamplingInputs` and :class:`TokenInputs` (their
buffers, padding and first consumers) into the spec's ``token_inputs`` group and produces
all of it with one ``@h2d_producer`` call: one :class:`h2d_core.RequestLayout` pass
without pages (query prefixes, ids, deferred sources, sampling columns) and one count
store. It is the token half of a two-group step, e.g. V4.1 decode (``token_inputs`` +
``v41_metadata``). Ragged query widths are accepted; with ``padded`` the tokens are padded
to the graph grid (``padded`` times the widest query).

The layout pass checks every column's values before any write (finite temperatures,
``top_k >= -1``, ``top_p`` in (0, 1], ``prev_sample_rows >= -1``, ``num_drafts >= 0``;
see :func:`step_columns`): a refusal raises
:class:`~h2d_runner_adapters.checks.AdapterInputError` naming the request and the column,
and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from h2d_core import (
    PADDED_REQS,
    PADDED_TOKENS,
    REQS,
    CountRule,
    DeclarationError,
    H2DBuffer,
    H2DRunnerState,
    LayoutColumn,
    LayoutOutput,
    LayoutStep,
    RequestLayout,
    StepCounts,
    StepSpec,
    VerifyRows,
    h2d_producer,
)

from .batch import BatchColumns, ScheduledBatch
from .checks import AdapterInputError, padded_count
from .consumers import GREEDY_TEMPERATURE
from .plan_records import CompositePlan, slot_plans
from .sampling.inputs import SAMPLING, TOP_K_UNIFORM, TOP_P_UNIFORM, SamplingInputs, SamplingPlan
from .sampling.rules import TEMPERATURE, TOP_K, TOP_P, layout_column
from .token_inputs import (
    QUERY_PREFIX,
    SPEC_INDICES,
    TOKEN_IDS,
    TOKEN_INPUTS,
    TokenInputs,
    TokenPlan,
)


def step_columns(sampling: SamplingInputs, tokens: TokenInputs, slot: int, *,
                 drafts: bool = True) -> list[LayoutColumn]:
    """The fused steps' request-layout columns over ``slot``'s sources, in the order of
    the values :func:`step_values` gives, named after the
    :class:`~h2d_runner_adapters.batch.BatchColumns` fields (what a refusal names), each
    with the bounds the sampler and token assembly need. ``drafts=False`` (a step that
    verifies nothing, e.g. a prefill chunk) refuses any ``num_drafts`` but 0."""
    def src(b: H2DBuffer) -> np.ndarray:
        return b.source(slot).numpy()
    return [
        # sampling runs eagerly on real rows: no graph padding
        layout_column(TEMPERATURE, src(sampling.temperatures), minimum=GREEDY_TEMPERATURE),
        layout_column(TOP_K, src(sampling.top_ks)),
        layout_column(TOP_P, src(sampling.top_ps)),
        # -1: staged from the host; else a row of the previous step's sampled tokens
        LayoutColumn("prev_sample_rows", src(tokens.decode_src), pad=-1, low=-1,
                     high=tokens.prev_rows - 1),
        # the +1 entry of input_ids is the draft gather's shift, never a step's token
        LayoutColumn("token_ids", src(tokens.input_ids)[: tokens.max_tokens], per_token=True,
                     pad=0),
        LayoutColumn("num_drafts", low=0, high=None if drafts else 0),  # checked, summed
    ]


def verify_outputs(tokens: TokenInputs, slot: int) -> list[LayoutOutput]:
    """Speculative verification's rows over ``slot``'s sources, registered with a fused
    verify step's layout (its ``num_drafts`` column, from :func:`step_columns`): the
    target rows of each request's drafts back to back, the inclusive draft prefix and the
    bonus rows (:class:`h2d_core.VerifyRows`; the rows
    :meth:`TokenInputs.prepare_spec_indices` computes for a step of its own)."""
    return [VerifyRows("num_drafts", tokens.target_logits_indices.source(slot).numpy(),
                       tokens.cu_num_draft_tokens.source(slot).numpy(),
                       tokens.bonus_logits_indices.source(slot).numpy())]


def step_values(cols: BatchColumns) -> tuple[Any, ...]:
    """The batch's values of :func:`step_columns`, in its order (what a fused step's
    :meth:`h2d_core.LayoutStep.run` takes)."""
    return (cols.temperatures, cols.top_k, cols.top_p, cols.prev_sample_rows,
            cols.token_ids, cols.num_drafts)


class StepValues:
    """:func:`step_values` of the batch columns, as one list per adapter refilled in place
    for each step's :class:`BatchColumns` (a new columns object per step builds no tuple).
    It holds the arrays themselves, so values written into them in place are read as they
    are then; the list is valid until the next :meth:`of`."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: list[Any] = [None] * 6

    def of(self, cols: BatchColumns) -> list[Any]:
        v = self._values
        v[0] = cols.temperatures
        v[1] = cols.top_k
        v[2] = cols.top_p
        v[3] = cols.prev_sample_rows
        v[4] = cols.token_ids
        v[5] = cols.num_drafts
        return v


def token_step_spec(sampling: SamplingInputs, tokens: TokenInputs) -> StepSpec:
    """The sampling and token adapters' part of a fused step (:class:`h2d_core.StepSpec`):
    real requests for the sampler's rows (top-k and top-p omitted when uniform: bits 2 and
    4 of the layout's mask, their columns' positions in :func:`step_columns`), the padded
    grid for ids and the prefixes."""
    s, t = sampling, tokens
    return StepSpec((
        CountRule(s.temperatures, REQS), CountRule(s.top_ks, REQS, 0, TOP_K_UNIFORM),
        CountRule(s.top_ps, REQS, 0, TOP_P_UNIFORM), CountRule(t.input_ids, PADDED_TOKENS),
        CountRule(t.decode_cu, PADDED_REQS, 1), CountRule(t.decode_src, PADDED_REQS),
        CountRule(t.cu_seqlens_q, PADDED_REQS, 1)))


def sampling_plan(sampling: SamplingInputs, counts: StepCounts, slot: int) -> SamplingPlan:
    """The sampler's plan of a fused step in ``slot``, over the step's record: per-request
    filters where the layout found the top-k or top-p column uneven (its uniform-mask
    bits ``TOP_K_UNIFORM`` / ``TOP_P_UNIFORM``), else their one value, read from the
    slot's sources, as a CPU scalar (None: off)."""
    return SamplingPlan.over_sources(counts, sampling.top_ks.source(slot).numpy(),
                                     sampling.top_ps.source(slot).numpy())


class FusedStep:
    """What the fused steps over a paged adapter share: the sampling and token adapters
    beside it on one state, and their producer groups combined into the step's."""

    h2d_state: H2DRunnerState
    group: str
    sampling: SamplingInputs
    tokens: TokenInputs
    _step: LayoutStep | None

    def _combine(self, sampling: SamplingInputs, tokens: TokenInputs, adapter: Any,
                 role: str, group: str, groups: Sequence[str]) -> None:
        """Check that the three adapters share ``adapter``'s state (``role`` names it in
        the refusal), keep them and combine ``groups`` into ``group`` (before
        ``bind()``). Call after the step's own checks: a refusal combines nothing."""
        state = adapter.h2d_state
        if sampling.h2d_state is not state or tokens.h2d_state is not state:
            raise DeclarationError(
                f"{type(self).__name__}: the sampling, token and {role} adapters must be "
                "declared on the same H2DRunnerState")
        self.h2d_state = state
        self.group = group
        self.sampling = sampling
        self.tokens = tokens
        state.combine(group, list(groups))
        self._step = None  # bound on first use (after bind)
        self._values = StepValues()


class TokenStepPlan(CompositePlan):
    """The sampling and token plans of one :meth:`TokenStepInputs.prepare` (valid until
    the slot's next step)."""

    __slots__ = FIELDS = ("sampling", "tokens")
    sampling: SamplingPlan
    tokens: TokenPlan


class TokenStepInputs:
    """Declares sampling and token inputs on ``state`` (``.sampling``, ``.tokens``) and
    combines them into ``group``; construct before ``state.bind()``. ``extra_groups`` (producer
    groups declared before this) ride in the same publication: e.g. ``V41_METADATA``, so a
    V4.1 decode step is one DMA, one scatter and one launch (``state.publish(group)``),
    its fused first consumers included."""

    def __init__(
        self,
        state: H2DRunnerState,
        *,
        max_reqs: int,
        max_tokens: int,
        group: str = TOKEN_INPUTS,
        max_drafts: int = 0,
        prev_rows: int | None = None,
        extra_groups: Sequence[str] = (),
    ) -> None:
        self.h2d_state = state
        self.group = group
        self.sampling = SamplingInputs(state, max_reqs)
        self.tokens = TokenInputs(state, max_reqs=max_reqs, max_tokens=max_tokens,
                                  max_drafts=max_drafts, prev_rows=prev_rows)
        # with drafts, the verification indices ride in the same DMA
        # (tokens.prepare_spec_indices produces them)
        spec = (SPEC_INDICES,) if max_drafts else ()
        state.combine(group, [SAMPLING, TOKEN_IDS, QUERY_PREFIX, *spec, *extra_groups])
        self._step: LayoutStep | None = None  # bound on first use (after bind)
        self._plans: tuple[TokenStepPlan, ...] = ()  # per slot, over the step's records
        self._values = StepValues()

    def _bind(self) -> LayoutStep:
        s, t = self.sampling, self.tokens
        layouts = [RequestLayout(
            self.group, 1, None, None,
            cu_query=(t.cu_seqlens_q.source(slot).numpy(), t.decode_cu.source(slot).numpy()),
            columns=step_columns(s, t, slot)) for slot in range(self.h2d_state.num_slots)]
        self._step = token_step_spec(s, t).bind(self.group, self.h2d_state, layouts,
                                                sum_column=5, error=AdapterInputError)
        self._plans = slot_plans(self.h2d_state, self._step, lambda c, slot: TokenStepPlan(
            sampling_plan(s, c, slot), TokenPlan.over(c)))
        return self._step

    @h2d_producer(SAMPLING, TOKEN_IDS, QUERY_PREFIX)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None) -> TokenStepPlan:
        """Write and count sampling, ids, deferred sources and the query prefix (padding
        to ``padded`` requests). Everything is checked before any source is written."""
        cols = batch.columns
        step = self._step
        if step is None:
            step = self._bind()
        ids = cols.token_ids
        p = -1 if padded is None else padded_count(self.group, len(cols.query_lens), padded)
        # plan (every column checked), write and count: one call
        step.run(cols.query_lens, cols.context_lens, None, p,
                 len(ids) if padded is None else -1, self._values.of(cols))
        return self._plans[self.h2d_state.current_slot]
