"""Bad inputs to the token, sampling and fused-step adapters: a catalogue per family.

Families: ``SamplingInputs.prepare``; the separate ``TokenInputs`` producers
(``prepare_ids``, ``prepare_query_prefix``, ``prepare_spec_indices``); the fused verify
step ``DecodeStepInputs`` (with drafts, both request-layout bodies); ``TokenStepInputs``.
Each case checks both halves of a refusal with :func:`bad_inputs.refuse` (the specific
error and a message naming the request or column and the rule; nothing observable moved:
sources, destinations, counts, counters, the token inputs' speculative-index cache, the
decode table's revisions and published record, the layouts' summed columns), then a valid
retry in the same epoch publishes and its destination bytes equal a hand-written
expectation. CPU, the reference scatter.

Each case is refused after a first good step was published (epoch 1), inside epoch 2: the
sources hold that step's bytes, which a refused call must leave as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from bad_inputs import Observed, refuse

from block_tables import BlockTable, MissingPagesError
from h2d_core import CountError, H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    GREEDY_TEMPERATURE,
    QUERY_PREFIX,
    SAMPLING,
    SPEC_INDICES,
    TOKEN_IDS,
    TOKEN_INPUTS,
    BatchColumns,
    DecodeStepInputs,
    SamplingInputs,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
    StepShape,
    TokenInputs,
    TokenStepInputs,
)
from h2d_runner_adapters.checks import AdapterInputError

MAX_REQS, MAX_TOKENS, MAX_DRAFTS = 4, 12, 2
PAGE, MAX_PAGES = 4, 6
POISON = 0x5A
NAN, INF = float("nan"), float("inf")
I32 = np.iinfo(np.int32)
ROWS = [[3, 7], [8, 9], [1, 2], [4, 5]]  # page IDs of requests 0..3


# ---------------------------------------------------------------------------- batches
def columns(q: tuple[int, ...] = (1, 2), ctx: tuple[int, ...] = (5, 6), *,
            temps: tuple[float, ...] | None = None, top_k: tuple[int, ...] | None = None,
            top_p: tuple[float, ...] | None = None, prev: tuple[int, ...] | None = None,
            ids: Any = None, drafts: tuple[int, ...] | None = None) -> BatchColumns:
    """A batch of len(q) requests; the defaults are the retry batch's (valid) values."""
    n = len(q)
    ql = np.asarray(q, np.int32)

    def per_req(v: Any, default: Any, dtype: Any) -> np.ndarray:
        return np.asarray(v if v is not None else (default * n)[:n], dtype)

    return BatchColumns(
        query_lens=ql, context_lens=np.asarray(ctx, np.int32),
        temperatures=per_req(temps, (0.0, 0.7), np.float32),
        top_k=per_req(top_k, (3, -1), np.int32), top_p=per_req(top_p, (1.0, 0.5), np.float32),
        prev_sample_rows=per_req(prev, (-1, 0), np.int32),
        token_ids=np.asarray(ids if ids is not None else 11 + np.arange(int(ql.sum())),
                             np.int32),
        num_drafts=per_req(drafts, (0, 1), np.int32))


def batch(cols: BatchColumns, rows: list[Any] | None = None) -> ScheduledBatch:
    n = cols.query_lens.size
    return ScheduledBatch((), False, PAGE, given_columns=cols, given_block_tables=(
        rows if rows is not None else [BlockTable(ROWS[i % 4]) for i in range(n)]))


def wide(n: int, **kw: Any) -> BatchColumns:
    """n one-token requests (every per-request column n long)."""
    return columns((1,) * n, (5,) * n, temps=(0.7,) * n, top_k=(-1,) * n, top_p=(1.0,) * n,
                   prev=(-1,) * n, drafts=(0,) * n, **kw)


def requests(**fields: Any) -> ScheduledBatch:
    """A two-request batch of ScheduledRequest objects; ``fields`` override request 1's."""
    good = dict(num_tokens=2, context_len=6, block_table=BlockTable(ROWS[1]),
                sampling=SamplingParams(0.7, -1, 0.5), token_ids=(12, 13),
                prev_sample_row=0, draft_token_ids=(99,))
    if "sampling" in fields and isinstance(fields["sampling"], dict):
        params: dict[str, Any] = {"temperature": 0.7, "top_k": -1, "top_p": 0.5}
        fields["sampling"] = SamplingParams(**(params | fields["sampling"]))
    reqs = [ScheduledRequest(0, 1, 5, BlockTable(ROWS[0]), SamplingParams(0.0, 3, 1.0),
                             (11,)),
            ScheduledRequest(1, **(good | fields))]  # type: ignore[arg-type]
    return ScheduledBatch(reqs, False, PAGE)


