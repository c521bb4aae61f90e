"""Plain descriptions of one scheduled step, independent of any engine's classes.

A scheduler (or an engine's adapter layer) builds a :class:`ScheduledBatch` per forward
step; the runner adapters turn it into published metadata. Block tables are passed as
``block_tables.BlockTable`` (versioned: cheap incremental preparation) or as plain arrays /
lists (unversioned: compared against the snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from block_tables import BlockTable
from h2d_core import describe_value

from .checks import INT32_MAX, INT32_MIN, AdapterInputError
from .sampling.rules import TEMPERATURE, TOP_K, TOP_P, SamplingRule

#: what a request's page list may be
PageRow = BlockTable | np.ndarray | Sequence[int]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling: temperature <= 0 means greedy; -1 (or 0) / 1.0 disable top-k /
    top-p. :meth:`BatchColumns.from_requests` refuses a temperature that is not finite in
    float32, a ``top_k`` that is not an int >= -1 and a ``top_p`` outside (0, 1]."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``num_tokens`` query tokens run this step, at positions
    ``[context_len - num_tokens, context_len)``; the ``first_position`` tokens before them
    are already in the KV cache (earlier steps or a prefix-cache hit). ``token_ids`` are
    the ids staged from the host for those positions (a prefill chunk, or a decode token
    the host already knows); for a deferred decode (``prev_sample_row >= 0``) the ids come
    from row ``prev_sample_row`` of the previous step's sampled ids on the GPU, and
    ``token_ids`` holds placeholders (or is empty). ``draft_token_ids`` are speculative
    tokens to verify (they follow the first token of the span).

    :meth:`BatchColumns.from_requests` checks every field it reads (ints, not floats or
    bools, within int32; ``num_tokens >= 0``; ``context_len >= num_tokens``;
    ``prev_sample_row >= -1``; at most ``num_tokens`` staged ``token_ids``).
    """

    req_id: int
    num_tokens: int
    context_len: int
    block_table: PageRow
    sampling: SamplingParams = SamplingParams()
    token_ids: Sequence[int] = ()
    prev_sample_row: int = -1
    draft_token_ids: Sequence[int] = ()

    @property
    def first_position(self) -> int:
        return self.context_len - self.num_tokens


