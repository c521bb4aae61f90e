"""First-consumer GPU kernels of the runner groups, as pure functions on torch tensors.

Each module holds one Triton kernel beside its launcher. Launchers check
metadata only (no host sync), take host-side counts as Python ints, write in
place (or into ``out=``) and never recompile for a new batch size.
:mod:`~h2d_runner_adapters.consumers.reference` holds plain-torch oracles for tests.
"""

from h2d_runner_adapters.consumers._launch import consumers_fusable
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError, ConsumerDeviceError
from h2d_runner_adapters.consumers.prefill_attention import prepare_prefill_attention
from h2d_runner_adapters.consumers.token_assembly import assemble_token_ids
from h2d_runner_adapters.draft.gather import gather_draft_ids
from h2d_runner_adapters.mha.kv_indices import generate_kv_indices
from h2d_runner_adapters.sampling.sampler import (
    GREEDY_TEMPERATURE,
    fill_gumbel_noise_,
    sample_tokens,
)
from h2d_runner_adapters.v4.step_indptrs import (
    DecodeWindowIndices,
    PrefillIndices,
    PrefillIndptrs,
    StepIndptrs,
    WindowGeometry,
    expand_v4_token_tables,
    generate_v4_prefill_indptrs,
    generate_v4_step_indptrs,
    write_v4_decode_window_indices,
    write_v4_indexer_rectangle,
    write_v4_prefill_indices,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "ConsumerArgumentError",
    "ConsumerDeviceError",
    "DecodeWindowIndices",
    "PrefillIndices",
    "PrefillIndptrs",
    "StepIndptrs",
    "WindowGeometry",
    "assemble_token_ids",
    "consumers_fusable",
    "expand_v4_token_tables",
    "fill_gumbel_noise_",
    "gather_draft_ids",
    "generate_kv_indices",
    "generate_v4_prefill_indptrs",
    "generate_v4_step_indptrs",
    "prepare_prefill_attention",
    "sample_tokens",
    "write_v4_decode_window_indices",
    "write_v4_indexer_rectangle",
    "write_v4_prefill_indices",
]