# -------------------------------------------------------------------- expectations
#: the retry batch (columns() defaults, padded to 3 requests where the family pads)
GREEDY = float(np.float32(GREEDY_TEMPERATURE))
Want = dict[str, list[Any]]
RETRY_SAMPLING: Want = {"temperatures": [GREEDY, float(np.float32(0.7))],
                        "top_ks": [3, -1], "top_ps": [1.0, 0.5]}
# padded=3: three requests of the widest query (2), so 6 tokens
RETRY_TOKENS: Want = {"input_ids": [11, 12, 13, 0, 0, 0], "decode_cu": [0, 1, 3, 3],
                      "decode_src": [-1, 0, -1], "cu_seqlens_q": [0, 1, 3, 3]}
RETRY_SPEC: Want = {"target_logits_indices": [1], "cu_num_draft_tokens": [0, 1],
                    "bonus_logits_indices": [0, 2]}
# ctx 5 / 6 on pages [3, 7] / [8, 9]: the step's tokens sit on page index 1 of each row
RETRY_DECODE: Want = {
    "positions": [4, 4, 5, 0, 0, 0], "slot_mapping": [28, 36, 37, -1, -1, -1],
    "context_lens": [5, 6, 0], "kv_indptr": [0, 2, 4, 4],
    "block_tables": [[3, 7, 0, 0, 0, 0], [8, 9, 0, 0, 0, 0], [0] * 6]}


def check_destinations(buffers: dict[str, Any], want: dict[str, list[Any]]) -> None:
    """The published prefix of each named member on the device equals ``want``; the byte
    after it still holds the poison (nothing was published past the count)."""
    for name, values in want.items():
        gpu = buffers[name].gpu
        expect = np.asarray(values, gpu.cpu().numpy().dtype)
        got = gpu.cpu().numpy()[: len(expect)]
        assert got.tobytes() == expect.tobytes(), (name, got.tolist(), values)
        rest = gpu.reshape(-1).view(torch.uint8)[expect.nbytes:].cpu()
        assert (rest == POISON).all(), f"{name}: bytes past the count changed"


def poison(st: H2DRunnerState) -> None:
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(POISON)


# ------------------------------------------------------------------------ families
def first_batch() -> ScheduledBatch:
    """Epoch 1's batch: one request, every value different from the retry batch's and
    every count at most the retry's (so the retry's bytes are its own and the bytes past
    its counts still hold the poison)."""
    return batch(columns((1,), (3,), temps=(0.5,), top_k=(2,), top_p=(0.9,), prev=(1,),
                         ids=[21], drafts=(0,)), rows=[BlockTable([5])])


@dataclass
class Family:
    """A bound state, its adapters, what a refusal must not change, the producers of a
    step, and the retry batch's expectation."""

    state: H2DRunnerState
    adapters: dict[str, Any]
    seen: Observed
    produce: Callable[[ScheduledBatch, int | None], None]  # every producer, then publish
    want: dict[str, list[Any]]

    def buffers(self) -> dict[str, Any]:
        return dict(self.state.buffers())


def open_second_epoch(f: Family) -> Family:
    """Poison the destinations, publish the first batch in epoch 1, open epoch 2."""
    st = f.state
    poison(st)
    st.begin()
    f.produce(first_batch(), 2)
    st.finish()
    st.begin()
    return f


def retry_publishes(f: Family) -> None:
    """The refused producer runs again in the same epoch and publishes the retry batch
    (padded to 3 requests); its destinations hold exactly the expected bytes."""
    f.produce(batch(columns()), 3)
    f.state.finish()
    check_destinations(f.buffers(), f.want)


def sampling_family() -> Family:
    st = H2DRunnerState("cpu", scatter="reference")
    s = SamplingInputs(st, MAX_REQS)
    st.bind()

    def produce(b: ScheduledBatch, padded: int | None) -> None:
        s.prepare(b)  # the sampler's members are never padded
        st.publish(SAMPLING)

    return open_second_epoch(Family(st, {"s": s}, Observed(st, groups=(SAMPLING,)), produce,
                                    RETRY_SAMPLING))