@dataclass(frozen=True)
class BatchColumns:
    """The batch as numpy columns (one entry per request, or per token for ``token_ids``).

    Producers read only these arrays, so a scheduler that already keeps its batch as arrays
    (a "persistent batch") can build them directly and skip per-request objects.

    Construction checks the structure once per batch (each column a 1-D numpy array of
    its dtype, one entry per request, ``token_ids`` one per query token) and raises
    :class:`~h2d_runner_adapters.checks.AdapterInputError` naming the column. The values
    (ranges, finiteness) are checked by each producer every step, before it writes.
    """

    query_lens: np.ndarray  # int32 [n]
    context_lens: np.ndarray  # int32 [n], after this step
    temperatures: np.ndarray  # float32 [n]; <= 0 means greedy
    top_k: np.ndarray  # int32 [n]; -1 = off
    top_p: np.ndarray  # float32 [n]; 1.0 = off
    prev_sample_rows: np.ndarray  # int32 [n]; -1 = ids staged from the host
    token_ids: np.ndarray  # int32 [sum(query_lens)]; placeholders where deferred
    num_drafts: np.ndarray  # int32 [n]; speculative tokens to verify per request

    def __post_init__(self) -> None:
        # once per batch, so kept to attribute reads and tuple compares (the walk over the
        # names runs only for a subclass or to word a refusal); nothing is stored, so
        # ``BatchColumns(**vars(cols))`` copies a batch
        q, c, temps, k, p = (self.query_lens, self.context_lens, self.temperatures,
                             self.top_k, self.top_p)
        prev, ids, drafts = self.prev_sample_rows, self.token_ids, self.num_drafts
        nd = np.ndarray
        if (type(q) is not nd or type(c) is not nd or type(temps) is not nd
                or type(k) is not nd or type(p) is not nd or type(prev) is not nd
                or type(ids) is not nd or type(drafts) is not nd
                or (q.dtype, c.dtype, temps.dtype, k.dtype, p.dtype, prev.dtype, ids.dtype,
                    drafts.dtype) != _DTYPES
                or not q.ndim == c.ndim == temps.ndim == k.ndim == p.ndim == prev.ndim
                == ids.ndim == drafts.ndim == 1
                or not q.size == c.size == temps.size == k.size == p.size == prev.size
                == drafts.size):
            self._check_structure()
        t = int(q.sum(dtype=np.int64))
        if ids.size != t:
            raise AdapterInputError(
                f"BatchColumns: token_ids has {ids.size} entries but query_lens sum to {t} "
                "query tokens; pass one id (or a placeholder) per query token")

    def _check_structure(self) -> None:
        """Each column a 1-D numpy array (a subclass too) of its dtype, one entry per
        request; raises the refusal of the first that is not."""
        n = -1
        for name, dtype in _COLUMN_DTYPES:
            v = getattr(self, name)
            if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype != dtype:
                what = "query token" if name == "token_ids" else "request"
                raise AdapterInputError(
                    f"BatchColumns: {name} must be a 1-D {dtype.name} numpy array with one "
                    f"entry per {what}, got {describe_value(v)}; convert it with "
                    f"np.asarray(values, np.{dtype.name}) once its values fit")
            if n < 0:
                n = v.size
            elif name != "token_ids" and v.size != n:
                raise AdapterInputError(
                    f"BatchColumns: {name} has {v.size} entries but query_lens has {n}; "
                    "pass one per request")

    @classmethod
    def from_requests(cls, requests: Sequence[ScheduledRequest]) -> BatchColumns:
        """The columns of ``requests``. Every request is checked first (ints, not floats
        or bools, within int32; ``num_tokens >= 0``; ``context_len >= num_tokens``;
        ``prev_sample_row >= -1``; at most ``num_tokens`` staged ids; finite
        temperatures, ``top_k >= -1``, ``top_p`` in (0, 1]): a bad one raises
        :class:`~h2d_runner_adapters.checks.AdapterInputError` naming its index and the
        field."""
        rows = [_request_row(i, r) for i, r in enumerate(requests)]
        q = np.array([r[0] for r in rows], np.int32).reshape(-1)
        total = int(q.sum(dtype=np.int64))
        if total > INT32_MAX:  # the query prefixes are int32
            raise AdapterInputError(
                f"{_FROM_REQUESTS}: the requests' num_tokens sum to {total}, more than an "
                "int32 query prefix holds; split the batch")
        ids = np.zeros(total, dtype=np.int32)
        pos = 0
        for r in rows:
            staged = r[6]
            ids[pos : pos + staged.size] = staged
            pos += r[0]

        def column(k: int, dtype: type) -> np.ndarray:
            return np.array([r[k] for r in rows], dtype).reshape(-1)

        return cls(
            query_lens=q,
            context_lens=column(1, np.int32),
            temperatures=column(2, np.float32),
            top_k=column(3, np.int32),
            top_p=column(4, np.float32),
            prev_sample_rows=column(5, np.int32),
            token_ids=ids,
            num_drafts=column(7, np.int32),
        )


#: BatchColumns' fields and dtypes, in the order they are checked (query_lens first: the
#: request count the others must match)
_COLUMN_DTYPES = (
    ("query_lens", np.dtype(np.int32)), ("context_lens", np.dtype(np.int32)),
    ("temperatures", np.dtype(np.float32)), ("top_k", np.dtype(np.int32)),
    ("top_p", np.dtype(np.float32)), ("prev_sample_rows", np.dtype(np.int32)),
    ("token_ids", np.dtype(np.int32)), ("num_drafts", np.dtype(np.int32)),
)
_DTYPES = tuple(dtype for _, dtype in _COLUMN_DTYPES)
_FROM_REQUESTS = "BatchColumns.from_requests"

#: one request's checked values: (num_tokens, context_len, temperature, top_k, top_p,
#: prev_sample_row, staged ids, draft count)
_Row = tuple[int, int, float, int, float, int, np.ndarray, int]


def _request_row(i: int, r: ScheduledRequest) -> _Row:
    """Request ``i``'s values for the columns, each checked."""
    q = _int_field(i, "num_tokens", r.num_tokens, 0, "the query tokens this step")
    c = _int_field(i, "context_len", r.context_len, q,
                   f"at least num_tokens={q}: it counts the tokens after this step")
    prev = _int_field(i, "prev_sample_row", r.prev_sample_row, -1,
                      "-1 stages the ids from the host")
    staged = _ids(i, "token_ids", r.token_ids)
    if staged.size > q:
        raise AdapterInputError(
            f"{_FROM_REQUESTS}: request {i} stages {staged.size} token_ids for num_tokens={q} "
            "query tokens; stage at most one id per query token")
    drafts = _ids(i, "draft_token_ids", r.draft_token_ids).size
    s = r.sampling
    temp = _sampling_field(i, TEMPERATURE, s.temperature)
    top_k = _int_field(i, f"sampling.{TOP_K.field}", s.top_k, int(TOP_K.low or 0), TOP_K.note)
    top_p = _sampling_field(i, TOP_P, s.top_p)
    return q, c, temp, top_k, top_p, prev, staged, drafts


