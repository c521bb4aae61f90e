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

from h2d_core import DeclarationError, describe_value

from ..checks import AdapterInputError, int_value
from ..mha.inputs import DecodePlan, MhaDecodeInputs
from ..mha.kv_indices import generate_kv_indices
from ..token_inputs import TokenInputs
from .step import DraftStepMetadata, advance_draft_step


class MhaDraftLoop:
    """Device buffers of the draft steps (allocated once) over ``decode`` and ``tokens``
    (the adapters whose published members the verify step filled)."""

    def __init__(self, decode: MhaDecodeInputs, tokens: TokenInputs) -> None:
        if tokens.h2d_state is not decode.h2d_state:
            raise DeclarationError(
                f"{decode.group}: the draft loop's decode and token adapters must be declared "
                "on the same H2DRunnerState (the verify step's publication)")
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
        ``kv_indices``, on the GPU, from ``num_rejected`` (int32, one per request).
        Every argument is checked before the first launch (:meth:`_check`); a refusal
        raises :class:`AdapterInputError` and leaves ``meta`` and ``kv_indices`` as they
        were."""
        n, p, k = self._check(plan, num_rejected, step)
        d = self.decode
        meta = advance_draft_step(
            d.positions.gpu, self.tokens.cu_seqlens_q.gpu, num_rejected,
            d.block_tables.gpu, self.meta, num_reqs=n, padded_reqs=p, step=k,
            page_size=d.page_size)
        generate_kv_indices(d.block_tables.gpu, meta.kv_indptr, self.kv_indices, p)
        return meta

    def _check(self, plan: object, num_rejected: object, step: object
               ) -> tuple[int, int, int]:
        """``(num_reqs, padded_reqs, step)`` as Python ints after checking: ``plan`` a
        :class:`DecodePlan` whose request counts fit the loop's buffers, ``num_rejected``
        an int32 vector on the decode device with one count per real request, ``step`` an
        integer in ``[1, pages * page_size)`` (a draft position is at least ``step``, so a
        later step would put every one past the block tables: no KV slot at all)."""
        d = self.decode
        g = d.group
        if not isinstance(plan, DecodePlan) and isinstance(getattr(plan, "decode", None),
                                                           DecodePlan):
            plan = plan.decode  # type: ignore[attr-defined]  # the verify step's plan
        if not isinstance(plan, DecodePlan):
            raise AdapterInputError(
                f"{g}: plan must be the DecodePlan of the verify step (what "
                f"MhaDecodeInputs.prepare returned), got {describe_value(plan)}")
        cap = d.context_lens.spec.capacity
        p = int_value(g, "plan.padded_reqs", plan.padded_reqs, 0, cap)
        n = int_value(g, "plan.num_reqs", plan.num_reqs, 0, p)
        k = int_value(g, "step", step, 1)
        width = d.block_tables.spec.shape[1] * d.page_size
        if k >= width:
            raise AdapterInputError(
                f"{g}: step={k} puts every draft position past the block tables' "
                f"{width} positions ({d.block_tables.spec.shape[1]} pages of {d.page_size});"
                f" steps must be in [1, {width - 1}]")
        if not isinstance(num_rejected, torch.Tensor) or num_rejected.dtype != torch.int32 \
                or num_rejected.dim() != 1 or num_rejected.numel() < n:
            got = (f"a {num_rejected.dtype} tensor of shape {tuple(num_rejected.shape)}"
                   if isinstance(num_rejected, torch.Tensor) else describe_value(num_rejected))
            raise AdapterInputError(
                f"{g}: num_rejected must be a 1-D torch.int32 tensor with one rejection "
                f"count per request (>= plan.num_reqs={n} entries), got {got}")
        dev = d.positions.gpu.device
        if num_rejected.device != dev:
            raise AdapterInputError(
                f"{g}: num_rejected is on {num_rejected.device} but the verify step's "
                f"members are on {dev}; pass the sampler's device counts")
        return n, p, k
