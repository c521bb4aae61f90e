"""The spans of a DeepSeek-V4/V4.1 step: :class:`RequestSpan`, :class:`SpanColumns` and
their checks (every field an int in int32 range, at least its lowest value), before the
``v41_metadata`` producers write anything."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NoReturn

import numpy as np

from h2d_core import DeclarationError, describe_value

from ..checks import INT32_MAX, INT32_MIN, AdapterInputError, check_size

V41_METADATA = "v41_metadata"


@dataclass(frozen=True)
class RequestSpan:
    """One request's interval in a V4.1 step and its state slot; nothing about its pages
    (they arrive separately, as rows, in :meth:`V41MetadataInputs.begin_step`).

    ``num_tokens`` query tokens run this step, ending at ``context_len`` (the committed
    length after the step). ``fork_source`` (a physical state slot, or -1) is the slot
    whose state this step reads instead of ``state_slot``'s: the compressor rings and the
    window rows of every position before the step's first token; the step writes
    ``state_slot``. A fork carries the source's state only as far as its step rewrites it
    (each ring's last positions: ``window`` window rows, ``K`` per compression ratio): a
    prefill chunk of at least ``max(window, 128)`` tokens carries all of it, while after a
    shorter (decode) fork step the engine copies the source slot's older ring positions
    into ``state_slot`` before the next step reads them. Every field is an int in int32
    range (checked by the producers: a float or bool is refused, never truncated).
    """

    num_tokens: int
    context_len: int
    state_slot: int
    fork_source: int = -1


_SPAN_FIELDS = ("num_tokens", "context_len", "state_slot", "fork_source")
#: each field's lowest value (the highest is INT32_MAX) and what to do below it; the
#: layout pass checks the lengths again against each other (and the table's capacity)
_SPAN_LOWS = (
    (1, "a scheduled request runs >= 1 query token"),
    (1, "context_len counts the committed tokens after this step, its own included"),
    (0, "pass the request's physical state slot"),
    (-1, "pass a physical state slot, or -1 for no fork"),
)


@dataclass(frozen=True)
class SpanColumns:
    """A batch of spans as int32 columns: what a scheduler that keeps arrays passes.

    Each column is a 1-D C-contiguous int32 numpy array with one entry per request;
    ``state_slots_in`` is the slot each request reads (its fork source, else its own slot).
    The producers check them whole (dtypes, lengths, slots) before writing anything.
    """

    query_lens: np.ndarray
    context_lens: np.ndarray
    state_slots_out: np.ndarray
    state_slots_in: np.ndarray

    @classmethod
    def from_spans(cls, spans: Sequence[RequestSpan], *, group: str = V41_METADATA
                   ) -> SpanColumns:
        """The columns of ``spans``. Every field must be an int (or numpy integer) in
        int32 range, at least its lowest value (``num_tokens`` and ``context_len`` 1,
        ``state_slot`` 0, ``fork_source`` -1); raises :class:`AdapterInputError` naming
        ``group``, the request and the field otherwise."""
        if isinstance(spans, str | bytes) or not isinstance(spans, Sequence):
            raise AdapterInputError(
                f"{group}: spans must be a sequence of RequestSpan (or one SpanColumns), "
                f"got {describe_value(spans)}")
        kinds = set(map(type, spans))
        if kinds != {RequestSpan} and not all(issubclass(k, RequestSpan) for k in kinds):
            i = next(i for i, sp in enumerate(spans) if not isinstance(sp, RequestSpan))
            raise AdapterInputError(
                f"{group}: spans[{i}] is {describe_value(spans[i])}, not a RequestSpan; pass "
                "RequestSpan objects (or one SpanColumns)")
        fields = ([s.num_tokens for s in spans], [s.context_len for s in spans],
                  [s.state_slot for s in spans], [s.fork_source for s in spans])
        if not set(map(type, chain(*fields))) <= {int}:  # a bool or float converts silently
            fields = _exact_ints(group, fields)
        try:  # an int out of int32 range raises here, never wraps
            out = np.array(fields, dtype=np.int32).reshape(len(_SPAN_FIELDS), len(spans))
        except OverflowError:
            _refuse_field(group, fields, lambda v, low: not INT32_MIN <= v <= INT32_MAX)
        if spans and any(v < low for v, (low, _) in zip(out.min(axis=1).tolist(), _SPAN_LOWS,
                                                        strict=True)):
            _refuse_field(group, fields, lambda v, low: v < low)
        slots_in = out[3]  # the fork source where there is one, else the request's slot
        np.copyto(slots_in, out[2], where=slots_in < 0)
        return cls(query_lens=out[0], context_lens=out[1], state_slots_out=out[2],
                   state_slots_in=slots_in)


_Fields = tuple[list[Any], list[Any], list[Any], list[Any]]


def _exact_ints(group: str, fields: _Fields) -> _Fields:
    """The spans' fields as Python ints, numpy integers included; a bool, a float
    (integral or not) or anything else is refused, never truncated."""
    for i, values in enumerate(zip(*fields, strict=True)):
        for name, v in zip(_SPAN_FIELDS, values, strict=True):
            if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer):
                raise AdapterInputError(
                    f"{group}: request {i} has RequestSpan.{name}={v!r} "
                    f"({type(v).__name__}); it must be an int")
    q, c, o, f = ([int(v) for v in values] for values in fields)
    return q, c, o, f


def _refuse_field(group: str, fields: _Fields, bad: Callable[[int, int], bool]) -> NoReturn:
    """Raise for the first request's first field that ``bad`` refuses (given the value and
    the field's lowest value)."""
    for i, values in enumerate(zip(*fields, strict=True)):
        for name, v, (low, rule) in zip(_SPAN_FIELDS, values, _SPAN_LOWS, strict=True):
            if bad(v, low):
                raise AdapterInputError(
                    f"{group}: request {i} has RequestSpan.{name}={v}; it must be in "
                    f"[{low}, {INT32_MAX}]; {rule}")
    raise AssertionError(f"{group}: no field to refuse")  # the caller found one


def _check_columns(group: str, cols: SpanColumns) -> None:
    """A SpanColumns given directly: four 1-D int32 arrays of one length (the layout pass
    checks the rest before writing: C-contiguous and aligned, the lengths' values, the
    state slots, the capacity; reading ``flags`` here would build an object per step)."""
    n = cols.query_lens.size if isinstance(cols.query_lens, np.ndarray) else -1
    # one call per column, no loop: iterating the names would build an iterator per step
    _check_column(group, "query_lens", cols.query_lens, n)
    _check_column(group, "context_lens", cols.context_lens, n)
    _check_column(group, "state_slots_out", cols.state_slots_out, n)
    _check_column(group, "state_slots_in", cols.state_slots_in, n)


def _check_column(group: str, name: str, a: object, n: int) -> None:
    if type(a) is not np.ndarray or a.dtype != _INT32 or a.ndim != 1 or a.size != n:
        if isinstance(a, np.ndarray) and a.dtype == _INT32 and a.ndim == 1 and n >= 0:
            check_size(group, f"SpanColumns.{name}", a, n, "request")
        _refuse_column(group, name, a)


def _refuse_column(group: str, name: str, a: object) -> NoReturn:
    raise AdapterInputError(
        f"{group}: SpanColumns.{name} must be a 1-D C-contiguous int32 numpy array with one "
        f"entry per request, got {describe_value(a)}; build it with "
        "np.ascontiguousarray(values, dtype=np.int32) or SpanColumns.from_spans")


_INT32 = np.dtype(np.int32)


def span_columns(group: str, spans: Sequence[RequestSpan] | SpanColumns) -> SpanColumns:
    """``spans`` as int32 columns of one length (the layout checks the rest: the lengths,
    the state slots >= 0 and none the dummy slot, the arrays' layout)."""
    if isinstance(spans, SpanColumns):
        _check_columns(group, spans)
        return spans
    return SpanColumns.from_spans(spans, group=group)


def check_rows(group: str, rows: object, n: int) -> None:
    """``rows`` is a sequence of ``n`` rows (the table's snapshot checks each row, the
    dummy block included, before writing)."""
    if type(rows) is not list and type(rows) is not tuple and (
            isinstance(rows, (str, bytes)) or not isinstance(rows, (Sequence, np.ndarray))):
        raise AdapterInputError(
            f"{group}: block_tables must be a list of rows (BlockTable, 1-D integer array or "
            f"list of ints), one per span, got {describe_value(rows)}")
    if len(rows) != n:
        raise AdapterInputError(
            f"{group}: {len(rows)} block_tables rows for {n} spans; pass one row per span")


def check_dummies(group: str, dummy_state_slot: object, dummy_block: object,
                  num_blocks: int | None) -> None:
    """The padding storage is a real slot and block (of the ``num_blocks`` pool, if given)."""
    pool = INT32_MAX + 1 if num_blocks is None else num_blocks
    for name, value, hi in (("dummy_state_slot", dummy_state_slot, INT32_MAX),
                            ("dummy_block", dummy_block, pool - 1)):
        if (isinstance(value, bool) or not isinstance(value, int)
                or not 0 <= value <= hi):
            raise DeclarationError(
                f"{group}: {name} must be an int in [0, {hi}] (reserved padding storage), "
                f"got {value!r}")


#: what a real request holding the dummy state slot is told (the layout's reserved value)
DUMMY_SLOT_NOTE = ("the adapter's private dummy state slot (dummy_state_slot: padding "
                   "storage only); give the request (RequestSpan.state_slot / fork_source, "
                   "SpanColumns.state_slots_out / state_slots_in) a slot of its own")
