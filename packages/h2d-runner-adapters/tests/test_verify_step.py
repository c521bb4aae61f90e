"""``DecodeStepInputs.prepare_verify``: a speculative verify step, spec indices included, in
one compiled ``LayoutStep`` call, against hand-computed indices, the two-call way
(``prepare`` + ``tokens.prepare_spec_indices``) over random batches, and its refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    BatchColumns,
    DecodeStepInputs,
    ScheduledBatch,
    StepShape,
)
from h2d_runner_adapters.checks import AdapterInputError

POISON = 0x5A
SPEC = ("target_logits_indices", "cu_num_draft_tokens", "bonus_logits_indices")


def _state() -> tuple[H2DRunnerState, DecodeStepInputs]:
    st = H2DRunnerState("cpu", backend="packed", scatter="reference")
    step = DecodeStepInputs(st,
                            StepShape(max_reqs=4, max_tokens=16, max_pages_per_req=4, page_size=4),
                            max_drafts=3)
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(POISON)
    return st, step


def _batch(q: list[int], c: list[int], d: list[int]) -> ScheduledBatch:
    n = len(q)
    cols = BatchColumns(
        query_lens=np.array(q, np.int32), context_lens=np.array(c, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
        token_ids=np.arange(sum(q), dtype=np.int32), num_drafts=np.array(d, np.int32))
    rows = [BlockTable(range(10 * i + 1, 10 * i + 1 + -(-ci // 4))) for i, ci in enumerate(c)]
    return ScheduledBatch((), False, 4, given_columns=cols, given_block_tables=rows)


def _published(st: H2DRunnerState, step: DecodeStepInputs) -> dict[str, bytes]:
    return {k: getattr(step.tokens, k).gpu.view(torch.uint8).numpy().tobytes() for k in SPEC}


def test_verify_indices_exact_bytes_with_untouched_tails() -> None:
    st, step = _state()
    st.begin()
    plan = step.prepare_verify(_batch([3, 1, 4], [10, 5, 12], [2, 0, 3]), padded=4)
    assert plan.tokens.num_draft_tokens == 5
    st.publish(DECODE_STEP)
    st.finish()
    # starts 0, 3, 4: targets 0 1 | - | 4 5 6; bonus start + d; the inclusive draft prefix
    want = {"target_logits_indices": np.array([0, 1, 4, 5, 6], np.int64),
            "cu_num_draft_tokens": np.array([2, 2, 5], np.int32),
            "bonus_logits_indices": np.array([2, 3, 7], np.int64)}
    for name, dest in _published(st, step).items():
        head = want[name].tobytes()
        assert dest[: len(head)] == head, name
        assert dest[len(head):] == bytes([POISON]) * (len(dest) - len(head)), name


def test_verify_equals_prepare_then_spec_indices_over_random_batches() -> None:
    rng = random.Random(7)
    (a_st, a), (b_st, b) = _state(), _state()
    for _ in range(30):
        n = rng.randint(0, 4)
        q = [rng.randint(1, 4) for _ in range(n)]
        c = [qi + rng.randint(0, 16 - qi) for qi in q]
        d = [rng.randint(0, qi - 1) for qi in q]
        padded = rng.choice([None, 4])
        a_st.begin()
        pa = a.prepare(_batch(q, c, d), padded=padded)
        a.tokens.prepare_spec_indices(_batch(q, c, d))
        b_st.begin()
        pb = b.prepare_verify(_batch(q, c, d), padded=padded)
        assert pa == pb
        assert ({k: a_st.count(getattr(a.tokens, k)) for k in SPEC}
                == {k: b_st.count(getattr(b.tokens, k)) for k in SPEC})
        for st in (a_st, b_st):
            st.publish(DECODE_STEP)
            st.finish()
        assert _published(a_st, a) == _published(b_st, b)
        for name, buf in a_st.buffers().items():
            assert torch.equal(buf.gpu, b_st.buffers()[name].gpu), name


@pytest.mark.parametrize(("d", "match"), [
    ([1, 1, 0], r"request 1 verifies 1 drafts with 1 query tokens; a request verifies 0 <= "
                r"drafts < its query tokens"),
    ([0, 0, 4], r"request 2 verifies 4 drafts with 4 query tokens"),
])
def test_a_refused_verify_changes_nothing_and_a_retry_works(d: list[int], match: str) -> None:
    st, step = _state()
    st.begin()
    step.prepare_verify(_batch([3, 1, 4], [10, 5, 12], [2, 0, 3]))
    before = {name: b.source(0).clone() for name, b in st.buffers().items()}
    counts = {name: st.count(b) for name, b in st.buffers().items()}
    with pytest.raises(AdapterInputError, match=match):
        step.prepare_verify(_batch([3, 1, 4], [11, 6, 13], d),
                            h2d_reason="retry after a refusal")
    for name, b in st.buffers().items():
        assert torch.equal(b.source(0), before[name]), name
        assert st.count(b) == counts[name], name
    step.prepare_verify(_batch([3, 1, 4], [11, 6, 13], [1, 0, 1]), h2d_reason="retry")
    assert step.tokens.bonus_logits_indices.np[:3].tolist() == [1, 3, 5]
    st.publish(DECODE_STEP)
    st.finish()
