"""The Quickstart's step fed what a first hour on a fresh clone gets wrong: each refused
with a specific error naming the offender and the rule, nothing changed (sources,
destinations, counts, revisions, published sets), and the corrected call publishes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from adapter_helpers import need_kernels
from bad_inputs import Observed, refuse

from block_tables import BlockTable, PageIdRangeError
from h2d_core import H2DRunnerState, MembershipError
from h2d_runner_adapters import (
    DECODE_STEP,
    AdapterInputError,
    DecodeStepInputs,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
    StepShape,
)

PAGE = 16


def _step(device: str, num_pages: int | None = None,
          **kw: Any) -> tuple[H2DRunnerState, DecodeStepInputs]:
    need_kernels(device)
    state = H2DRunnerState(device, num_slots=2)
    shape = StepShape(max_reqs=4, max_tokens=4, max_pages_per_req=8, page_size=PAGE,
                      num_pages=num_pages)
    step = DecodeStepInputs(state, shape, **kw)
    state.bind()
    return state, step


def _batch(first: Any = (3, 7), *, page_size: int = PAGE, prev: int = -1) -> ScheduledBatch:
    return ScheduledBatch([
        ScheduledRequest(0, 1, 20, BlockTable(list(first)), SamplingParams(0.0),
                         token_ids=[11]),
        ScheduledRequest(1, 1, 9, BlockTable([5]), SamplingParams(0.0), token_ids=[12],
                         prev_sample_row=prev),
    ], is_prefill=False, page_size=page_size)


def _seen(state: H2DRunnerState, step: DecodeStepInputs) -> Observed:
    return Observed(state, extra=lambda: (step.decode.tables.prepared_revision,
                                          [s.revision for s in step.decode.tables.snapshots]),
                    groups=(DECODE_STEP,))


def _publish_good(state: H2DRunnerState, step: DecodeStepInputs) -> None:
    plan = step.prepare(_batch(), padded=4)
    state.publish(DECODE_STEP)
    state.finish()
    assert step.decode.slot_mapping.gpu[:4].tolist() == [115, 88, -1, -1]
    assert step.decode.generate_kv_indices(plan.decode)[:3].tolist() == [3, 7, 5]


# -- 1. negative or out-of-pool page IDs ---------------------------------------------------

@pytest.mark.parametrize("num_pages", [None, 64])
def test_a_negative_page_id_is_refused_with_or_without_num_pages(
        device: str, num_pages: int | None) -> None:
    state, step = _step(device, num_pages=num_pages)
    state.begin()
    rule = ("is negative; page IDs are >= 0" if num_pages is None
            else r"is outside \[0, pool_limit=64\)")
    refuse(_seen(state, step), lambda: step.prepare(_batch((-1, 7)), padded=4),
           PageIdRangeError, rf"row 0: page ID -1 at column 0 {rule}")
    _publish_good(state, step)


def test_an_appended_negative_page_id_is_refused(device: str) -> None:
    """The steady step (one page appended, the compiled path) checks the lower bound."""
    state, step = _step(device)
    state.begin()
    _publish_good(state, step)
    batch = _batch()
    table = batch.block_tables[0]
    state.begin()
    step.prepare(batch, padded=4)  # the rows the snapshot now holds
    state.publish(DECODE_STEP)
    state.finish()
    assert isinstance(table, BlockTable)
    table.append_one(-1)
    grown = ScheduledBatch([
        ScheduledRequest(0, 1, 33, table, SamplingParams(0.0), token_ids=[11]),
        ScheduledRequest(1, 1, 10, batch.block_tables[1], SamplingParams(0.0),
                         token_ids=[12])], is_prefill=False, page_size=PAGE)
    state.begin()
    refuse(_seen(state, step), lambda: step.prepare(grown, padded=4), PageIdRangeError,
           r"row 0: (appended )?page ID -1 at column 2 is negative")
    table.truncate(2)
    table.append_one(9)
    step.prepare(grown, padded=4)
    state.publish(DECODE_STEP)
    state.finish()
    assert step.decode.block_tables.gpu[0, :3].tolist() == [3, 7, 9]


def test_a_page_id_past_num_pages_is_refused(device: str) -> None:
    state, step = _step(device, num_pages=8)
    state.begin()
    refuse(_seen(state, step), lambda: step.prepare(_batch((3, 8)), padded=4),
           PageIdRangeError, r"row 0: page ID 8 at column 1 is outside \[0, pool_limit=8\)")
    _publish_good(state, step)


# -- 3. the batch's page size ----------------------------------------------------------------

def test_a_batch_of_another_page_size_is_refused_naming_both(device: str) -> None:
    state, step = _step(device)
    state.begin()
    refuse(_seen(state, step), lambda: step.prepare(_batch(page_size=32), padded=4),
           AdapterInputError, r"decode_step: the batch has page_size=32 but the adapter was "
           r"built with page_size=16; KV slots .* schedule the batch with the adapter's")
    refuse(_seen(state, step), lambda: step.decode.prepare(_batch(page_size=32), padded=4),
           AdapterInputError, r"mha_decode: the batch has page_size=32 .* page_size=16")
    _publish_good(state, step)


def test_a_prefill_chunk_of_another_page_size_is_refused(device: str) -> None:
    from h2d_runner_adapters import PrefillStepInputs
    need_kernels(device)
    state = H2DRunnerState(device, num_slots=1)
    step = PrefillStepInputs(state,
                             StepShape(max_reqs=2, max_tokens=32, max_pages_per_req=4,
                                       page_size=PAGE, num_pages=64))
    state.bind()
    chunk = [ScheduledRequest(0, 3, 3, BlockTable([4]), token_ids=[1, 2, 3])]
    state.begin()
    refuse(Observed(state, groups=(step.group,)),
           lambda: step.prepare(ScheduledBatch(chunk, is_prefill=True, page_size=8)),
           AdapterInputError, rf"{step.group}: the batch has page_size=8 but the adapter was "
           r"built with page_size=16")
    plan = step.prepare(ScheduledBatch(chunk, is_prefill=True, page_size=PAGE))
    state.publish(step.group)
    state.finish()
    assert step.prefill.slot_mapping.gpu[:3].tolist() == [64, 65, 66]
    # 5. its first consumer takes the step plan, its .prefill, or refuses by name
    for given in (plan, plan.prefill):
        assert step.prepare_attention(given)[:1].tolist() == [4]  # type: ignore[arg-type]
        assert step.prefill.prepare_attention(given)[:1].tolist() == [4]  # type: ignore[arg-type]
    with pytest.raises(AdapterInputError, match=rf"{step.group}: prepare_attention takes the "
                       r"PrefillPlan of a step .* got TokenPlan"):
        step.prepare_attention(plan.tokens)  # type: ignore[arg-type]


# -- 5. the step's plan where a consumer takes its sub-plan --------------------------------

def test_first_consumers_take_the_step_plan_or_refuse_by_name(device: str) -> None:
    state, step = _step(device)
    state.begin()
    plan = step.prepare(_batch(prev=0), padded=4)
    state.publish(DECODE_STEP)
    state.finish()
    # the step plan is read through its sub-plan: the same result as the sub-plan's
    assert step.decode.generate_kv_indices(plan)[:3].tolist() == [3, 7, 5]
    assert step.decode.generate_kv_indices(plan.decode)[:3].tolist() == [3, 7, 5]
    prev = torch.tensor([[42]], dtype=torch.int32, device=device)
    assert step.tokens.assemble(plan, prev).tolist()[:2] == [11, 42]
    assert step.tokens.assemble(plan.tokens, prev).tolist()[:2] == [11, 42]
    logits = torch.zeros(2, 8, device=device)
    logits[0, 3] = logits[1, 5] = 1.0
    noise = torch.ones(2, 8, device=device)
    assert step.sampling.sample(logits, plan, noise).tolist() == [3, 5]
    # anything else: a library error naming the group, the consumer and what to pass
    before = step.decode.kv_indices.clone()
    with pytest.raises(AdapterInputError, match=r"mha_decode: generate_kv_indices takes the "
                       r"DecodePlan of a step .* got TokenPlan; pass what prepare\(\) "
                       r"returned, or its \.decode"):
        step.decode.generate_kv_indices(plan.tokens)  # type: ignore[arg-type]
    assert torch.equal(step.decode.kv_indices, before)
    with pytest.raises(AdapterInputError, match=r"token_ids: assemble takes the TokenPlan"):
        step.tokens.assemble(plan.decode, prev)  # type: ignore[arg-type]
    with pytest.raises(AdapterInputError, match=r"sampling: sample takes the SamplingPlan"):
        step.sampling.sample(logits, plan.decode, noise)  # type: ignore[arg-type]


# -- 6. a sub-group of the step's combined group --------------------------------------------

def test_publishing_the_decode_sub_group_of_a_produced_step_is_refused(device: str) -> None:
    """``step.prepare`` wrote the whole ``decode_step`` group; ``mha_decode`` alone would
    send the KV metadata and leave the token group behind."""
    state, step = _step(device)
    state.begin()
    plan = step.prepare(_batch(), padded=4)
    seen = Observed(state, extra=lambda: step.decode.tables.published,
                    groups=(DECODE_STEP, "mha_decode", "token_ids"))
    refuse(seen, lambda: state.publish("mha_decode"), MembershipError,
           r"group 'mha_decode' is covered by the combined group 'decode_step', whose "
           r"producer groups \['query_prefix', 'sampling', 'token_ids'\] were produced .* "
           r"publish 'decode_step'")
    state.publish(DECODE_STEP)
    state.finish()
    assert step.decode.generate_kv_indices(plan)[:3].tolist() == [3, 7, 5]
    assert state.counters(DECODE_STEP).dmas == 1


# -- 4. a deferred token's row outside prev_sampled --------------------------------------------

@pytest.mark.parametrize("prev_rows, bad", [(None, 4), (None, 9), (2, 2)])
def test_a_deferred_row_past_prev_rows_is_refused_by_the_producer(
        device: str, prev_rows: int | None, bad: int) -> None:
    """``prev_rows`` (default ``max_reqs`` = 4) bounds ``prev_sample_row``, checked with the
    batch before any write."""
    state, step = _step(device, prev_rows=prev_rows)
    rows = 4 if prev_rows is None else prev_rows
    state.begin()
    refuse(_seen(state, step), lambda: step.prepare(_batch(prev=bad), padded=4),
           AdapterInputError, rf"decode_step: request 1 has prev_sample_rows={bad}; "
           rf"prev_sample_rows must be in \[-1, {rows - 1}\]")
    plan = step.prepare(_batch(prev=rows - 1), padded=4)
    state.publish(DECODE_STEP)
    state.finish()
    prev = torch.arange(rows, dtype=torch.int32, device=device).reshape(rows, 1) + 40
    assert step.tokens.assemble(plan, prev).tolist()[:2] == [11, 40 + rows - 1]


def test_assemble_refuses_a_prev_sampled_the_deferred_row_lies_past(device: str) -> None:
    """A prev_sampled smaller than prev_rows (the previous step's exact tensor): the kernel
    would keep the placeholder (id 12 here) for a row past it. Refused before the launch,
    naming the request, its row and the tensor's rows; input_ids unchanged."""
    state, step = _step(device)
    state.begin()
    plan = step.prepare(_batch(prev=2), padded=4)
    state.publish(DECODE_STEP)
    before = step.tokens.input_ids.gpu.clone()
    small = torch.tensor([[40], [41]], dtype=torch.int32, device=device)
    with pytest.raises(AdapterInputError, match=r"token_ids: assemble: request 1 has "
                       r"prev_sample_row=2 but prev_sampled has 2 rows; .* pass that step's "
                       r"whole sampled-token tensor"):
        step.tokens.assemble(plan, small)
    assert torch.equal(step.tokens.input_ids.gpu, before)
    state.finish()
    whole = torch.tensor([[40], [41], [42]], dtype=torch.int32, device=device)
    assert step.tokens.assemble(plan, whole).tolist()[:2] == [11, 42]
    state.begin()
    plan = step.prepare(_batch(prev=1), padded=4)  # a row inside the small tensor: fine
    state.publish(DECODE_STEP)
    state.finish()
    assert step.tokens.assemble(plan, small).tolist()[:2] == [11, 41]


def test_the_standalone_token_producer_checks_prev_rows(device: str) -> None:
    from h2d_runner_adapters import TOKEN_IDS, TokenInputs
    need_kernels(device)
    state = H2DRunnerState(device, num_slots=1)
    tokens = TokenInputs(state, max_reqs=4, max_tokens=4, prev_rows=3)
    state.bind()
    state.begin()
    refuse(Observed(state, groups=(TOKEN_IDS,)), lambda: tokens.prepare_ids(_batch(prev=3)),
           AdapterInputError, r"token_ids: request 1 has prev_sample_rows=3; prev_sample_rows "
           r"must be in \[-1, 3\) .* prev_rows")
    tokens.prepare_ids(_batch(prev=2))
    state.publish(TOKEN_IDS)
    state.finish()
    assert tokens.decode_src.gpu[:2].tolist() == [-1, 2]