def token_family() -> Family:
    st = H2DRunnerState("cpu", scatter="reference")
    t = TokenInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_drafts=MAX_DRAFTS)
    st.combine(TOKEN_INPUTS, [TOKEN_IDS, QUERY_PREFIX, SPEC_INDICES])
    st.bind()

    def produce(b: ScheduledBatch, padded: int | None) -> None:
        t.prepare_ids(b, padded)
        t.prepare_query_prefix(b, padded)
        t.prepare_spec_indices(b)
        st.publish(TOKEN_INPUTS)

    seen = Observed(st, extra=lambda: list(t.spec_written), groups=(TOKEN_INPUTS,))
    return open_second_epoch(Family(st, {"t": t}, seen, produce, RETRY_TOKENS | RETRY_SPEC))


def decode_family() -> Family:
    st = H2DRunnerState("cpu", scatter="reference")
    d = DecodeStepInputs(st,
                         StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                                   max_pages_per_req=MAX_PAGES, page_size=PAGE, num_pages=64),
                         max_drafts=MAX_DRAFTS)
    st.bind()

    def produce(b: ScheduledBatch, padded: int | None) -> None:
        d.prepare(b, padded)
        d.tokens.prepare_spec_indices(b)  # verification indices ride in the same DMA
        st.publish(DECODE_STEP)

    def extra() -> tuple[Any, ...]:
        tables = d.decode.tables
        rec = tables.published
        return (tables.snapshot.revision, tables.prepared_revision,
                None if rec is None else (rec.slot, rec.revision, rec.rows,
                                          rec.keys.tobytes()),
                list(d.tokens.spec_written))

    return open_second_epoch(Family(
        st, {"d": d}, Observed(st, extra=extra, groups=(DECODE_STEP,)), produce,
        RETRY_SAMPLING | RETRY_TOKENS | RETRY_SPEC | RETRY_DECODE))


def token_step_family() -> Family:
    st = H2DRunnerState("cpu", scatter="reference")
    ts = TokenStepInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS)
    st.bind()

    def produce(b: ScheduledBatch, padded: int | None) -> None:
        ts.prepare(b, padded)
        st.publish(TOKEN_INPUTS)

    return open_second_epoch(Family(st, {"ts": ts}, Observed(st, groups=(TOKEN_INPUTS,)),
                                    produce, RETRY_SAMPLING | RETRY_TOKENS))


# --------------------------------------------------------------------- catalogues
Call = Callable[[dict[str, Any]], Callable[[], object]]
Case = tuple[Call, type[Exception], str]

