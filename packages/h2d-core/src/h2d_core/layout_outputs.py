"""The outputs a family registers on a :class:`~h2d_core.RequestLayout`, bound.

A family declares its outputs as records (:mod:`h2d_core.layout_records`) from its own
module: :class:`RequestBound`, :class:`RampRows` and :class:`RequestValues` over
:class:`RequestSum` (GDN's state slots, Engram's cursors), :class:`TokenPlanes` (MRoPE's
planes), and speculative verification's :class:`VerifyRows`. At bind,
:mod:`h2d_core.layout_binding` checks each record and makes one of the objects below
(:class:`RequestSums` first: each distinct sum evaluated once per batch); per step the
layout calls, through C, each object's ``check`` in :meth:`~h2d_core.RequestLayout.plan`
(before anything is written) and its ``write`` in :meth:`~h2d_core.RequestLayout.write`.
Each reads the request columns it names from the batch's column values, by their bound
index.

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
    from cython.cimports.h2d_core._layout_sums_native import BoundSum
else:
    from .layout_sums import BoundSum


@cython.cclass
class BoundOutput:
    """A registered output: ``check`` refuses a bad batch (nothing written yet; it reads
    the query and context lengths ``qv`` and ``cv`` and the column values), ``write``
    fills the output for the planned batch, padding included; ``reserve`` sizes its
    per-request scratch once the layout knows its request capacity (at bind)."""

    def reserve(self, max_reqs: int) -> None:
        return None

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              cv: cython.pointer[cython.int], n: cython.Py_ssize_t) -> cython.int:
        return 0

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        return 0


@cython.cclass
class RequestSums(BoundOutput):
    """The distinct :class:`~h2d_core.RequestSum` values the other outputs read, each
    evaluated once per batch in ``check`` (bound first, so before those outputs'
    checks); the outputs read them in their ``check`` and ``write`` (the planned batch's
    values, which the caller leaves unchanged until ``write``)."""

    def __init__(self, sums: tuple) -> None:
        self.sums = sums

    def reserve(self, max_reqs: int) -> None:
        for value in self.sums:
            value.reserve(max_reqs)

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              cv: cython.pointer[cython.int], n: cython.Py_ssize_t) -> cython.int:
        for value in self.sums:
            cython.cast(BoundSum, value).evaluate(values, qv, n)
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
              cv: cython.pointer[cython.int], n: cython.Py_ssize_t) -> cython.int:
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
class RequestBoundOutput(BoundOutput):
    """:class:`RequestBound`: each real request's sum within ``[low, high]``."""

    def __init__(self, value: BoundSum, low: int, high: int, rule: str, note: str) -> None:
        self.value = value
        self.low = low
        self.high = high
        self.rule = rule
        self.note = note

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              cv: cython.pointer[cython.int], n: cython.Py_ssize_t) -> cython.int:
        acc: cython.pointer[cython.longlong] = self.value.result()
        i: cython.Py_ssize_t
        for i in range(n):
            if acc[i] < self.low or acc[i] > self.high:
                self.refuse(name, values, [qv[k] for k in range(n)], i, acc[i])
        return 0

    def refuse(self, name: str, values: Sequence[Any], q: list, i: int, v: int) -> None:
        label = self.value.label
        raise RequestLayoutError(
            f"{name}: request {i} has {label} = {v} ({self.value.terms_at(values, q, i)}); "
            f"{label} must be {self.rule}" + (f" ({self.note})" if self.note else ""))


