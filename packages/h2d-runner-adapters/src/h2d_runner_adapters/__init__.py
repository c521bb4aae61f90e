"""Runner adapters for packed metadata publication, and their first GPU consumers."""

from h2d_runner_adapters.consumers import (
    GREEDY_TEMPERATURE,
    ConsumerArgumentError,
    ConsumerDeviceError,
    assemble_token_ids,
    fill_gumbel_noise_,
    gather_draft_ids,
    generate_kv_indices,
    prepare_prefill_attention,
    sample_tokens,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "ConsumerArgumentError",
    "ConsumerDeviceError",
    "assemble_token_ids",
    "fill_gumbel_noise_",
    "gather_draft_ids",
    "generate_kv_indices",
    "prepare_prefill_attention",
    "sample_tokens",
]