SAMPLING_CASES: dict[str, Case] = {
    "nan temperature": (lambda a: lambda: a["s"].prepare(batch(columns(temps=(0.5, NAN)))),
                        AdapterInputError,
                        r"^sampling: request 1 has temperatures=nan; temperatures must be "
                        r"finite$"),
    "+inf temperature": (lambda a: lambda: a["s"].prepare(batch(columns(temps=(INF, 1.0)))),
                         AdapterInputError, r"request 0 has temperatures=inf; .* finite"),
    "-inf temperature": (lambda a: lambda: a["s"].prepare(batch(columns(temps=(0, -INF)))),
                         AdapterInputError, r"request 1 has temperatures=-inf; .* finite"),
    "top_p zero": (lambda a: lambda: a["s"].prepare(batch(columns(top_p=(0.5, 0.0)))),
                   AdapterInputError, r"request 1 has top_p=0.0; top_p must be in \(0, 1\]"),
    "top_p negative zero": (lambda a: lambda: a["s"].prepare(batch(columns(top_p=(-0.0, 1)))),
                            AdapterInputError, r"request 0 has top_p=-0.0; .* in \(0, 1\]"),
    "top_p above one": (lambda a: lambda: a["s"].prepare(batch(columns(top_p=(1.5, 1.0)))),
                        AdapterInputError, r"request 0 has top_p=1.5; top_p must be in"),
    "top_p nan": (lambda a: lambda: a["s"].prepare(batch(columns(top_p=(1.0, NAN)))),
                  AdapterInputError, r"request 1 has top_p=nan; top_p must be in \(0, 1\]"),
    "top_k below -1": (lambda a: lambda: a["s"].prepare(batch(columns(top_k=(-1, -2)))),
                       AdapterInputError, r"request 1 has top_k=-2; top_k must be >= -1$"),
    "top_k int32 min": (lambda a: lambda: a["s"].prepare(batch(columns(top_k=(I32.min, 3)))),
                        AdapterInputError, r"request 0 has top_k=-2147483648; .* >= -1"),
    "more requests than max_reqs": (
        lambda a: lambda: a["s"].prepare(batch(wide(MAX_REQS + 1))), AdapterInputError,
        r"sampling: 5 requests exceed the sampling buffers' max_reqs=4"),
    "float top_k column": (
        lambda a: lambda: a["s"].prepare(batch(BatchColumns(**{
            **vars(columns()), "top_k": np.array([3.0, -1.0])}))),
        AdapterInputError, r"BatchColumns: top_k must be a 1-D int32 numpy array .* got a "
                           r"float64 array"),
    "request top_k 2.5": (lambda a: lambda: a["s"].prepare(requests(sampling={"top_k": 2.5})),
                          AdapterInputError, r"request 1 has sampling.top_k=2.5 \(float\); "
                                             r"sampling.top_k must be an int"),
    "request top_k bool": (lambda a: lambda: a["s"].prepare(requests(sampling={"top_k": True})),
                           AdapterInputError, r"request 1 has sampling.top_k=True \(bool\)"),
    "request nan temperature": (
        lambda a: lambda: a["s"].prepare(requests(sampling={"temperature": NAN})),
        AdapterInputError, r"request 1 has sampling.temperature=nan; it must be finite"),
    "request temperature past float32": (
        lambda a: lambda: a["s"].prepare(requests(sampling={"temperature": 1e39})),
        AdapterInputError, r"request 1 has sampling.temperature=1e\+39; it must be finite "
                           r"as a float32"),
    "request top_p rounding to 0": (
        lambda a: lambda: a["s"].prepare(requests(sampling={"top_p": 1e-50})),
        AdapterInputError, r"request 1 has sampling.top_p=1e-50; it must be in \(0, 1\] as "
                           r"a float32"),
    "request temperature as text": (
        lambda a: lambda: a["s"].prepare(requests(sampling={"temperature": "hot"})),
        AdapterInputError, r"request 1 has sampling.temperature='hot' \(str\); .* number"),
}

