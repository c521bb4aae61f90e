"""Rules of the token producers that only a dedicated test notices losing.

* The speculative-indices cache (``TokenInputs.prepare_spec_indices`` keeps, per slot, the
  batch key of the indices its sources hold) is keyed by the query lengths AND the draft
  counts: the same query lengths with other draft counts on the same slot are new indices.
* ``@h2d_producer`` in front of ``TokenInputs.prepare_ids``, ``prepare_query_prefix``,
  ``prepare_spec_indices`` and ``MhaDecodeInputs.prepare``: outside an epoch (never begun,
  or after ``finish()``: the slot's DMA may still be reading its sources), from another
  thread, and on reentry (before or after the group's publication) the producer never
  runs (it never reads the batch), so every source, count and destination stays as it
  was, and what the first call wrote is what gets published. Without the decorator these
  calls would write the sources before ``set_count`` refused them, or (the decode table's
  own state checks the epoch and thread too) fail later, inside the producer.

CPU, the reference scatter; destinations are checked against hand-written values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from bad_inputs import Observed, refuse

from block_tables import BlockTable
from h2d_core import EpochError, H2DRunnerState, OwnerThreadError, ReentryError
from h2d_runner_adapters import (
    MHA_DECODE,
    QUERY_PREFIX,
    SPEC_INDICES,
    TOKEN_IDS,
    TOKEN_INPUTS,
    BatchColumns,
    MhaDecodeInputs,
    ScheduledBatch,
    StepShape,
    TokenInputs,
)

PAGE = 4
POISON = 0x5A


@dataclass(frozen=True)
class Tracked(ScheduledBatch):
    """A batch that records each read of its columns: a producer that was never entered
    never read them."""

    reads: list[str] = field(default_factory=list)

    @property
    def columns(self) -> BatchColumns:
        self.reads.append("columns")
        assert self.given_columns is not None
        return self.given_columns


def make_batch(q: list[int], ctx: list[int], ids: list[int], prev: list[int],
               drafts: list[int], rows: list[list[int]]) -> Tracked:
    n = len(q)
    cols = BatchColumns(
        query_lens=np.asarray(q, np.int32), context_lens=np.asarray(ctx, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.asarray(prev, np.int32),
        token_ids=np.asarray(ids, np.int32), num_drafts=np.asarray(drafts, np.int32))
    return Tracked((), False, PAGE, given_columns=cols,
                   given_block_tables=[BlockTable(r) for r in rows])


def batch_a() -> Tracked:
    return make_batch([2, 1], [6, 5], [31, 32, 33], [-1, 1], [1, 0], [[3, 7], [8, 9]])


def batch_b() -> Tracked:
    return make_batch([1, 1], [9, 4], [41, 42], [0, -1], [0, 0], [[1, 2, 5], [4]])


#: what each producer publishes for batch_a (eager)
WANT_A: dict[str, dict[str, list[Any]]] = {
    "prepare_ids": {"input_ids": [31, 32, 33], "decode_cu": [0, 2, 3],
                    "decode_src": [-1, 1]},
    "prepare_query_prefix": {"cu_seqlens_q": [0, 2, 3]},
    # starts [0, 2], drafts [1, 0]: request 0 verifies row 0, its bonus row is 1
    "prepare_spec_indices": {"target_logits_indices": [0], "cu_num_draft_tokens": [1, 1],
                             "bonus_logits_indices": [1, 2]},
    # ctx 6 (q 2) on pages [3, 7] and ctx 5 (q 1) on [8, 9]: positions 4, 5 | 4
    "MhaDecodeInputs.prepare": {"positions": [4, 5, 4], "slot_mapping": [28, 29, 36],
                                "context_lens": [6, 5], "kv_indptr": [0, 2, 4],
                                "block_tables": [[3, 7, 0, 0], [8, 9, 0, 0]]},
}


@dataclass
class Env:
    state: H2DRunnerState
    tokens: TokenInputs
    decode: MhaDecodeInputs


def build() -> Env:
    st = H2DRunnerState("cpu", scatter="reference")
    tokens = TokenInputs(st, max_reqs=4, max_tokens=8, max_drafts=2)
    decode = MhaDecodeInputs(st,
                             StepShape(max_reqs=4, max_tokens=8, max_pages_per_req=4,
                                       page_size=PAGE, num_pages=64))
    st.combine(TOKEN_INPUTS, [TOKEN_IDS, QUERY_PREFIX, SPEC_INDICES])
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(POISON)
    return Env(st, tokens, decode)


#: entry point -> (call(env, batch), the group it publishes in, its producer groups)
ENTRIES: dict[str, tuple[Callable[[Env, ScheduledBatch], object], str, str]] = {
    "prepare_ids": (lambda e, b: e.tokens.prepare_ids(b), TOKEN_INPUTS, TOKEN_IDS),
    "prepare_query_prefix": (lambda e, b: e.tokens.prepare_query_prefix(b), TOKEN_INPUTS,
                             QUERY_PREFIX),
    "prepare_spec_indices": (lambda e, b: e.tokens.prepare_spec_indices(b), TOKEN_INPUTS,
                             SPEC_INDICES),
    "MhaDecodeInputs.prepare": (lambda e, b: e.decode.prepare(b), MHA_DECODE, MHA_DECODE),
}


def observed(env: Env, group: str) -> Observed:
    tables = env.decode.tables
    return Observed(env.state, groups=(group,), extra=lambda: (
        list(env.tokens.spec_written), tables.snapshot.revision, tables.prepared_revision))


def check_published(env: Env, want: dict[str, list[Any]]) -> None:
    bufs = env.state.buffers()
    for name, values in want.items():
        gpu = bufs[name].gpu
        expect = np.asarray(values, gpu.cpu().numpy().dtype)
        got = gpu.cpu().numpy()[: len(expect)]
        assert got.tobytes() == expect.tobytes(), (name, got.tolist(), values)


# ----------------------------------------------------------- speculative-index cache
def _spec_step(env: Env, q: list[int], drafts: list[int]) -> None:
    st = env.state
    st.begin()
    n = len(q)
    b = make_batch(q, [5] * n, list(range(1, sum(q) + 1)), [-1] * n, drafts, [[1, 2]] * n)
    env.tokens.prepare_spec_indices(b)
    st.publish(TOKEN_INPUTS)
    st.finish()


def test_spec_indices_cache_key_includes_the_draft_counts() -> None:
    """Same query lengths, other draft counts, same slot: the indices are recomputed
    (a key without the draft counts would republish the first step's bytes)."""
    env = build()
    _spec_step(env, [3, 3], [2, 2])
    check_published(env, {"target_logits_indices": [0, 1, 3, 4],
                          "cu_num_draft_tokens": [2, 4], "bonus_logits_indices": [2, 5]})
    _spec_step(env, [3, 3], [1, 2])
    check_published(env, {"target_logits_indices": [0, 3, 4], "cu_num_draft_tokens": [1, 3],
                          "bonus_logits_indices": [1, 5]})
    _spec_step(env, [3, 3], [2, 2])  # and back: a hit only for the same key
    check_published(env, {"target_logits_indices": [0, 1, 3, 4],
                          "cu_num_draft_tokens": [2, 4], "bonus_logits_indices": [2, 5]})


# ------------------------------------------------------------------- @h2d_producer
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_producer_outside_an_epoch_changes_nothing(entry: str) -> None:
    call, group, producer = ENTRIES[entry]
    env = build()
    st = env.state
    never = batch_a()
    refuse(observed(env, group), lambda: call(env, never), EpochError,
           rf"producer of \['{producer}'\] outside an epoch: call begin\(\)")
    assert never.reads == [], "the producer ran outside an epoch"
    st.begin()
    call(env, batch_a())
    st.publish(group)
    st.finish()
    check_published(env, WANT_A[entry])
    # after finish() the slot's DMA may still read its sources: no producer may write them
    late = batch_b()
    refuse(observed(env, group), lambda: call(env, late), EpochError,
           rf"producer of \['{producer}'\] outside an epoch")
    assert late.reads == [], "the producer ran after finish()"
    check_published(env, WANT_A[entry])


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_producer_reentry_keeps_the_first_calls_sources(entry: str) -> None:
    call, group, producer = ENTRIES[entry]
    env = build()
    st = env.state
    st.begin()
    call(env, batch_a())
    again = batch_b()
    refuse(observed(env, group), lambda: call(env, again), ReentryError,
           rf"producer of \['{producer}'\] entered again in epoch 1 on slot 0 .*h2d_reason")
    st.publish(group)
    check_published(env, WANT_A[entry])  # the first call's bytes, not the refused one's
    # after the publication too (the group is published, its sources may be in flight)
    refuse(observed(env, group), lambda: call(env, again), ReentryError,
           r"entered again in epoch 1")
    assert again.reads == [], "a refused reentry ran the producer"
    st.finish()
    check_published(env, WANT_A[entry])


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_producer_from_another_thread_changes_nothing(entry: str) -> None:
    call, group, _ = ENTRIES[entry]
    env = build()
    st = env.state
    st.begin()
    seen = observed(env, group)
    foreign = batch_a()
    before = seen()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call(env, foreign)
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], OwnerThreadError), errors
    assert "belongs to another thread" in str(errors[0])
    assert seen() == before, "a producer called from another thread changed observed state"
    assert foreign.reads == [], "the producer ran on another thread"
    call(env, batch_a())  # the owner thread's call is the first entry of the epoch
    st.publish(group)
    st.finish()
    check_published(env, WANT_A[entry])
