"""A steady step allocates nothing (issue 39, item 1): after warm-up, ``state.begin()``,
the family's producer call(s), ``state.publish(group)`` and ``state.finish()`` create no
Python object.

Each family is built on CPU (``backend="packed"``, two slots, ``scatter="reference"``:
the compiled CPU publication, no fused consumers), warmed up, then ``gc.collect();
gc.freeze()`` (as engines do after warm-up). Over 1,000 steady steps (their inputs built
beforehand, as ``benchmarks/instructions.py`` builds them, so the inputs are not counted)
the test asserts three things:

* ``sys.getallocatedblocks()`` does not grow over the second of two 1,000-step windows
  (net: nothing kept per step; the first window takes what the interpreter makes once);
* ``gc.get_count()[0]`` does not grow (net: no container object kept);
* over the next 50 steady steps, each sampled under ``tracemalloc``, the traced peak does
  not rise above the memory traced before the step (gross: no transient object either;
  the two net measures cannot see an object made and freed within a step).

Block tables that grow by appends stay steady steps: 1/16 of the rows append a page per
step (``steady_decode_batches``). Families whose step still allocates are marked
``xfail(strict=True)`` naming what is left, so the mark must go when they reach zero.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BS = 64
WARM = 60
STEPS = 1000
SAMPLED = 50
#: batches per family: warm-up, two windows of counted steps, then the sampled ones (one
#: more, for tracemalloc's own start-up), each a batch no earlier step ran: stepping an
#: older batch again would rewind the block tables (a changed batch, not a steady step)
ITEMS = WARM + 2 * STEPS + SAMPLED + 1
#: net moves over a window that are not per step (see the test)
NOISE = 4

Step = Callable[[Any], None]


def _state() -> Any:
    from h2d_core import H2DRunnerState

    return H2DRunnerState("cpu", backend="packed", num_slots=2, scatter="reference")


def _core() -> tuple[Step, list[Any]]:
    """The core alone: a packed group of three members, counts set per step (the same
    counts: a DMA size that changes makes the int ``PackedGroup.publish`` returns)."""
    st = _state()
    a = st.buffer("a", (BS,), torch.int32, group="g")
    b = st.buffer("b", (BS,), torch.float32, group="g")
    c = st.buffer("c", (4 * BS,), torch.int64, group="g")
    st.bind()
    begin, finish, publish, set_count = st.begin, st.finish, st.publish, st.set_count

    def step(n: int) -> None:
        begin()
        set_count(a, n)
        set_count(b, n)
        set_count(c, n)
        publish("g")
        finish()

    return step, [BS] * (ITEMS)


def _tokens() -> tuple[Step, list[Any]]:
    """Sampling and token inputs alone (``TokenStepInputs.prepare``)."""
    from h2d_runner_adapters import (
        TOKEN_INPUTS,
        BatchColumns,
        ScheduledBatch,
        TokenStepInputs,
    )

    st = _state()
    tokens = TokenStepInputs(st, max_reqs=BS, max_tokens=BS)
    st.bind()
    n = BS
    columns = BatchColumns(
        query_lens=np.ones(n, np.int32), context_lens=np.full(n, 4096, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
        token_ids=np.zeros(n, np.int32), num_drafts=np.zeros(n, np.int32))
    batch = ScheduledBatch((), False, 16, given_columns=columns)
    begin, finish, publish, prepare = st.begin, st.finish, st.publish, tokens.prepare

    def step(b: Any) -> None:
        begin()
        prepare(b)
        publish(TOKEN_INPUTS)
        finish()

    return step, [batch] * (ITEMS)


def _decode_batches(context: int = 131072) -> tuple[list[Any], Any]:
    """``ITEMS`` steady decode batches at bs=64 (their columns and rows built now) and the
    decode families' :class:`StepShape` (one token per request, the pages a row needs
    over them)."""
    from decode_runner.scheduler import steady_decode_batches
    from step_targets import PAGE

    from h2d_runner_adapters import StepShape

    window = 2 * ITEMS  # no row restarts within the test
    batches = steady_decode_batches(BS, context, PAGE, window=window)
    items = [next(batches) for _ in range(ITEMS)]
    for b in items:
        b.columns, b.block_tables  # noqa: B018
    return items, StepShape(max_reqs=BS, max_tokens=BS, page_size=PAGE,
                            max_pages_per_req=-(-(context + PAGE - 1 + window) // PAGE))


def _mha() -> tuple[Step, list[Any]]:
    """``DecodeStepInputs.prepare`` at bs=64, 128K contexts, 1/16 of rows appending."""
    from h2d_runner_adapters import DECODE_STEP, DecodeStepInputs

    items, shape = _decode_batches()
    st = _state()
    step_inputs = DecodeStepInputs(st, shape, fuse_kv_indices=False)
    st.bind()
    begin, finish, publish, prepare = st.begin, st.finish, st.publish, step_inputs.prepare

    def step(b: Any) -> None:
        begin()
        prepare(b)
        publish(DECODE_STEP)
        finish()

    return step, items


def _mla() -> tuple[Step, list[Any]]:
    """``MlaDecodeStepInputs.prepare`` (DeepSeek's MLA decode step, DSA's sparse KV prefix
    included) at bs=64 over ``mha``'s batches."""
    from h2d_runner_adapters import MLA_DECODE_STEP, MlaDecodeStepInputs

    items, shape = _decode_batches()
    st = _state()
    step_inputs = MlaDecodeStepInputs(st, shape, index_topk=2048, fuse_kv_indices=False)
    st.bind()
    begin, finish, publish, prepare = st.begin, st.finish, st.publish, step_inputs.prepare

    def step(b: Any) -> None:
        begin()
        prepare(b)
        publish(MLA_DECODE_STEP)
        finish()

    return step, items