TOKEN_CASES: dict[str, Case] = {
    "ids: more requests than max_reqs": (
        lambda a: lambda: a["t"].prepare_ids(batch(wide(MAX_REQS + 1))), AdapterInputError,
        r"^token_ids: 5 requests exceed max_reqs=4; split the batch"),
    "ids: padded past max_reqs": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns()), MAX_REQS + 1),
        AdapterInputError, r"token_ids: 5 requests \(2 real, padded\) exceed max_reqs=4"),
    "ids: padded below the requests": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns()), 1), CountError,
        r"token_ids: padded=1 must be an int >= the batch's 2 requests"),
    "ids: padded as a bool": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns()), True), CountError,
        r"token_ids: padded=True must be an int"),
    "ids: more ids than max_tokens": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns((7, 6), (7, 6)))),
        AdapterInputError, r"token_ids: 13 tokens exceed max_tokens=12"),
    "ids: graph padding past max_tokens": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns((4, 1), (5, 5))), 4),
        AdapterInputError, r"token_ids: 16 tokens \(5 real, padded to 4 requests of 4\) "
                           r"exceed max_tokens=12"),
    "ids: negative query length": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns((3, -1), (5, 6)))),
        AdapterInputError, r"token_ids: request 1 has query_lens=-1; query_lens must be >= 0"),
    "ids: prev_sample_rows below -1": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns(prev=(-2, 0)))), AdapterInputError,
        r"token_ids: request 0 has prev_sample_rows=-2; prev_sample_rows must be in "
        r"\[-1, 4\) \(-1: staged from the host; else a row of the previous step's 4 "
        r"sampled rows, prev_rows\)"),
    "ids: negative draft count": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns(drafts=(0, -1)))),
        AdapterInputError, r"token_ids: request 1 has num_drafts=-1; num_drafts must be >= 0"),
    "ids: id count differs from the query tokens": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns(ids=[1, 2]))), AdapterInputError,
        r"BatchColumns: token_ids has 2 entries but query_lens sum to 3 query tokens"),
    "ids: prev_sample_rows shorter than the batch": (
        lambda a: lambda: a["t"].prepare_ids(batch(columns(prev=(-1,)))), AdapterInputError,
        r"BatchColumns: prev_sample_rows has 1 entries but query_lens has 2"),
    "ids: int64 token ids": (
        lambda a: lambda: a["t"].prepare_ids(batch(BatchColumns(**{
            **vars(columns()), "token_ids": np.array([1, 2, 2**32])}))),
        AdapterInputError, r"BatchColumns: token_ids must be a 1-D int32 numpy array with "
                           r"one entry per query token, got an int64 array"),
    "query prefix: more requests than max_reqs": (
        lambda a: lambda: a["t"].prepare_query_prefix(batch(wide(MAX_REQS + 1))),
        AdapterInputError, r"^query_prefix: 5 requests exceed max_reqs=4"),
    "query prefix: padded past max_reqs": (
        lambda a: lambda: a["t"].prepare_query_prefix(batch(columns()), 6), AdapterInputError,
        r"query_prefix: 6 requests \(2 real, padded\) exceed max_reqs=4"),
    "query prefix: negative query length": (
        lambda a: lambda: a["t"].prepare_query_prefix(batch(columns((-2, 5), (5, 6)))),
        AdapterInputError, r"query_prefix: request 0 has query_lens=-2; .* >= 0"),
    "spec: negative draft count": (
        lambda a: lambda: a["t"].prepare_spec_indices(batch(columns(drafts=(-1, 1)))),
        AdapterInputError, r"spec_indices: request 0 verifies -1 drafts with 1 query tokens"),
    "spec: drafts not below the query": (
        lambda a: lambda: a["t"].prepare_spec_indices(batch(columns(drafts=(0, 2)))),
        AdapterInputError, r"spec_indices: request 1 verifies 2 drafts with 2 query tokens; "
                           r"a request verifies 0 <= drafts < its query tokens"),
    "spec: more requests than max_reqs": (
        lambda a: lambda: a["t"].prepare_spec_indices(batch(wide(MAX_REQS + 1))),
        AdapterInputError, r"spec_indices: 5 requests with 5 draft counts; at most "
                           r"max_reqs=4"),
    "request: float num_tokens": (
        lambda a: lambda: a["t"].prepare_ids(requests(num_tokens=1.5)), AdapterInputError,
        r"BatchColumns.from_requests: request 1 has num_tokens=1.5 \(float\); num_tokens "
        r"must be an int"),
    "request: bool num_tokens": (
        lambda a: lambda: a["t"].prepare_ids(requests(num_tokens=True, token_ids=())),
        AdapterInputError, r"request 1 has num_tokens=True \(bool\)"),
    "request: context_len past int32": (
        lambda a: lambda: a["t"].prepare_ids(requests(context_len=2**31)), AdapterInputError,
        r"request 1 has context_len=2147483648; it must be in \[2, 2147483647\]"),
    "request: context_len below num_tokens": (
        lambda a: lambda: a["t"].prepare_query_prefix(requests(context_len=1)),
        AdapterInputError, r"request 1 has context_len=1; it must be in \[2, 2147483647\] "
                           r"\(at least num_tokens=2"),
    "request: float prev_sample_row": (
        lambda a: lambda: a["t"].prepare_ids(requests(prev_sample_row=0.0)), AdapterInputError,
        r"request 1 has prev_sample_row=0.0 \(float\)"),
    "request: prev_sample_row below -1": (
        lambda a: lambda: a["t"].prepare_ids(requests(prev_sample_row=-2)), AdapterInputError,
        r"request 1 has prev_sample_row=-2; it must be in \[-1, 2147483647\]"),
    "request: float token id": (
        lambda a: lambda: a["t"].prepare_ids(requests(token_ids=(12, 13.5))),
        AdapterInputError, r"request 1 has token_ids\[1\]=13.5 \(float\); token ids must be "
                           r"ints"),
    "request: token id past int32": (
        lambda a: lambda: a["t"].prepare_ids(requests(token_ids=(2**31, 1))),
        AdapterInputError, r"request 1 has token_ids\[0\]=2147483648; token ids must be in"),
    "request: more staged ids than tokens": (
        lambda a: lambda: a["t"].prepare_ids(requests(token_ids=(1, 2, 3))),
        AdapterInputError, r"request 1 stages 3 token_ids for num_tokens=2 query tokens"),
    "request: query tokens past an int32 prefix": (
        lambda a: lambda: a["t"].prepare_query_prefix(requests(
            num_tokens=I32.max, context_len=I32.max, token_ids=())),
        AdapterInputError, r"the requests' num_tokens sum to 2147483648, more than an int32 "
                           r"query prefix holds"),
    "columns not a BatchColumns": (
        lambda a: lambda: a["t"].prepare_ids(ScheduledBatch(
            (), False, PAGE, given_columns=vars(columns()))),  # type: ignore[arg-type]
        AdapterInputError, r"ScheduledBatch: given_columns must be a BatchColumns or None, "
                           r"got dict"),
    "request: bool draft id": (
        lambda a: lambda: a["t"].prepare_spec_indices(requests(draft_token_ids=(False,))),
        AdapterInputError, r"request 1 has draft_token_ids\[0\]=False \(bool\)"),
}

