"""Runner adapters: per-consumer-group buffers, producers and first-consumer kernels.

Each adapter declares its buffers on an :class:`h2d_core.H2DRunnerState`, fills them from a
plain :class:`ScheduledBatch` through ``@h2d_producer`` methods, and runs the group's first
GPU consumer on the published destinations. The paged adapters take the step's
capacities as one :class:`StepShape`::

    shape = StepShape(max_reqs=..., max_tokens=..., max_pages_per_req=..., page_size=16)
    sampling = SamplingInputs(state, shape.max_reqs)            # group "sampling"
    tokens = TokenInputs(state, max_reqs=shape.max_reqs,
                         max_tokens=shape.max_tokens)           # token_ids, query_prefix, ...
    decode = MhaDecodeInputs(state, shape)                      # "mha_decode" + block tables
    prefill = PrefillInputs(state, shape)                       # "prefill_inputs"
    state.combine("decode_step", ["sampling", *tokens.producer_groups, "mha_decode"])
    state.bind()
    state.begin(); sampling.prepare(batch); tokens.prepare_ids(batch, padded)
    tokens.prepare_query_prefix(batch, padded); plan = decode.prepare(batch, padded)
    state.publish("decode_step"); state.finish()
    tokens.assemble(...); decode.generate_kv_indices(plan)     # first consumers

A plain decode step can use :class:`DecodeStepInputs` instead: the same three adapters,
one producer call (compiled when a C compiler is present) and one group::

    step = DecodeStepInputs(state, shape)
    state.bind(); state.begin(); plan = step.prepare(batch, padded)
    state.publish(DECODE_STEP); state.finish()
    step.tokens.assemble(plan.tokens, prev); step.decode.generate_kv_indices(plan.decode)

A prefill chunk has the same shape, :class:`PrefillStepInputs` (group ``prefill_step``)::

    step = PrefillStepInputs(state, shape)
    state.bind(); state.begin(); plan = step.prepare(batch)
    state.publish(PREFILL_STEP); state.finish()
    step.tokens.assemble(plan.tokens, prev); step.prepare_attention(plan)
"""

from h2d_runner_adapters.batch import (
    BatchColumns,
    PageRow,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
)
from h2d_runner_adapters.checks import AdapterInputError
from h2d_runner_adapters.consumers import (
    GREEDY_TEMPERATURE,
    ConsumerArgumentError,
    ConsumerDeviceError,
    StepIndptrs,
    assemble_token_ids,
    consumers_fusable,
    fill_gumbel_noise_,
    gather_draft_ids,
    generate_kv_indices,
    generate_v4_step_indptrs,
    prepare_prefill_attention,
    sample_tokens,
)
from h2d_runner_adapters.decode_step import (
    DECODE_STEP,
    MLA_DECODE_STEP,
    DecodeStepInputs,
    DecodeStepPlan,
    MlaDecodeStepInputs,
)
from h2d_runner_adapters.draft.acceptance import accept_draft_tokens
from h2d_runner_adapters.draft.loop import MhaDraftLoop
from h2d_runner_adapters.draft.step import DraftStepMetadata, advance_draft_step
from h2d_runner_adapters.engram.inputs import ENGRAM, EngramInputs, EngramPlan
from h2d_runner_adapters.gdn.inputs import GDN_STATE, GdnPlan, GdnStateInputs
from h2d_runner_adapters.gdn.states import gather_gdn_states
from h2d_runner_adapters.mha.inputs import MHA_DECODE, DecodePlan, MhaDecodeInputs
from h2d_runner_adapters.mla_decode import MLA_DECODE, MlaDecodeInputs
from h2d_runner_adapters.mrope.positions import select_mrope_positions
from h2d_runner_adapters.paged import PagedInputs
from h2d_runner_adapters.prefill import PREFILL_INPUTS, PrefillInputs, PrefillPlan
from h2d_runner_adapters.prefill_step import PREFILL_STEP, PrefillStepInputs, PrefillStepPlan
from h2d_runner_adapters.sampling.inputs import SAMPLING, SamplingInputs, SamplingPlan
from h2d_runner_adapters.shape import StepShape
from h2d_runner_adapters.token_inputs import (
    QUERY_PREFIX,
    SPEC_INDICES,
    TOKEN_IDS,
    TOKEN_INPUTS,
    TokenInputs,
    TokenPlan,
)
from h2d_runner_adapters.token_step import TokenStepInputs, TokenStepPlan
from h2d_runner_adapters.v4.metadata import (
    V4_BLOCK,
    V41_METADATA,
    RequestSpan,
    SpanColumns,
    V41MetadataInputs,
    V41Plan,
)

__all__ = [
    "DECODE_STEP",
    "ENGRAM",
    "GDN_STATE",
    "GREEDY_TEMPERATURE",
    "MHA_DECODE",
    "MLA_DECODE",
    "MLA_DECODE_STEP",
    "PREFILL_INPUTS",
    "PREFILL_STEP",
    "QUERY_PREFIX",
    "SAMPLING",
    "SPEC_INDICES",
    "TOKEN_IDS",
    "TOKEN_INPUTS",
    "V4_BLOCK",
    "V41_METADATA",
    "AdapterInputError",
    "BatchColumns",
    "ConsumerArgumentError",
    "ConsumerDeviceError",
    "DecodePlan",
    "DecodeStepInputs",
    "DecodeStepPlan",
    "DraftStepMetadata",
    "EngramInputs",
    "EngramPlan",
    "GdnPlan",
    "GdnStateInputs",
    "MhaDecodeInputs",
    "MhaDraftLoop",
    "MlaDecodeInputs",
    "MlaDecodeStepInputs",
    "PageRow",
    "PagedInputs",
    "PrefillInputs",
    "PrefillPlan",
    "PrefillStepInputs",
    "PrefillStepPlan",
    "RequestSpan",
    "SamplingInputs",
    "SamplingParams",
    "SamplingPlan",
    "ScheduledBatch",
    "ScheduledRequest",
    "SpanColumns",
    "StepIndptrs",
    "StepShape",
    "TokenInputs",
    "TokenPlan",
    "TokenStepInputs",
    "TokenStepPlan",
    "V41MetadataInputs",
    "V41Plan",
    "accept_draft_tokens",
    "advance_draft_step",
    "assemble_token_ids",
    "consumers_fusable",
    "fill_gumbel_noise_",
    "gather_draft_ids",
    "gather_gdn_states",
    "generate_kv_indices",
    "generate_v4_step_indptrs",
    "prepare_prefill_attention",
    "sample_tokens",
    "select_mrope_positions",
]