def _gdn() -> tuple[Step, list[Any]]:
    """``mha``'s step with the GDN state indices riding in its group (the GDN hybrid's
    decode step: ``DecodeStepInputs(..., extra_groups=[GDN_STATE])``, then
    ``GdnStateInputs.prepare``, each request keeping its state group)."""
    from h2d_runner_adapters import DECODE_STEP, GDN_STATE, DecodeStepInputs, GdnStateInputs

    items, shape = _decode_batches()
    st = _state()
    states = GdnStateInputs(st, max_reqs=BS, num_state_slots=BS)
    step_inputs = DecodeStepInputs(st, shape, extra_groups=[GDN_STATE], fuse_kv_indices=False)
    st.bind()
    groups = np.arange(BS, dtype=np.int32)
    begin, finish, publish = st.begin, st.finish, st.publish
    prepare, prepare_states = step_inputs.prepare, states.prepare

    def step(b: Any) -> None:
        begin()
        prepare(b)
        prepare_states(groups)
        publish(DECODE_STEP)
        finish()

    return step, items


def _mrope() -> tuple[Step, list[Any]]:
    """The MRoPE decode step (Qwen2-VL's): ``TokenStepInputs.prepare`` then
    ``MhaDecodeInputs(mrope=True).prepare`` with each request's position delta, both
    groups published."""
    from h2d_runner_adapters import MHA_DECODE, TOKEN_INPUTS, MhaDecodeInputs, TokenStepInputs

    items, shape = _decode_batches()
    st = _state()
    tokens = TokenStepInputs(st, max_reqs=BS, max_tokens=BS)
    decode = MhaDecodeInputs(st, shape, mrope=True, fuse_kv_indices=False)
    st.bind()
    deltas = np.arange(BS, dtype=np.int32) - 7  # each request's text-vs-image shift
    begin, finish, publish = st.begin, st.finish, st.publish
    prepare_tokens, prepare_decode = tokens.prepare, decode.prepare

    def step(b: Any) -> None:
        begin()
        prepare_tokens(b)
        prepare_decode(b, mrope_deltas=deltas)
        publish(TOKEN_INPUTS)
        publish(MHA_DECODE)
        finish()

    return step, items


