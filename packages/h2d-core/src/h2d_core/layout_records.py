"""What a :class:`~h2d_core.RequestLayout` is told to write: the request and token columns
it checks and copies, the compressed-KV plans, and the outputs a family registers:
:class:`RequestBound`, :class:`RampRows` and :class:`RequestValues` over
:class:`RequestSum`, and :class:`TokenPlanes`, which a family states its rules and outputs
in from its own module (GDN's state slots, Engram's cursors, MRoPE's planes); and
speculative verification's :class:`VerifyRows`, one compiled pass (stated in the generic
records it costs a verify step about a tenth more instructions).

Plain records, made once at bind: the layout (``request_layout.py``, compiled) turns them
into C state, so nothing here runs per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayoutColumn:
    """A per-request (or per-token) column :meth:`RequestLayout.write` copies into ``out``.

    ``out`` is int32, float32 or int64, 1-D C-contiguous; the batch's values fill its first
    n (or t) entries and ``pad`` its padded ones (``None``: a column without graph
    padding; its padded entries are left as they are). Without ``out`` the column is int32,
    checked and summed (:meth:`RequestLayout.column_sum`) but copied nowhere. ``minimum``
    (float32 only) clamps from below as ``np.maximum`` does (NaN is kept).

    ``low`` / ``high`` bound the values :meth:`RequestLayout.plan` accepts (``None``:
    unbounded; ``low_open`` excludes ``low`` itself); ``finite`` (float32 only) refuses
    infinities. A float32 column with any bound or ``finite`` refuses NaN too. A value
    outside is refused naming the request (or token), the column and the rule. Integer
    columns take int bounds.

    ``distinct`` (an int32 per-request column with both bounds: distinct rows) refuses a
    value an earlier request of the batch already holds, naming both requests.

    ``reserved`` (an integer column) is a value only padded entries hold, e.g. an
    engine's padding state slot (``pad``): a request (or token) holding it is refused,
    naming it, the column and ``reserved_note`` (what the value is and what to do).
    """

    name: str
    out: np.ndarray | None = None
    per_token: bool = False
    pad: float | None = 0
    minimum: float | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    finite: bool = False
    distinct: bool = False
    reserved: int | None = None
    reserved_note: str = ""


@dataclass(frozen=True)
class LayoutPlan:
    """Token rows for a compressed KV cache, written by :meth:`RequestLayout.write`.

    Each selected real token ``t`` (request ``i``, ``j``-th token of its query, position
    ``p``) gives one int32 row ``[t, i, p, window - min(j + 1, window)]`` in ``out``
    (``[capacity, 4]``), in token order. ``tail=False`` selects the tokens that close a
    block of ``ratio`` positions (``(p + 1) % ratio == 0``: the compression rows);
    ``tail=True`` the tokens among the last ``window`` positions of their context (the
    state-write rows). The published row count is the graph form, ``padded_reqs *
    ceil(q / ratio)`` or ``padded_reqs * min(q, window)`` for the widest query ``q``; the
    rows after the real ones hold -1. ``graph=False`` is the eager (prefill) form: exactly
    the real rows for a selection by ratio, the whole array for a tail selection.
    """

    name: str
    out: np.ndarray
    ratio: int
    window: int
    tail: bool = False
    graph: bool = True


@dataclass(frozen=True)
class TokenPlanes:
    """A per-token int64 output a family registers: each real token's position plus its
    request's value of ``column`` (a bound int32 per-request :class:`LayoutColumn`),
    written on ``planes`` planes at the running width (plane ``a`` is the flat range
    ``[a * padded_tokens, (a + 1) * padded_tokens)``); padding tokens hold 0 on every
    plane. ``out`` is a writeable C-contiguous int64 ``[planes * tokens]`` array.

    MRoPE's planes are one (``planes=3``, the column its per-request position deltas):
    declared beside the family's adapter (:mod:`h2d_runner_adapters.mrope`), written by
    :meth:`RequestLayout.write` in the same pass as the core outputs.
    """

    name: str
    out: np.ndarray
    column: str
    planes: int = 1


#: a :class:`RequestSum` term naming the request's query tokens (not a column)
QUERY_LENS = "query_lens"


@dataclass(frozen=True)
class OrElse:
    """A :class:`RequestSum` term's value read from ``column`` where the request's value
    is ``>= 0``, else from ``otherwise`` (both bound int32 per-request columns): "-1 =
    none" columns such as a fork source falling back to the request's own state group.
    """

    column: str
    otherwise: str

    def describe(self) -> str:
        return f"({self.column} if >= 0 else {self.otherwise})"


@dataclass(frozen=True)
class RequestSum:
    """A per-request integer: ``offset`` plus each term's coefficient times the request's
    value of the term's column (a bound int32 per-request :class:`LayoutColumn`, an
    :class:`OrElse` of two, or :data:`QUERY_LENS`: its query tokens). Computed in int64,
    so a sum never wraps.

    ``RequestSum((("cursors", 1), (QUERY_LENS, 1)))`` is ``cursors + query_lens``; a refusal
    names it that way (:meth:`describe`). The generic vocabulary a family states its rules
    and outputs in (:class:`RequestBound`, :class:`RampRows`), with no code of its own in
    h2d-core.
    """

    terms: tuple[tuple[str | OrElse, int], ...]
    offset: int = 0

    def describe(self) -> str:
        """The sum as a refusal writes it: ``"cursors + query_lens - num_drafts + 1"``."""
        parts: list[str] = []
        for term, coef in self.terms:
            col = term.describe() if isinstance(term, OrElse) else term
            mag = "" if abs(coef) == 1 else f"{abs(coef)} * "
            parts.append(f"{'-' if coef < 0 else ''}{mag}{col}" if not parts
                         else f"{'-' if coef < 0 else '+'} {mag}{col}")
        if parts and self.offset:
            parts.append(f"{'-' if self.offset < 0 else '+'} {abs(self.offset)}")
        return " ".join(parts) if parts else str(self.offset)


@dataclass(frozen=True)
class RequestBound:
    """A rule a family registers: each real request's ``value`` (a :class:`RequestSum`)
    lies in ``[low, high]`` (``None``: unbounded). :meth:`RequestLayout.plan` refuses the
    first request that breaks it, naming the request, the sum, each term's value and
    ``note`` (what the rule means, what to do), before anything is written.

    Engram's ``cursors + query_lens <= history_len`` is one
    (:mod:`h2d_runner_adapters.engram`).
    """

    value: RequestSum
    low: int | None = None
    high: int | None = None
    note: str = ""


@dataclass(frozen=True)
class RampRows:
    """An int32 output a family registers, ``width`` entries per request: request ``i``'s
    row holds ``start_i + a`` for ``a < count_i``, then ``fill``; each padded request's
    row holds ``fill`` (``start`` and ``count``: :class:`RequestSum`). ``out`` is a
    writeable C-contiguous int32 ``[requests * width]`` array. :meth:`RequestLayout.plan`
    refuses a request whose ``count`` lies outside ``[0, width]`` or whose entries leave
    int32.

    Engram's cursor candidates are one: ``start = cursors + query_lens - num_drafts``,
    ``count = num_drafts + 1`` (:mod:`h2d_runner_adapters.engram`).
    """

    name: str
    out: np.ndarray
    width: int
    start: RequestSum
    count: RequestSum
    fill: int = -1


@dataclass(frozen=True)
class RequestValues:
    """An int32 output a family registers, one entry per request: request ``i``'s
    ``value`` (a :class:`RequestSum`); padded requests hold ``fill`` (``None``: left as
    they are). ``out`` is a writeable C-contiguous int32 ``[requests]`` array.
    :meth:`RequestLayout.plan` refuses a request whose value leaves int32 (checked per
    batch only where the columns' bounds do not already keep it within).

    GDN's state indices are values: ``state_groups * (1 + k)``, and for the slot a
    request reads, ``OrElse("fork_sources", "state_groups") * (1 + k)``
    (:mod:`h2d_runner_adapters.gdn`).
    """

    name: str
    out: np.ndarray
    value: RequestSum
    fill: int | None = None


@dataclass(frozen=True)
class VerifyRows:
    """Speculative verification's rows, registered as a layout output: ``drafts`` names a
    bound int32 request column of draft counts ``d``. :meth:`RequestLayout.plan` refuses
    ``d < 0``, ``d >= q`` (a request's last token is its bonus row) and more drafts in all
    than ``targets`` holds; :meth:`RequestLayout.write` fills ``targets`` int64 (request
    ``r``'s target rows ``cu[r] .. cu[r] + d_r - 1``, the drafts back to back), ``prefix``
    int32 (the inclusive prefix of ``d``) and ``bonus`` int64 (``cu[r] + d_r``), real
    requests only (``cu``: the query prefix). One per layout.

    The fused decode step's verify path declares it (:mod:`h2d_runner_adapters.decode_step`).
    """

    drafts: str
    targets: np.ndarray
    prefix: np.ndarray
    bonus: np.ndarray


#: the outputs a family registers with a layout (``RequestLayout(..., outputs=[...])``)
LayoutOutput = TokenPlanes | RequestBound | RampRows | RequestValues | VerifyRows