FUSED_CASES: dict[str, Case] = {  # DecodeStepInputs and TokenStepInputs: "{g}" = the group
    "nan temperature": (lambda a: lambda: a["f"](columns(temps=(NAN, 0.7))), AdapterInputError,
                        r"^{g}: request 0 has temperatures=nan; temperatures must be finite$"),
    "inf temperature": (lambda a: lambda: a["f"](columns(temps=(0.7, INF))), AdapterInputError,
                        r"^{g}: request 1 has temperatures=inf; temperatures must be finite$"),
    "top_p zero": (lambda a: lambda: a["f"](columns(top_p=(0.0, 0.5))), AdapterInputError,
                   r"^{g}: request 0 has top_p=0.0; top_p must be in \(0, 1\]$"),
    "top_p above one": (lambda a: lambda: a["f"](columns(top_p=(1.0, 1.0000001))),
                        AdapterInputError, r"^{g}: request 1 has top_p=1.0000001; top_p must "
                                           r"be in \(0, 1\]$"),
    "top_p nan": (lambda a: lambda: a["f"](columns(top_p=(NAN, 0.5))), AdapterInputError,
                  r"^{g}: request 0 has top_p=nan; top_p must be in \(0, 1\]$"),
    "top_k below -1": (lambda a: lambda: a["f"](columns(top_k=(3, -7))), AdapterInputError,
                       r"^{g}: request 1 has top_k=-7; top_k must be >= -1$"),
    "prev_sample_rows below -1": (lambda a: lambda: a["f"](columns(prev=(I32.min, 0))),
                                  AdapterInputError, r"^{g}: request 0 has "
                                  r"prev_sample_rows=-2147483648; prev_sample_rows must be "
                                  r"in \[-1, 3\]$"),
    "negative draft count": (lambda a: lambda: a["f"](columns(drafts=(0, -1))),
                             AdapterInputError, r"^{g}: request 1 has num_drafts=-1; "
                                                r"num_drafts must be >= 0$"),
    "zero query tokens": (lambda a: lambda: a["f"](columns((1, 0), (5, 6))), AdapterInputError,
                          r"^{g}: request 1 runs 0 query tokens; a scheduled request runs "
                          r">= 1$"),
    "context below query": (lambda a: lambda: a["f"](columns((1, 2), (5, 1))),
                            AdapterInputError, r"^{g}: request 1 has context_len 1, shorter "
                                               r"than its 2 query tokens"),
    "more requests than max_reqs": (lambda a: lambda: a["f"](wide(MAX_REQS + 1)),
                                    AdapterInputError, r"^{g}: 5 requests exceed the bound "
                                                       r"arrays' capacity of 4 requests"),
    "padded past max_reqs": (lambda a: lambda: a["f"](columns(), MAX_REQS + 1),
                             AdapterInputError, r"^{g}: 5 padded requests for 2 requests; the "
                                                r"padded count must lie in \[2, 4\]"),
    "padded below the requests": (lambda a: lambda: a["f"](columns(), 1), CountError,
                                  r"^{g}: padded=1 must be an int >= the batch's 2 requests"),
    "more tokens than max_tokens": (lambda a: lambda: a["f"](columns((7, 6), (7, 6))),
                                    AdapterInputError, r"^{g}: 13 tokens exceed the bound "
                                                       r"arrays' capacity of 12 tokens"),
    "graph padding past max_tokens": (lambda a: lambda: a["f"](columns((4, 1), (5, 5)), 4),
                                      AdapterInputError, r"^{g}: 16 padded tokens for 5 "
                                                         r"tokens; .* \[5, 12\]"),
    "request: float context_len": (lambda a: lambda: a["f"](requests(context_len=6.0)),
                                   AdapterInputError, r"request 1 has context_len=6.0 "
                                                      r"\(float\); context_len must be an int"),
    "request: top_p above one": (lambda a: lambda: a["f"](requests(sampling={"top_p": 2})),
                                 AdapterInputError, r"request 1 has sampling.top_p=2\.0; it "
                                                    r"must be in \(0, 1\]"),
}