def _sampling_field(i: int, rule: SamplingRule, value: object) -> float:
    """Request ``i``'s float sampling field under ``rule``, as given and as the float32
    its column holds."""
    x = _real_field(i, f"sampling.{rule.field}", value)
    if not rule.accepts_value(x):
        raise AdapterInputError(
            f"{_FROM_REQUESTS}: request {i} has sampling.{rule.field}={x!r}; it must be "
            f"{rule.text} as a float32 ({rule.note})")
    return x


def _int_field(i: int, field: str, value: object, lo: int, rule: str) -> int:
    """Request ``i``'s ``field`` as an int in ``[lo, INT32_MAX]``: an int or numpy
    integer, never a bool or a float."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise AdapterInputError(
            f"{_FROM_REQUESTS}: request {i} has {field}={value!r} ({type(value).__name__}); "
            f"{field} must be an int (not a float or bool)")
    v = int(value)
    if not lo <= v <= INT32_MAX:
        raise AdapterInputError(
            f"{_FROM_REQUESTS}: request {i} has {field}={v}; it must be in "
            f"[{lo}, {INT32_MAX}] ({rule})")
    return v


def _real_field(i: int, field: str, value: object) -> float:
    """Request ``i``'s ``field`` as a float: an int or float (numpy's too), not a bool."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer
                                                             | np.floating):
        raise AdapterInputError(
            f"{_FROM_REQUESTS}: request {i} has {field}={value!r} ({type(value).__name__}); "
            f"{field} must be a number")
    return float(value)


def _ids(i: int, field: str, ids: object) -> np.ndarray:
    """Request ``i``'s ``field`` (a sequence of token ids) as an int32 array: ints (not
    floats or bools) within int32."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise AdapterInputError(
                f"{_FROM_REQUESTS}: request {i} has {field} as {describe_value(ids)}; pass a 1-D "
                "integer array or a sequence of ints")
        values: Sequence[int] | np.ndarray = ids
        bounds = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    elif isinstance(ids, Sequence) and not isinstance(ids, str | bytes):
        values = ids
        if set(map(type, values)) - {int}:  # one C pass; the slow search only on a refusal
            for j, x in enumerate(values):
                if isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer):
                    raise AdapterInputError(
                        f"{_FROM_REQUESTS}: request {i} has {field}[{j}]={x!r} "
                        f"({type(x).__name__}); token ids must be ints (not floats or bools)")
        bounds = (int(min(values)), int(max(values))) if len(values) else (0, 0)
    else:
        raise AdapterInputError(
            f"{_FROM_REQUESTS}: request {i} has {field} as {describe_value(ids)}; pass a sequence "
            "of ints")
    if bounds[0] < INT32_MIN or bounds[1] > INT32_MAX:
        j = next(j for j, x in enumerate(values) if not INT32_MIN <= int(x) <= INT32_MAX)
        raise AdapterInputError(
            f"{_FROM_REQUESTS}: request {i} has {field}[{j}]={int(values[j])}; token ids "
            f"must be in [{INT32_MIN}, {INT32_MAX}]")
    return np.asarray(values, dtype=np.int32).reshape(-1)


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one forward step, in batch order."""

    requests: Sequence[ScheduledRequest]
    is_prefill: bool
    page_size: int
    #: padded (CUDA-graph) batch size for decode; None = eager, no padding
    padded_size: int | None = None
    step: int = 0
    extras: dict[str, object] = field(default_factory=dict)

    #: the same batch as columns; derived from ``requests`` when not given
    given_columns: BatchColumns | None = None
    #: page rows in batch order; derived from ``requests`` when not given
    given_block_tables: Sequence[PageRow] | None = None

    def __post_init__(self) -> None:
        if self.given_columns is not None and not isinstance(self.given_columns, BatchColumns):
            raise AdapterInputError(
                f"ScheduledBatch: given_columns must be a BatchColumns or None, got "
                f"{describe_value(self.given_columns)}; build one with BatchColumns(...)")

    @cached_property
    def columns(self) -> BatchColumns:
        if self.given_columns is not None:
            return self.given_columns
        return BatchColumns.from_requests(self.requests)

    @cached_property
    def block_tables(self) -> Sequence[PageRow]:
        if self.given_block_tables is not None:
            return self.given_block_tables
        return [r.block_table for r in self.requests]

    @property
    def num_reqs(self) -> int:
        return int(self.columns.query_lens.size)

    @property
    def num_tokens(self) -> int:
        return int(self.columns.token_ids.size)