@cython.cclass
class RampRowsOutput(BoundOutput):
    """:class:`RampRows`: ``width`` entries per request, ``start + a`` for ``a < count``,
    then ``fill``; padded requests all ``fill``. ``checked``: whether the columns' bounds
    leave a batch's counts or entries to be checked."""

    def __init__(self, output: str, out: Any, width: int, start: BoundSum, count: BoundSum,
                 fill: int, checked: bool) -> None:
        self.output = output
        self.out = out
        self.width = width
        self.start = start
        self.count = count
        self.fill = fill
        self.checked = checked

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              cv: cython.pointer[cython.int], n: cython.Py_ssize_t) -> cython.int:
        """Refuse a count outside ``[0, width]``, or entries past int32."""
        if not self.checked:
            return 0
        st: cython.pointer[cython.longlong] = self.start.result()
        ct: cython.pointer[cython.longlong] = self.count.result()
        i: cython.Py_ssize_t
        for i in range(n):
            if ct[i] < 0 or ct[i] > self.width or (ct[i] > 0 and (
                    st[i] < -2147483648 or st[i] + ct[i] - 1 > 2147483647)):
                self.refuse(name, values, [qv[k] for k in range(n)], i, st[i], ct[i])
        return 0

    def refuse(self, name: str, values: Sequence[Any], q: list, i: int, start: int,
               count: int) -> None:
        where = f"{name}: output {self.output!r}: request {i}"
        if not 0 <= count <= self.width:
            label = self.count.label
            raise RequestLayoutError(
                f"{where} has {label} = {count} ({self.count.terms_at(values, q, i)}); "
                f"{label} must lie in [0, {self.width}] ({self.width} entries per request)")
        raise RequestLayoutError(
            f"{where}'s entries {start}..{start + count - 1} ({self.start.label} = {start}, "
            f"{self.start.terms_at(values, q, i)}) leave int32")

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        st: cython.pointer[cython.longlong] = self.start.result()
        ct: cython.pointer[cython.longlong] = self.count.result()
        out: cython.pointer[cython.int] = int_data(self.out)
        w: cython.Py_ssize_t = self.width
        fill: cython.int = self.fill
        i: cython.Py_ssize_t
        a: cython.Py_ssize_t
        for i in range(n):  # the checks (or the columns' bounds) keep entries within int32
            for a in range(w):
                out[i * w + a] = cython.cast(cython.int, st[i] + a) if a < ct[i] else fill
        for i in range(n * w, p * w):
            out[i] = fill
        return 0


@cython.cclass
class RequestValuesOutput(BoundOutput):
    """:class:`RequestValues`: each real request's sum, padded requests ``fill`` unless
    ``keep_padding``. ``checked``: whether the columns' bounds leave a batch's sums to be
    checked against int32."""

    def __init__(self, output: str, out: Any, value: BoundSum, fill: int,
                 keep_padding: bool, checked: bool) -> None:
        self.output = output
        self.out = out
        self.value = value
        self.fill = fill
        self.keep_padding = keep_padding
        self.checked = checked

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              cv: cython.pointer[cython.int], n: cython.Py_ssize_t) -> cython.int:
        """Refuse a sum past int32."""
        if not self.checked:
            return 0
        acc: cython.pointer[cython.longlong] = self.value.result()
        i: cython.Py_ssize_t
        for i in range(n):
            if acc[i] < -2147483648 or acc[i] > 2147483647:  # int32's range
                label = self.value.label
                raise RequestLayoutError(
                    f"{name}: output {self.output!r}: request {i} has {label} = {acc[i]} "
                    f"({self.value.terms_at(values, [qv[k] for k in range(n)], i)}), past "
                    "int32")
        return 0

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        acc: cython.pointer[cython.longlong] = self.value.result()
        out: cython.pointer[cython.int] = int_data(self.out)
        i: cython.Py_ssize_t
        for i in range(n):  # the checks (or the columns' bounds) keep each within int32
            out[i] = cython.cast(cython.int, acc[i])
        if not self.keep_padding:
            for i in range(n, p):
                out[i] = self.fill
        return 0


# This source is compiled by Cython, as ``h2d_core._layout_outputs_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import layout_columns, layout_sums  # noqa: F401 - built first: cimported here

    _built = require_extension("h2d_core._layout_outputs_native")
    BoundOutput = _built.BoundOutput  # type: ignore[misc]
    RequestSums = _built.RequestSums  # type: ignore[misc]
    TokenPlanesOutput = _built.TokenPlanesOutput  # type: ignore[misc]
    VerifyRowsOutput = _built.VerifyRowsOutput  # type: ignore[misc]
    RequestBoundOutput = _built.RequestBoundOutput  # type: ignore[misc]
    RampRowsOutput = _built.RampRowsOutput  # type: ignore[misc]
    RequestValuesOutput = _built.RequestValuesOutput  # type: ignore[misc]