def _mtp() -> tuple[Step, list[Any]]:
    """``DecodeStepInputs(max_drafts=1).prepare_verify`` at bs=64, 32K contexts."""
    from mtp_step import PAGE, Batches

    from h2d_runner_adapters import DECODE_STEP, DecodeStepInputs, StepShape

    context, k = 32768, 1
    per_row = -(-(context + 2 * ITEMS * (k + 1) + 4 * k + 64) // PAGE)
    st = _state()
    shape = StepShape(max_reqs=BS, max_tokens=BS * (k + 1), max_pages_per_req=per_row,
                      page_size=PAGE)
    step_inputs = DecodeStepInputs(st, shape, max_drafts=k, fuse_kv_indices=False)
    st.bind()
    batches = Batches(BS, context, k)
    items = [batches.step()[0] for _ in range(ITEMS)]
    for b in items:
        b.columns, b.block_tables  # noqa: B018
    begin, finish, publish = st.begin, st.finish, st.publish
    prepare = step_inputs.prepare_verify

    def step(b: Any) -> None:
        begin()
        prepare(b)
        publish(DECODE_STEP)
        finish()

    return step, items


def _prefill() -> tuple[Step, list[Any]]:
    """``PrefillStepInputs.prepare``: chunked prefill of 4 long prompts, 256 tokens each a
    step (``benchmarks/instructions.py``'s prefill batches), every row appending 16 pages
    of its lineage per step."""
    from instructions import PrefillChunks

    from h2d_runner_adapters import PREFILL_STEP, PrefillStepInputs, StepShape

    class Chunks(PrefillChunks):
        MAX_STEPS = ITEMS

    reqs, tokens, page = 4, 256, 16
    batches = Chunks(reqs, tokens, page)
    st = _state()
    shape = StepShape(max_reqs=reqs, max_tokens=reqs * tokens,
                      max_pages_per_req=batches.max_pages, page_size=page)
    step_inputs = PrefillStepInputs(st, shape)
    st.bind()
    items = [batches.step() for _ in range(ITEMS)]
    for b in items:
        b.columns, b.block_tables  # noqa: B018
    begin, finish, publish, prepare = st.begin, st.finish, st.publish, step_inputs.prepare

    def step(b: Any) -> None:
        begin()
        prepare(b)
        publish(PREFILL_STEP)
        finish()

    return step, items


def _v41() -> tuple[Step, list[Any]]:
    """``TokenStepInputs.prepare`` + ``V41MetadataInputs.begin_step`` at bs=64, 128K."""
    from v41_step import ENVELOPE, TOPK, WINDOW, Batches

    from h2d_runner_adapters import (
        TOKEN_INPUTS,
        V4_BLOCK,
        V41_METADATA,
        BatchColumns,
        ScheduledBatch,
        TokenStepInputs,
        V41MetadataInputs,
    )

    context = 131072
    blocks = -(-(context + 8192) // V4_BLOCK)
    st = _state()
    tokens = TokenStepInputs(st, max_reqs=BS, max_tokens=BS)
    v4 = V41MetadataInputs(st, max_reqs=BS, max_tokens=BS, max_blocks_per_req=blocks,
                           dummy_state_slot=BS, dummy_block=0, window=WINDOW,
                           index_topk=TOPK, fp8=True, envelope_rows=ENVELOPE,
                           fuse_step_indptrs=False)
    st.bind()
    n = BS
    columns = BatchColumns(
        query_lens=np.ones(n, np.int32), context_lens=np.full(n, context, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
        token_ids=np.zeros(n, np.int32), num_drafts=np.zeros(n, np.int32))
    batch = ScheduledBatch((), False, V4_BLOCK, given_columns=columns)
    batches = Batches(BS, context)
    items = [batches.step()[:2] for _ in range(ITEMS)]
    begin, finish, publish = st.begin, st.finish, st.publish
    prepare, begin_step = tokens.prepare, v4.begin_step

    def step(item: Any) -> None:
        spans, rows = item
        begin()
        prepare(batch)
        begin_step(spans, block_tables=rows)
        publish(TOKEN_INPUTS)
        publish(V41_METADATA)
        finish()

    return step, items


def _left(what: str) -> Any:
    return pytest.mark.xfail(strict=True, reason=f"still allocates per step: {what}")


FAMILIES = [
    pytest.param(_core, id="core"),
    pytest.param(_tokens, id="tokens"),
    pytest.param(_mha, id="mha"),
    pytest.param(_mla, id="mla"),
    pytest.param(_gdn, id="gdn"),
    pytest.param(_mrope, id="mrope"),
    pytest.param(_mtp, id="mtp"),
    pytest.param(_v41, id="v41"),
    pytest.param(_prefill, id="prefill"),
]


def measure(step: Step, items: Sequence[Any]) -> tuple[int, int, list[int]]:
    """(allocated-blocks delta, gc generation-0 delta) over the second of two windows of
    ``STEPS`` steady steps after ``WARM`` (the first takes what the interpreter makes once,
    e.g. a specialization retried after its back-off: a step that keeps an object keeps
    it in both), then each of the next ``SAMPLED`` steps' tracemalloc peak rise above the
    memory traced before it."""
    for item in items[:WARM]:
        step(item)
    gc.collect()
    gc.freeze()
    try:
        for item in items[WARM:WARM + STEPS]:
            step(item)
        steady = items[WARM + STEPS:WARM + 2 * STEPS]
        blocks, count = sys.getallocatedblocks(), gc.get_count()[0]
        for item in steady:
            step(item)
        blocks, count = sys.getallocatedblocks() - blocks, gc.get_count()[0] - count
        rises = []
        tracemalloc.start(1)
        try:
            # the first step traced after tracemalloc.start() carries its own start-up
            for item in items[WARM + 2 * STEPS:WARM + 2 * STEPS + SAMPLED + 1]:
                before = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                step(item)
                rises.append(tracemalloc.get_traced_memory()[1] - before)
        finally:
            tracemalloc.stop()
    finally:
        gc.unfreeze()
    return blocks, count, rises[1:]


def _nothing(item: Any) -> None:
    pass


@pytest.mark.parametrize("build", FAMILIES)
def test_a_steady_step_allocates_nothing(build: Callable[[], tuple[Step, list[Any]]]) -> None:
    step, items = build()
    # the measurement's own objects (its ints, the loop's iterator, get_count's tuple):
    # what it reads around a step that does nothing
    base_blocks, base_count, _ = measure(_nothing, items)
    blocks, count, rises = measure(step, items)
    blocks, count = blocks - base_blocks, count - base_count
    assert max(rises) == 0, (f"a steady step allocated up to {max(rises)} bytes transiently "
                             f"(per sampled step: {rises[:10]} ...)")
    # A step that keeps an object keeps STEPS of them; the interpreter's own one-off moves
    # inside a window (seen on CPython 3.12: one block or gc object either way) stay
    # within NOISE. (A freed block, e.g. one an earlier test left, reads negative.)
    assert blocks <= NOISE, f"{blocks} memory blocks kept over {STEPS} steady steps"
    assert abs(count) <= NOISE, f"{count} gc-tracked objects kept over {STEPS} steady steps"
