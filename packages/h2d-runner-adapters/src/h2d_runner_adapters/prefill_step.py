"""A prefill chunk in one producer call and one publication.

:class:`PrefillStepInputs` is prefill's :class:`~h2d_runner_adapters.DecodeStepInputs`:
it composes :class:`SamplingInputs`, :class:`TokenInputs` and :class:`PrefillInputs`
(temperatures, top-k, top-p, input IDs, token prefix, deferred sources, the query prefix,
positions or MRoPE planes, KV slots, context lengths, the key prefix, the KV page prefix,
each token's request, last-page lengths when declared, block tables), combines their
groups into one publication group ``prefill_step`` (one DMA, one scatter) and produces
all of them with one ``@h2d_producer`` call.

The per-token work (positions, KV slots, token owners, context lengths, the query, key
and KV page prefixes) and the sampling and token columns are one compiled
:class:`h2d_core.RequestLayout` pass over the prepared table, which checks every
column first (see :func:`~h2d_runner_adapters.token_step.step_columns`; a prefill chunk
verifies no drafts, so ``num_drafts`` must be 0); the prefill adapter's own checks (token
ids per token, ``owns_slot``'s mask, MRoPE prompt positions) run on the planned chunk
inside the same call, before any write. A rejected chunk (a specific
:class:`h2d_core.CountError`, e.g. :class:`~h2d_runner_adapters.checks.AdapterInputError`
naming the group, the request and the column, or :class:`block_tables.BlockTableError`)
changes nothing, and a corrected retry in the same epoch publishes.

As every member, the published ``token_request`` and ``kv_indptr`` hold the chunk's
``num_tokens`` and ``num_reqs + 1`` entries; past them they are undefined (an earlier
chunk's values).

Prefill runs eagerly: no graph padding. First consumers: ``tokens.assemble(plan.tokens,
prev)``, :meth:`PrefillStepInputs.prepare_attention` (KV-index generation) and
``sampling.sample(logits, plan.sampling, noise)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from h2d_core import DeclarationError, H2DBuffer, H2DRunnerState, LayoutStep

from .checks import AdapterInputError
from .plan_records import CompositePlan, slot_plans
from .prefill import PREFILL_INPUTS, PrefillInputs, PrefillPlan
from .prefill_entry import PrefillOptions, chunk_producer
from .sampling.inputs import SAMPLING, SamplingInputs, SamplingPlan
from .shape import StepShape, check_shape
from .token_inputs import QUERY_PREFIX, TOKEN_IDS, TokenInputs, TokenPlan
from .token_step import FusedStep, sampling_plan, step_columns, token_step_spec

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+: read by type checkers only
    from typing import Unpack

PREFILL_STEP = "prefill_step"


class PrefillStepPlan(CompositePlan):
    """The three adapters' plans for one prefill chunk (valid until the slot's next
    step)."""

    __slots__ = FIELDS = ("sampling", "tokens", "prefill")
    sampling: SamplingPlan
    tokens: TokenPlan
    prefill: PrefillPlan


class PrefillStepInputs(FusedStep):
    """Sampling, token inputs and prefill metadata as one producer and one group.

    Declares the three adapters on ``state`` (reachable as ``.sampling``, ``.tokens`` and
    ``.prefill``) and combines their producer groups, plus ``extra_groups`` (e.g. GDN
    state indices, produced by their own adapter), into ``group``; construct before
    ``state.bind()``. ``shape`` (a :class:`~h2d_runner_adapters.StepShape`) sizes all
    three: the sampling and token inputs take its ``max_reqs`` and ``max_tokens``, the
    prefill adapter the whole shape. :meth:`from_adapters` composes adapters the caller
    declared (e.g. sampling and token inputs shared with the decode step). The further
    keywords (``mrope``, ``last_page_lens``: :class:`PrefillInputs`' options) declare the
    prefill adapter, and :meth:`prepare` takes its arguments as it takes them.

    The KV page prefix ``kv_indptr`` and each token's request ``token_request`` are
    the prefill adapter's published members (``.kv_indptr`` and ``.token_request``, H2D
    buffers read through ``.gpu``), computed on the host by the same layout pass as the
    positions, as decode's ``kv_indptr`` is (:class:`PrefillInputs` says why). For the
    chunk's entries (``token_request[:num_tokens]``, ``kv_indptr[:num_reqs + 1]``) they
    equal what the device derivation :func:`~h2d_runner_adapters.prepare_prefill_attention`
    gives from the published query and key prefixes; past them they are undefined (an
    earlier chunk's), where that derivation, given the whole tensor, writes -1. The KV
    indices stay a device output (``prefill.kv_indices``), as in decode: they are the
    block tables' rows, which already travel (only their changed bytes).
    """

    def __init__(
        self,
        state: H2DRunnerState,
        shape: StepShape,
        *,
        group: str = PREFILL_STEP,
        extra_groups: Sequence[str] = (),
        prev_rows: int | None = None,
        **prefill_options: Unpack[PrefillOptions],
    ) -> None:
        shape = check_shape(group, shape)
        unknown = sorted(set(prefill_options) - set(PrefillOptions.__annotations__))
        if unknown:  # before any adapter declares a buffer
            raise DeclarationError(
                f"{group}: unknown keyword(s) {unknown}; PrefillStepInputs takes group, "
                "extra_groups, prev_rows and PrefillInputs' options "
                f"{sorted(PrefillOptions.__annotations__)}")
        self._compose(
            SamplingInputs(state, shape.max_reqs),
            TokenInputs(state, max_reqs=shape.max_reqs, max_tokens=shape.max_tokens,
                        prev_rows=prev_rows),
            PrefillInputs(state, shape, **prefill_options),
            group, tuple(extra_groups))

    @classmethod
    def from_adapters(
        cls,
        sampling: SamplingInputs,
        tokens: TokenInputs,
        prefill: PrefillInputs,
        *,
        group: str = PREFILL_STEP,
        extra_groups: Sequence[str] = (),
    ) -> PrefillStepInputs:
        """Compose adapters declared on one state and combine their groups into ``group``
        (before ``bind()``)."""
        self = cls.__new__(cls)
        self._compose(sampling, tokens, prefill, group, tuple(extra_groups))
        return self

    def _compose(self, sampling: SamplingInputs, tokens: TokenInputs, prefill: PrefillInputs,
                 group: str, extra_groups: tuple[str, ...]) -> None:
        # speculative indices never ride with a prefill chunk (nothing verifies in it)
        self._combine(sampling, tokens, prefill, "prefill", group,
                      [SAMPLING, TOKEN_IDS, QUERY_PREFIX, PREFILL_INPUTS, *extra_groups])
        self.prefill = prefill
        # the chunk's body and its fused column values (chunk_producer's entry reads them)
        self._run_chunk = prefill.run_chunk
        self._fused_values = self._values
        self._plans: tuple[PrefillStepPlan, ...] = ()  # per slot, at bind
        #: the published KV page prefix and token owners (the prefill adapter's members)
        self.kv_indptr: H2DBuffer = prefill.kv_indptr
        self.token_request: H2DBuffer = prefill.token_request

    prepare = chunk_producer(
        SAMPLING, TOKEN_IDS, QUERY_PREFIX, PREFILL_INPUTS, owner="PrefillStepInputs",
        doc="""Write and count every member of the chunk and stage the block table, the
        step's plan returned; publish with ``state.publish(self.group)``. The arguments
        are :meth:`PrefillInputs.prepare`'s (``batch``, then the keywords
        ``publish_tables``, ``owns_slot``, ``mrope_positions``, ``mrope_deltas``). The
        whole chunk (sampling and token columns, lengths, table rows, the prefill adapter's
        own inputs) is checked before any source is written: a rejected chunk raises a
        specific error and changes nothing.""")

    def _bind(self) -> LayoutStep:
        s, t, pf = self.sampling, self.tokens, self.prefill
        layouts = pf.request_layouts(self.group, cu_query=(t.cu_seqlens_q, t.decode_cu),
                                     # a prefill chunk verifies no drafts: num_drafts 0
                                     columns=lambda slot: step_columns(s, t, slot,
                                                                       drafts=False))
        step = (token_step_spec(s, t) + pf.step_spec()).bind(
            self.group, self.h2d_state, layouts, sum_column=5, error=AdapterInputError)
        # per slot, the sampling and token plans over the step's records
        self._plans = slot_plans(self.h2d_state, step, lambda c, slot: PrefillStepPlan(
            sampling_plan(s, c, slot), TokenPlan.over(c), PrefillPlan.over(c)))
        self._step = step
        return step

    def prepare_attention(self, plan: PrefillStepPlan) -> torch.Tensor:
        """First consumer after publication: ``kv_indices`` (returned) from the published
        block tables and ``kv_indptr``; its first ``plan.prefill.num_pages`` entries are
        the chunk's pages, request after request. Reads only the step's own members. A
        chunk prepared with ``publish_tables=False`` is refused
        (:meth:`PrefillInputs.prepare_attention`: its GPU table is an earlier chunk's)."""
        # the prefill adapter reads a step plan's .prefill, takes a PrefillPlan itself too,
        # and refuses anything else naming this group
        return self.prefill.prepare_attention(plan, self.group)  # type: ignore[arg-type]
