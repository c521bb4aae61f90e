"""h2d-core: publish a runner's per-step metadata with one DMA + one scatter per group.

Public API::

    state = H2DRunnerState("cuda", num_slots=1, backend=None)   # ATOM_H2D_BACKEND read once
    buf = state.buffer("slot_mapping", (N,), torch.int64, group="mha_decode", unit="elements")
    state.combine("decode", ["token_inputs", "mha_decode"])     # optional
    state.bind()
    state.begin(); buf.np[:n] = ...; state.set_count(buf, n)
    counts = state.count_batch([a, b, c]); counts.set(n_a, None, n_c)   # fused producers
    state.publish("decode"); state.finish()

    @h2d_producer("mha_decode")
    def prepare_decode(adapter, batch): ...     # adapter.h2d_state is the owner

    spec = StepSpec([CountRule(buf, PADDED_TOKENS)], table, pad_rows)   # a producer's part
    step = spec.bind(name, state, layouts)     # fused: (spec_a + spec_b).bind(...)
    step.run(query_lens, context_lens, rows, padded, -1, columns)   # a fused producer's body
    kv = state.fuse_consumer("kv_indices", [indptr], fn)   # before bind: fn(header, rows)
    kv.fused                     # after bind: the publication (its graphs) runs fn itself

    restore_implicit_cpu_default()   # after GPU initialization: no DeviceContext per call
"""

from .block_table_state import BlockTableState, PublishedTable, StageResult, block_table_state
from .buffer import BufferSpec, CountUnit, H2DBuffer
from .config import ENV_VAR, Backend, resolve_backend
from .count_batch import CountBatch
from .count_rules import CountRule
from .default_device import device_context_active, restore_implicit_cpu_default
from .errors import (
    BackendError,
    BindingError,
    CountError,
    DeclarationError,
    DeviceContextError,
    DeviceMismatchError,
    DeviceUnavailableError,
    DuplicatePublicationError,
    EpochError,
    H2DError,
    MembershipError,
    NotBoundError,
    OwnerInvalidatedError,
    OwnerThreadError,
    ProducerOwnerError,
    PublicationEnqueueError,
    ReentryError,
    RequestLayoutError,
    StreamMismatchError,
    TablePolicyError,
    UnknownGroupError,
    describe_value,
)
from .fused import ConsumerFn, FusedConsumer
from .group import GroupPlan
from .layout_records import (
    QUERY_LENS,
    LayoutColumn,
    LayoutOutput,
    LayoutPlan,
    OrElse,
    RampRows,
    RequestBound,
    RequestSum,
    RequestValues,
    TokenPlanes,
    VerifyRows,
)
from .producer import h2d_producer
from .records import GroupCounters
from .request_layout import RequestLayout
from .state import H2DRunnerState
from .step import (
    DRAFTS,
    OMITTED,
    PADDED_REQS,
    PADDED_TOKENS,
    PLAN_ROWS,
    REQS,
    STEP_COUNTS,
    TOKENS,
    LayoutStep,
    StepCounts,
)
from .step_spec import StepSpec
from .table_policy import TablePublication

__all__ = [
    "DRAFTS",
    "ENV_VAR",
    "OMITTED",
    "PADDED_REQS",
    "PADDED_TOKENS",
    "PLAN_ROWS",
    "QUERY_LENS",
    "REQS",
    "STEP_COUNTS",
    "TOKENS",
    "Backend",
    "BackendError",
    "BindingError",
    "BlockTableState",
    "BufferSpec",
    "ConsumerFn",
    "CountBatch",
    "CountError",
    "CountRule",
    "CountUnit",
    "DeclarationError",
    "DeviceContextError",
    "DeviceMismatchError",
    "DeviceUnavailableError",
    "DuplicatePublicationError",
    "EpochError",
    "FusedConsumer",
    "GroupCounters",
    "GroupPlan",
    "H2DBuffer",
    "H2DError",
    "H2DRunnerState",
    "LayoutColumn",
    "LayoutOutput",
    "LayoutPlan",
    "LayoutStep",
    "MembershipError",
    "NotBoundError",
    "OrElse",
    "OwnerInvalidatedError",
    "OwnerThreadError",
    "ProducerOwnerError",
    "PublicationEnqueueError",
    "PublishedTable",
    "RampRows",
    "ReentryError",
    "RequestBound",
    "RequestLayout",
    "RequestLayoutError",
    "RequestSum",
    "RequestValues",
    "StageResult",
    "StepCounts",
    "StepSpec",
    "StreamMismatchError",
    "TablePolicyError",
    "TablePublication",
    "TokenPlanes",
    "UnknownGroupError",
    "VerifyRows",
    "block_table_state",
    "describe_value",
    "device_context_active",
    "h2d_producer",
    "resolve_backend",
    "restore_implicit_cpu_default",
]
