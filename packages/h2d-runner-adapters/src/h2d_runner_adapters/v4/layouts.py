"""The ``v41_metadata`` step's layouts and count rules, built once at bind.

Decode runs the graph grid (padded requests point at the dummy state slot and block);
prefill is eager (the real counts), adds the chunk starts and the window-write plan, and
leaves out the decode-only members (``qo_indptr``, the fused consumer's counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from h2d_core import (
    OMITTED,
    PADDED_REQS,
    PADDED_TOKENS,
    PLAN_ROWS,
    REQS,
    STEP_COUNTS,
    TOKENS,
    CountRule,
    H2DBuffer,
    LayoutColumn,
    LayoutPlan,
    RequestLayout,
)

from .spans import DUMMY_SLOT_NOTE

if TYPE_CHECKING:
    from .metadata import V41MetadataInputs

#: V4 block size (tokens per block-table entry)
V4_BLOCK = 256


def v41_layout(inputs: V41MetadataInputs, slot: int, *, graph: bool) -> RequestLayout:
    """Slot ``slot``'s layout over ``inputs``' sources: decode (``graph``: the graph grid,
    padding to the dummy slot) or prefill (eager plans, no padding, the chunk starts)."""
    def src(b: H2DBuffer) -> np.ndarray:
        return b.source(slot).numpy()

    pad = inputs.dummy_state_slot if graph else None
    extra = [] if graph else [LayoutColumn("chunk_starts", src(inputs.chunk_starts), pad=None)]
    # prefill: the tokens among each request's last `window` positions (a tail plan,
    # eager: the whole array published), after the ratios' plans
    window_plan = [] if graph else [LayoutPlan(
        inputs.window_write_plan.name, src(inputs.window_write_plan), 1, inputs.window, True,
        False)]
    # decode writes the fp8 per-token query prefix too (prefill omits it)
    qo = src(inputs.qo_indptr) if graph and inputs.qo_indptr is not None else None
    return RequestLayout(
        inputs.group, V4_BLOCK, inputs.tables.snapshots[slot].storage,
        np.zeros(inputs.seq_lens.spec.capacity, dtype=np.int32),
        positions=src(inputs.positions), token_requests=src(inputs.token_batch_ids),
        context_lens=src(inputs.seq_lens), token_prefix=qo,
        columns=[LayoutColumn("state_slot_out", src(inputs.state_slot_out), pad=pad, low=0,
                              reserved=inputs.dummy_state_slot, reserved_note=DUMMY_SLOT_NOTE),
                 LayoutColumn("state_slot_in", src(inputs.state_slot_in), pad=pad, low=0,
                              reserved=inputs.dummy_state_slot, reserved_note=DUMMY_SLOT_NOTE),
                 *extra],
        plans=[LayoutPlan(b.name, src(b), r, k, tail, graph)
               for (r, k), cb, wb in zip(inputs.ratios, inputs.compress_plans,
                                         inputs.write_plans, strict=True)
               for b, tail in ((cb, False), (wb, True))] + window_plan)


def count_rules(inputs: V41MetadataInputs) -> tuple[list[CountRule], list[CountRule]]:
    """What a decode step and a prefill chunk publish of each member: ``(decode,
    prefill)``. Plan ``k``'s rows count its published rows (the graph form in decode, the
    eager form in prefill)."""
    # decode: the graph grid; chunk starts and the window-write plan are prefill's
    decode = [CountRule(inputs.positions, PADDED_TOKENS),
              CountRule(inputs.token_batch_ids, PADDED_TOKENS),
              CountRule(inputs.seq_lens, PADDED_REQS),
              CountRule(inputs.state_slot_out, PADDED_REQS),
              CountRule(inputs.state_slot_in, PADDED_REQS),
              CountRule(inputs.chunk_starts, OMITTED),
              CountRule(inputs.window_write_plan, OMITTED)]
    plans = [CountRule(b, PLAN_ROWS, plan=2 * k + j)
             for k, pair in enumerate(zip(inputs.compress_plans, inputs.write_plans,
                                          strict=True))
             for j, b in enumerate(pair)]
    decode += plans
    if inputs.qo_indptr is not None:
        decode.append(CountRule(inputs.qo_indptr, PADDED_TOKENS, 1))
    if inputs.step_counts is not None:
        decode.append(CountRule(inputs.step_counts, STEP_COUNTS))
    # prefill: eager (the real counts), the chunk starts instead of the decode-only members
    prefill = [CountRule(inputs.positions, TOKENS), CountRule(inputs.token_batch_ids, TOKENS),
               CountRule(inputs.seq_lens, REQS), CountRule(inputs.state_slot_out, REQS),
               CountRule(inputs.state_slot_in, REQS), CountRule(inputs.chunk_starts, REQS)]
    prefill += plans
    prefill.append(CountRule(inputs.window_write_plan, PLAN_ROWS, plan=len(plans)))
    prefill += [CountRule(b, OMITTED) for b in (inputs.qo_indptr, inputs.step_counts)
                if b is not None]
    return decode, prefill