def _fused_call(f: Family) -> Callable[..., object]:
    """``call(cols_or_batch, padded=None)`` on the family's fused producer."""
    adapter = f.adapters.get("d") or f.adapters["ts"]

    def call(what: Any, padded: int | None = None) -> object:
        return adapter.prepare(what if isinstance(what, ScheduledBatch) else batch(what),
                               padded)
    return call


# --------------------------------------------------------------------------- tests
def test_each_catalogue_holds_at_least_ten_cases() -> None:
    assert min(len(SAMPLING_CASES), len(TOKEN_CASES), len(FUSED_CASES)) >= 10


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_refuses_and_changes_nothing(case: str) -> None:
    make, error, match = SAMPLING_CASES[case]
    f = sampling_family()
    refuse(f.seen, make(f.adapters), error, match)
    retry_publishes(f)


@pytest.mark.parametrize("case", sorted(TOKEN_CASES))
def test_token_inputs_refuse_and_change_nothing(case: str) -> None:
    make, error, match = TOKEN_CASES[case]
    f = token_family()
    refuse(f.seen, make(f.adapters), error, match)
    retry_publishes(f)


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_verify_step_refuses_and_changes_nothing(case: str) -> None:
    make, error, match = FUSED_CASES[case]
    f = decode_family()
    refuse(f.seen, make({"f": _fused_call(f)}), error, match.replace("{g}", DECODE_STEP))
    retry_publishes(f)


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_token_step_refuses_and_changes_nothing(case: str) -> None:
    make, error, match = FUSED_CASES[case]
    f = token_step_family()
    refuse(f.seen, make({"f": _fused_call(f)}), error, match.replace("{g}", TOKEN_INPUTS))
    retry_publishes(f)


def test_fused_step_missing_pages_change_nothing() -> None:
    """The block-table rows are validated before any write too (after the columns)."""
    f = decode_family()
    short = batch(columns((1, 2), (5, 9)), rows=[BlockTable(ROWS[0]), BlockTable(ROWS[1])])
    refuse(f.seen, lambda: f.adapters["d"].prepare(short), MissingPagesError,
           r"row 1: the request span needs 3 pages but the row holds 2")
    retry_publishes(f)


def test_retry_batch_from_requests_publishes_the_same_bytes() -> None:
    """The object path builds the retry batch's columns exactly (its staged ids, draft
    count and sampling), so a retry given as ScheduledRequests publishes the same bytes."""
    f = sampling_family()
    cols = requests().columns
    want = columns()
    for name in ("query_lens", "context_lens", "temperatures", "top_k", "top_p",
                 "prev_sample_rows", "token_ids", "num_drafts"):
        got, exp = getattr(cols, name), getattr(want, name)
        assert got.dtype == exp.dtype and got.tobytes() == exp.tobytes(), name
    f.adapters["s"].prepare(requests())
    f.state.publish(SAMPLING)
    f.state.finish()
    check_destinations(f.buffers(), RETRY_SAMPLING)


def test_token_step_tokens_stop_at_max_tokens_not_the_shift_entry() -> None:
    """input_ids holds max_tokens + 1 entries (the draft gather's shift); a step of
    max_tokens + 1 tokens is refused like the separate producer and the decode step
    refuse it, and changes nothing."""
    f = token_step_family()
    q = (7, 6)  # 13 = MAX_TOKENS + 1
    refuse(f.seen, lambda: f.adapters["ts"].prepare(batch(columns(q, q))), AdapterInputError,
           r"token_inputs: 13 tokens exceed the bound arrays' capacity of 12 tokens")
    full = columns((6, 6), (6, 6))  # exactly max_tokens
    plan = f.adapters["ts"].prepare(batch(full))
    assert plan.tokens.padded_tokens == MAX_TOKENS
    f.state.publish(TOKEN_INPUTS)
    f.state.finish()
    check_destinations(f.buffers(), {"input_ids": list(range(11, 23)),
                                     "cu_seqlens_q": [0, 6, 12]})
