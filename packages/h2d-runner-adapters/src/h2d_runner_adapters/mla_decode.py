"""MLA decode metadata (DeepSeek-V3 / Kimi class): the ``mla_decode`` group.

The MHA decode members (KV slots, context lengths, changed block-table rows through the
shared ``block_table_state``, KV page prefix, positions; see :mod:`.mha.inputs`) at MLA's
page size, plus:

* ``mla_kv_last_page_lens`` (int32, per request): tokens in each request's last page,
  ``(ctx - 1) % page + 1``; 0 for padded requests (they own no pages);
* ``mla_sparse_kv_indptr`` (int32 ``[P + 1]``, DSA sparse attention only, when
  ``index_topk`` is given): the prefix of ``min(ctx, index_topk)``; the tail repeats the
  total.

Both come from the same compiled :class:`h2d_core.RequestLayout` pass as the MHA
members (its ``last_page_lens`` and capped ``context_prefix`` outputs), inside the one
:class:`h2d_core.LayoutStep` call. One group, one DMA and one scatter (with
``token_inputs``: two). First consumer: KV-index generation at MLA's page size
(:meth:`generate_kv_indices`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from h2d_core import (
    PADDED_REQS,
    CountRule,
    DeclarationError,
    H2DRunnerState,
    StepSpec,
    h2d_producer,
)

from .batch import ScheduledBatch
from .checks import INT32_MAX
from .mha.inputs import DecodePlan, MhaDecodeInputs
from .shape import StepShape, check_shape

MLA_DECODE = "mla_decode"


class MlaDecodeInputs(MhaDecodeInputs):
    """Declares the MLA decode buffers (``mla_``-prefixed names, group ``mla_decode``),
    produces them and runs KV-index generation, sized by ``shape`` (a
    :class:`~h2d_runner_adapters.StepShape`: MLA's page size and capacities).
    ``index_topk`` adds DSA's sparse KV prefix; ``prefix`` declares a TBO ubatch's own
    buffers and group; ``fuse_kv_indices`` is :class:`MhaDecodeInputs`'s (default None:
    fused wherever the kernel runs)."""

    def __init__(
        self,
        state: H2DRunnerState,
        shape: StepShape,
        *,
        index_topk: int | None = None,
        prefix: str = "",
        fuse_kv_indices: bool | None = None,
    ) -> None:
        g = f"{prefix}{MLA_DECODE}"
        # checked before any buffer is declared: a refused adapter leaves the state as it
        # was (the shape checked its page size and capacities when it was made)
        shape = check_shape(g, shape)
        if index_topk is not None and (isinstance(index_topk, bool)
                                       or not isinstance(index_topk, int)
                                       or not 1 <= index_topk <= INT32_MAX):
            raise DeclarationError(
                f"{g}: index_topk must be an int in [1, {INT32_MAX}] or None, got "
                f"{index_topk!r}")
        super().__init__(state, shape, prefix=f"{prefix}mla_", group=g,
                         fuse_kv_indices=fuse_kv_indices)
        max_reqs = shape.max_reqs
        buf = state.buffer
        self.kv_last_page_lens = buf(f"{prefix}mla_kv_last_page_lens", (max_reqs,),
                                     torch.int32, group=g)
        self.index_topk = index_topk or 0
        self.sparse_kv_indptr = (buf(f"{prefix}mla_sparse_kv_indptr", (max_reqs + 1,),
                                     torch.int32, group=g) if index_topk else None)

    @h2d_producer(lambda self: self.group)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None, *,
                mrope_deltas: np.ndarray | None = None) -> DecodePlan:
        """Write and count the MLA decode members (see the module docstring); the batch
        is checked before any source is written (the layout pass refuses a sparse KV prefix
        past int32 too)."""
        return self._prepare(batch, padded, mrope_deltas)

    def _layout_outputs(self, slot: int) -> dict[str, Any]:
        out: dict[str, Any] = {"last_page_lens": self.kv_last_page_lens.source(slot).numpy()}
        if self.sparse_kv_indptr is not None:
            out["context_prefix"] = self.sparse_kv_indptr.source(slot).numpy()
            out["context_cap"] = self.index_topk
        return out

    def step_spec(self) -> StepSpec:
        """:meth:`MhaDecodeInputs.step_spec` plus the last-page lengths and the sparse KV
        prefix (padded requests)."""
        spec = super().step_spec()
        rules = [*spec.counts, CountRule(self.kv_last_page_lens, PADDED_REQS)]
        if self.sparse_kv_indptr is not None:
            rules.append(CountRule(self.sparse_kv_indptr, PADDED_REQS, 1))
        return replace(spec, counts=rules)
