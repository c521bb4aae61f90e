"""The MTP/EAGLE draft loop over an MHA decode publication: no upload per draft step.

Draft step 0 reuses the verify step's metadata. Each later step's positions, context
lengths, KV slots, KV prefix and query prefix are derived on the GPU
(:func:`advance_draft_step`) from what the verify step already published (positions,
query prefix, block tables) and the sampler's rejection counts (a device array), then
KV-index generation runs on the derived prefix. The host passes the step number and the
counts it already knows: nothing is uploaded and nothing is read back.

The draft-ID gather (``TokenInputs.gather_drafts``) stays the second consumer of the
token inputs.
"""

from __future__ import annotations

import torch

from .consumers import generate_kv_indices
from .consumers.draft_step import DraftStepMetadata, advance_draft_step
from .mha_decode import DecodePlan, MhaDecodeInputs
from .token_inputs import TokenInputs


class MhaDraftLoop:
    """Device buffers of the draft steps (allocated once) over ``decode`` and ``tokens``
    (the adapters whose published members the verify step filled)."""

    def __init__(self, decode: MhaDecodeInputs, tokens: TokenInputs) -> None:
        self.decode = decode
        self.tokens = tokens
        dev = decode.h2d_state.device
        s = decode.context_lens.spec.capacity
        pages = decode.block_tables.spec.shape[1]

        def zeros(k: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(k, dtype=dtype, device=dev)

        #: the current draft step's metadata (rewritten by each :meth:`advance`)
        self.meta = DraftStepMetadata(zeros(s, torch.int64), zeros(s, torch.int32),
                                      zeros(s, torch.int64), zeros(s + 1, torch.int32),
                                      zeros(s + 1, torch.int32))
        self.kv_indices = zeros(s * pages, torch.int32)

    def advance(self, plan: DecodePlan, num_rejected: torch.Tensor, step: int
                ) -> DraftStepMetadata:
        """Draft step ``step`` (>= 1) of the verify step ``plan``: its metadata and
        ``kv_indices``, on the GPU, from ``num_rejected`` (int32, one per request)."""
        d = self.decode
        meta = advance_draft_step(
            d.positions.gpu, self.tokens.cu_seqlens_q.gpu, num_rejected, d.block_tables.gpu,
            self.meta, num_reqs=plan.num_reqs, padded_reqs=plan.padded_reqs, step=step,
            page_size=d.page_size)
        generate_kv_indices(d.block_tables.gpu, meta.kv_indptr, self.kv_indices,
                            plan.padded_reqs)
        return meta
