"""One small, valid world per ``@h2d_producer`` entry point of the adapters: a bound state
(destinations poisoned), the adapter, two different valid calls (the first step's and
another one's) and the group that publishes them. The decorator suites
(``test_producer_decorators.py``, ``test_producer_reentry_families.py``) run every rule of
the shared decorator over this table, so a producer added here is checked by all of them.

CPU, the reference scatter: the rules under test are the host's, no kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    ENGRAM,
    GDN_STATE,
    MLA_DECODE,
    MLA_DECODE_STEP,
    PREFILL_INPUTS,
    PREFILL_STEP,
    QUERY_PREFIX,
    SAMPLING,
    SPEC_INDICES,
    TOKEN_IDS,
    TOKEN_INPUTS,
    V41_METADATA,
    BatchColumns,
    DecodeStepInputs,
    EngramInputs,
    GdnStateInputs,
    MlaDecodeInputs,
    MlaDecodeStepInputs,
    PrefillInputs,
    PrefillStepInputs,
    RequestSpan,
    SamplingInputs,
    ScheduledBatch,
    StepShape,
    TokenStepInputs,
    V41MetadataInputs,
)

POISON = 0x5A
PAGE = 4


def state() -> H2DRunnerState:
    return H2DRunnerState("cpu", scatter="reference")


def bound(st: H2DRunnerState) -> None:
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(POISON)


def i32(*values: int) -> np.ndarray:
    return np.asarray(values, np.int32)


def batch(q: list[int], ctx: list[int], *, drafts: list[int] | None = None,
          prefill: bool = False, first_page: int = 1) -> ScheduledBatch:
    """Requests of ``q`` query tokens over ``ctx`` tokens of context, each on its own
    consecutive pages from ``first_page`` (two worlds' batches differ in every column)."""
    n = len(q)
    cols = BatchColumns(
        query_lens=i32(*q), context_lens=i32(*ctx),
        temperatures=np.linspace(0.5, 1.0, n, dtype=np.float32), top_k=np.full(n, 5, np.int32),
        top_p=np.ones(n, np.float32),
        prev_sample_rows=np.full(n, -1, np.int32) if prefill else np.arange(n, dtype=np.int32),
        token_ids=np.arange(first_page, first_page + sum(q), dtype=np.int32),
        num_drafts=i32(*(drafts or [0] * n)))
    rows, page = [], first_page
    for c in ctx:
        rows.append(BlockTable(range(page, page + -(-c // PAGE))))
        page += -(-c // PAGE)
    return ScheduledBatch((), prefill, PAGE, given_columns=cols, given_block_tables=rows)


@dataclass(frozen=True)
class Family:
    """``build()`` -> the adapter (on its bound state, ``adapter.h2d_state``);
    ``call(adapter, k, **kw)``: the k-th valid call (k = 0, 1), ``kw`` is the decorator's
    ``h2d_reason``; ``groups``: the producer groups the decorator names in its errors;
    ``publish``: the group the call's sources go out in."""

    build: Callable[[], Any]
    call: Callable[..., object]
    groups: tuple[str, ...]
    publish: str


def _sampling() -> SamplingInputs:
    st = state()
    a = SamplingInputs(st, 4)
    bound(st)
    return a


def _mla() -> MlaDecodeInputs:
    st = state()
    a = MlaDecodeInputs(st, StepShape(max_reqs=4, max_tokens=4, max_pages_per_req=4,
                                      page_size=PAGE, num_pages=64), index_topk=6)
    bound(st)
    return a


#: the prefill families' capacities (the adapter alone and the fused step)
PREFILL_SHAPE = StepShape(max_reqs=4, max_tokens=32, max_pages_per_req=8, page_size=PAGE,
                          num_pages=64)


def _prefill() -> PrefillInputs:
    st = state()
    a = PrefillInputs(st, PREFILL_SHAPE)
    bound(st)
    return a


def _prefill_step() -> PrefillStepInputs:
    st = state()
    a = PrefillStepInputs(st, PREFILL_SHAPE)
    bound(st)
    return a


def _token_step() -> TokenStepInputs:
    st = state()
    a = TokenStepInputs(st, max_reqs=4, max_tokens=16)
    bound(st)
    return a


def _decode_step(cls: type[DecodeStepInputs]) -> Callable[[], DecodeStepInputs]:
    def build() -> DecodeStepInputs:
        st = state()
        a = cls(st, StepShape(max_reqs=4, max_tokens=16, max_pages_per_req=8, page_size=PAGE,
                              num_pages=64), max_drafts=2)
        bound(st)
        return a
    return build


V41_BLOCKS = 64


def _v41() -> V41MetadataInputs:
    st = state()
    a = V41MetadataInputs(st, max_reqs=4, max_tokens=16, max_blocks_per_req=4,
                          dummy_state_slot=9, dummy_block=V41_BLOCKS - 1,
                          num_blocks=V41_BLOCKS, fp8=True)
    bound(st)
    return a


#: (spans, rows) of the two V4.1 calls: decode steps of 1-2 tokens, prefill chunks
V41_STEPS = (
    ([RequestSpan(1, 300, 0, -1), RequestSpan(2, 9, 1, 5)], [BlockTable([3, 4]), BlockTable([7])]),
    ([RequestSpan(2, 520, 2, -1), RequestSpan(1, 4, 0, -1), RequestSpan(1, 70, 3, 1)],
     [BlockTable([10, 11, 12]), BlockTable([20]), BlockTable([30])]),
)
V41_CHUNKS = (
    ([RequestSpan(7, 7, 0, -1), RequestSpan(3, 9, 1, -1)], [BlockTable([3]), BlockTable([7])]),
    ([RequestSpan(5, 300, 2, -1)], [BlockTable([10, 11])]),
)


def _gdn() -> GdnStateInputs:
    st = state()
    a = GdnStateInputs(st, max_reqs=4, num_spec=1, num_state_slots=8)
    bound(st)
    return a


def _engram() -> EngramInputs:
    st = state()
    a = EngramInputs(st, max_reqs=4, max_drafts=2, history_rows=6, history_len=40)
    bound(st)
    return a


DECODE = (batch([1, 1, 1], [5, 2, 9]), batch([1, 1], [13, 3], first_page=20))
VERIFY = (batch([3, 1, 2], [10, 5, 12], drafts=[2, 0, 1]),
          batch([2, 3], [6, 14], drafts=[1, 2], first_page=20))
PREFILL = (batch([7, 5, 3], [7, 12, 3], prefill=True),
           batch([4, 9], [10, 9], prefill=True, first_page=20))
GDN_CALLS: tuple[dict[str, Any], dict[str, Any]] = (
    {"state_groups": i32(0, 1, 2), "num_accepted": i32(2, 1, 2)},
    {"state_groups": i32(3, 0), "padded": 4, "num_accepted": i32(1, 2)},
)
ENGRAM_CALLS = (
    (batch([2, 2], [2, 2], drafts=[1, 0]), i32(5, 1), i32(3, 4)),
    (batch([3, 1, 2], [3, 1, 2], drafts=[2, 0, 1]), i32(4, 0, 2), i32(0, 7, 30)),
)

#: entry point (Class.method) -> its world; every decorated producer of the adapters
FAMILIES: dict[str, Family] = {
    "SamplingInputs.prepare": Family(
        _sampling, lambda a, k, **kw: a.prepare(DECODE[k], **kw), (SAMPLING,), SAMPLING),
    "MlaDecodeInputs.prepare": Family(
        _mla, lambda a, k, **kw: a.prepare(DECODE[k], 4, **kw), (MLA_DECODE,), MLA_DECODE),
    "PrefillInputs.prepare": Family(
        _prefill, lambda a, k, **kw: a.prepare(PREFILL[k], **kw), (PREFILL_INPUTS,),
        PREFILL_INPUTS),
    "PrefillStepInputs.prepare": Family(
        _prefill_step, lambda a, k, **kw: a.prepare(PREFILL[k], **kw),
        (SAMPLING, TOKEN_IDS, QUERY_PREFIX, PREFILL_INPUTS), PREFILL_STEP),
    "TokenStepInputs.prepare": Family(
        _token_step, lambda a, k, **kw: a.prepare(DECODE[k], 4, **kw),
        (SAMPLING, TOKEN_IDS, QUERY_PREFIX), TOKEN_INPUTS),
    "DecodeStepInputs.prepare": Family(
        _decode_step(DecodeStepInputs), lambda a, k, **kw: a.prepare(DECODE[k], 4, **kw),
        (SAMPLING, TOKEN_IDS, QUERY_PREFIX, "mha_decode"), DECODE_STEP),
    "DecodeStepInputs.prepare_verify": Family(
        _decode_step(DecodeStepInputs), lambda a, k, **kw: a.prepare_verify(VERIFY[k], 4, **kw),
        (SAMPLING, TOKEN_IDS, QUERY_PREFIX, SPEC_INDICES, "mha_decode"), DECODE_STEP),
    "MlaDecodeStepInputs.prepare": Family(
        _decode_step(MlaDecodeStepInputs), lambda a, k, **kw: a.prepare(DECODE[k], 4, **kw),
        (SAMPLING, TOKEN_IDS, QUERY_PREFIX, MLA_DECODE), MLA_DECODE_STEP),
    "MlaDecodeStepInputs.prepare_verify": Family(
        _decode_step(MlaDecodeStepInputs),
        lambda a, k, **kw: a.prepare_verify(VERIFY[k], 4, **kw),
        (SAMPLING, TOKEN_IDS, QUERY_PREFIX, SPEC_INDICES, MLA_DECODE), MLA_DECODE_STEP),
    "V41MetadataInputs.begin_step": Family(
        _v41, lambda a, k, **kw: a.begin_step(V41_STEPS[k][0], block_tables=V41_STEPS[k][1],
                                              padded=4, **kw),
        (V41_METADATA,), V41_METADATA),
    "V41MetadataInputs.begin_prefill": Family(
        _v41, lambda a, k, **kw: a.begin_prefill(V41_CHUNKS[k][0],
                                                 block_tables=V41_CHUNKS[k][1], **kw),
        (V41_METADATA,), V41_METADATA),
    "GdnStateInputs.prepare": Family(
        _gdn, lambda a, k, **kw: a.prepare(**GDN_CALLS[k], **kw), (GDN_STATE,), GDN_STATE),
    "EngramInputs.prepare": Family(
        _engram, lambda a, k, **kw: a.prepare(*ENGRAM_CALLS[k], **kw), (ENGRAM,), ENGRAM),
}
