"""The Quickstart's step fed what a first hour on a fresh clone gets wrong: each refused
with a specific error naming the offender and the rule, nothing changed (sources,
destinations, counts, revisions, published sets), and the corrected call publishes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from adapter_helpers import need_kernels
from bad_inputs import Observed, refuse

from block_tables import BlockTable, PageIdRangeError
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    DecodeStepInputs,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
)

PAGE = 16


def _step(device: str, **kw: Any) -> tuple[H2DRunnerState, DecodeStepInputs]:
    need_kernels(device)
    state = H2DRunnerState(device, num_slots=2)
    step = DecodeStepInputs(state, max_reqs=4, max_tokens=4, max_pages_per_req=8,
                            page_size=PAGE, **kw)
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
