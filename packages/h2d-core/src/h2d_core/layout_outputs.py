"""The outputs a family registers on a :class:`~h2d_core.RequestLayout`, bound.

A family declares its outputs as records (:mod:`h2d_core.layout_records`: MRoPE's
:class:`TokenPlanes`, GDN's :class:`StateSlots`, Engram's :class:`Cursors`, speculative
verification's :class:`VerifyRows`). At bind, :mod:`h2d_core.layout_binding` checks each
record and makes one of the objects below; per step the layout calls, through C, each
object's ``check`` in :meth:`~h2d_core.RequestLayout.plan` (before anything is written)
and its ``write`` in :meth:`~h2d_core.RequestLayout.write`. Each reads the request
columns it names from the batch's column values, by their bound index.

Written in Cython's pure-Python mode and compiled as ``h2d_core._layout_outputs_native``
(the fields and methods are declared in ``_layout_outputs_native.pxd``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import RequestLayoutError

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:
    from cython.cimports.h2d_core._layout_columns_native import int_data, long_data


@cython.cclass
class BoundOutput:
    """A registered output: ``check`` refuses a bad batch (nothing written yet), ``write``
    fills the output for the planned batch, padding included."""

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              n: cython.Py_ssize_t) -> cython.int:
        return 0

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        return 0


@cython.cclass
class TokenPlanesOutput(BoundOutput):
    """:class:`TokenPlanes`: position + the request's column value per token, 0 for
    padding tokens, on every plane at stride ``padded_tokens``."""

    def __init__(self, out: Any, column: int, planes: int) -> None:
        self.out = out
        self.column = column
        self.planes = planes

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        out: cython.pointer[cython.longlong] = long_data(self.out)
        col: cython.pointer[cython.int] = int_data(values[self.column])
        i: cython.Py_ssize_t
        j: cython.Py_ssize_t
        a: cython.Py_ssize_t
        k: cython.Py_ssize_t = 0
        q: cython.longlong
        c: cython.longlong
        for i in range(n):
            q = cython.cast(cython.longlong, own_q[i])
            c = cython.cast(cython.longlong, own_c[i])
            for j in range(q):
                out[k] = c - q + j + col[i]
                k += 1
        for k in range(t, pt):
            out[k] = 0
        for a in range(1, self.planes):
            for k in range(pt):
                out[a * pt + k] = out[k]
        return 0


@cython.cclass
class StateSlotsOutput(BoundOutput):
    """:class:`StateSlots`: each request's state slots from its group (and fork) column;
    -1 for padded requests."""

    def __init__(self, groups: int, forks: int, slots_per_group: int, base: Any, read: Any,
                 rows: Any) -> None:
        self.groups = groups
        self.forks = forks
        self.slots_per_group = slots_per_group
        self.base = base
        self.read = read
        self.rows = rows

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        groups: cython.pointer[cython.int] = int_data(values[self.groups])
        k1: cython.int = self.slots_per_group
        i: cython.Py_ssize_t
        j: cython.Py_ssize_t
        out: cython.pointer[cython.int]
        if self.base is not None:
            out = int_data(self.base)
            for i in range(n):
                out[i] = groups[i] * k1
            for i in range(n, p):
                out[i] = -1
        if self.read is not None:
            forks: cython.pointer[cython.int] = int_data(values[self.forks])
            out = int_data(self.read)
            for i in range(n):
                out[i] = (forks[i] if forks[i] >= 0 else groups[i]) * k1
            for i in range(n, p):
                out[i] = -1
        if self.rows is not None:
            out = int_data(self.rows)
            for i in range(n):
                for j in range(k1):
                    out[i * k1 + j] = groups[i] * k1 + cython.cast(cython.int, j)
            for i in range(n * k1, p * k1):
                out[i] = -1
        return 0


@cython.cclass
class VerifyRowsOutput(BoundOutput):
    """:class:`VerifyRows`: each request's draft rows (``targets``), its drafts' prefix and
    its bonus row, from its draft count."""

    def __init__(self, drafts: int, targets: Any, prefix: Any, bonus: Any) -> None:
        self.drafts = drafts
        self.targets = targets
        self.prefix = prefix
        self.bonus = bonus
        self.capacity = targets.shape[0]

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              n: cython.Py_ssize_t) -> cython.int:
        """Refuse a request verifying ``d < 0`` or ``d >= q`` drafts, or more drafts in all
        than the targets hold."""
        dv: cython.pointer[cython.int] = int_data(values[self.drafts])
        i: cython.Py_ssize_t
        total: cython.longlong = 0
        for i in range(n):
            if dv[i] < 0 or dv[i] >= qv[i]:
                raise RequestLayoutError(
                    f"{name}: request {i} verifies {dv[i]} drafts with {qv[i]} query tokens; "
                    "a request verifies 0 <= drafts < its query tokens (the last token is the "
                    "bonus row)")
            total += dv[i]
        if total > self.capacity:
            raise RequestLayoutError(
                f"{name}: {total} draft tokens exceed draft_targets' capacity "
                f"{self.capacity} (max_reqs * max_drafts); raise max_drafts")
        return 0

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        dv: cython.pointer[cython.int] = int_data(values[self.drafts])
        targets: cython.pointer[cython.longlong] = long_data(self.targets)
        dpre: cython.pointer[cython.int] = int_data(self.prefix)
        bonus: cython.pointer[cython.longlong] = long_data(self.bonus)
        start: cython.longlong = 0
        dsum: cython.longlong = 0
        m: cython.Py_ssize_t = 0
        d: cython.longlong
        i: cython.Py_ssize_t
        j: cython.Py_ssize_t
        for i in range(n):  # the drafts, then the bonus row
            d = dv[i]
            for j in range(d):
                targets[m] = start + j
                m += 1
            dsum += d
            dpre[i] = cython.cast(cython.int, dsum)
            bonus[i] = start + d
            start += own_q[i]
        return 0


@cython.cclass
class CursorsOutput(BoundOutput):
    """:class:`Cursors`: each request's cursor checked against ``limit``; with drafts, its
    candidate rows (``width`` per request, -1 past its drafts and for padding)."""

    def __init__(self, cursor: int, cursor_name: str, limit: int, drafts: int,
                 drafts_name: str, width: int, candidates: Any) -> None:
        self.cursor = cursor
        self.cursor_name = cursor_name
        self.limit = limit
        self.drafts = drafts
        self.drafts_name = drafts_name
        self.width = width
        self.candidates = candidates

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              n: cython.Py_ssize_t) -> cython.int:
        """Refuse a cursor below 0, or one whose query tokens run past ``limit``; a draft
        count outside ``[0, min(width - 1, q - 1)]``."""
        cur: cython.pointer[cython.int] = int_data(values[self.cursor])
        limit: cython.longlong = self.limit
        i: cython.Py_ssize_t
        col = self.cursor_name
        for i in range(n):
            if cur[i] < 0:
                raise RequestLayoutError(
                    f"{name}: request {i} has a negative cursor ({col}={cur[i]}); {col} "
                    "must be >= 0")
            if cython.cast(cython.longlong, cur[i]) + qv[i] > limit:
                raise RequestLayoutError(
                    f"{name}: request {i} has {col} + query tokens past the length "
                    f"{limit} ({col}={cur[i]}, query_lens={qv[i]}); {col} + query_lens must "
                    f"be <= {limit}")
        if self.drafts < 0:
            return 0
        dv: cython.pointer[cython.int] = int_data(values[self.drafts])
        top: cython.longlong = self.width - 1
        for i in range(n):
            if dv[i] < 0 or dv[i] > top or dv[i] >= qv[i]:
                col = self.drafts_name
                raise RequestLayoutError(
                    f"{name}: request {i} has {col}={dv[i]} with query_lens={qv[i]}; {col} "
                    f"must lie in [0, min({top}, query_lens - 1)] ({top + 1} candidates per "
                    "request, the last query token never a draft)")
        return 0

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        if self.candidates is None:
            return 0
        cur: cython.pointer[cython.int] = int_data(values[self.cursor])
        dv: cython.pointer[cython.int] = int_data(values[self.drafts])
        out: cython.pointer[cython.int] = int_data(self.candidates)
        w: cython.Py_ssize_t = self.width
        i: cython.Py_ssize_t
        a: cython.Py_ssize_t
        first: cython.int
        for i in range(n):  # the checks keep every entry within int32
            first = cur[i] + own_q[i] - dv[i]
            for a in range(w):
                out[i * w + a] = first + cython.cast(cython.int, a) if a <= dv[i] else -1
        for i in range(n * w, p * w):
            out[i] = -1
        return 0


@cython.cfunc
@cython.exceptval(-1, check=True)
@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)
def write_plan_rows(spec: tuple, own_q: cython.int[::1], own_c: cython.int[::1],
               n: cython.Py_ssize_t, count: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """Write one plan's rows (a compressed-KV :class:`LayoutPlan`); returns the real row count."""
    out: cython.pointer[cython.int] = int_data(spec[0])
    ratio: cython.longlong = spec[1]
    window: cython.longlong = spec[2]
    tail: cython.bint = spec[3]
    i: cython.Py_ssize_t
    j: cython.longlong
    q: cython.longlong
    c: cython.longlong
    x: cython.longlong
    t: cython.longlong = 0
    r: cython.Py_ssize_t = 0
    for i in range(n):
        q = cython.cast(cython.longlong, own_q[i])
        c = cython.cast(cython.longlong, own_c[i])
        for j in range(q):
            x = c - q + j
            if (x >= c - window) if tail else ((x + 1) % ratio == 0):
                out[4 * r] = cython.cast(cython.int, t)
                out[4 * r + 1] = cython.cast(cython.int, i)
                out[4 * r + 2] = cython.cast(cython.int, x)
                out[4 * r + 3] = cython.cast(cython.int, window - min(j + 1, window))
                r += 1
            t += 1
    for i in range(4 * r, 4 * count):  # count -1: no -1 rows
        out[i] = -1
    return r


# This source is compiled by Cython, as ``h2d_core._layout_outputs_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import layout_columns  # noqa: F401 - its build first: the outputs cimport it

    _built = require_extension("h2d_core._layout_outputs_native")
    BoundOutput = _built.BoundOutput  # type: ignore[misc]
    TokenPlanesOutput = _built.TokenPlanesOutput  # type: ignore[misc]
    StateSlotsOutput = _built.StateSlotsOutput  # type: ignore[misc]
    VerifyRowsOutput = _built.VerifyRowsOutput  # type: ignore[misc]
    CursorsOutput = _built.CursorsOutput  # type: ignore[misc]
