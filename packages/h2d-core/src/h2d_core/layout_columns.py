"""A layout's columns, per step: each checked (length, dtype, bounds, reserved values,
distinct requests), and copied with its padding.

Arrays are read through numpy's C fields (a typed memoryview costs ~0.3 µs per array and
step). Every check runs in :meth:`~h2d_core.RequestLayout.plan`, before any write.

Written in Cython's pure-Python mode and compiled as ``h2d_core._layout_columns_native``
(declared for the other compiled layout modules in ``_layout_columns_native.pxd``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import RequestLayoutError
from .layout_refusals import (
    column_input_error,
    distinct_error,
    repeat_error,
    reserved_error,
    value_error,
)

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:
    from cython.cimports import numpy as cnp

    cnp.import_array()

_INT32_MAX = cython.declare(cython.longlong, 2**31 - 1)


@cython.cfunc
@cython.exceptval(check=False)
def array_size(value: object, kind: cython.int) -> cython.Py_ssize_t:
    """The item count of ``value`` if it is a 1-D C-contiguous aligned native-order array
    of the kind (0 int32, 1 float32, 2 int64), else -1."""
    if not cnp.PyArray_Check(value):
        return -1
    a = cython.cast(cnp.ndarray, value)
    typenum: cython.int = (cnp.NPY_INT32 if kind == 0 else cnp.NPY_FLOAT32 if kind == 1
                           else cnp.NPY_INT64)  # C constants: no tuple read per call
    if (cnp.PyArray_NDIM(a) != 1 or cnp.PyArray_TYPE(a) != typenum
            or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a)
            or not cnp.PyArray_ISNOTSWAPPED(a)):
        return -1
    return cnp.PyArray_DIM(a, 0)


@cython.cfunc
@cython.exceptval(check=False)
def int_data(value: object) -> cython.pointer[cython.int]:
    return cython.cast(cython.pointer[cython.int],
                       cnp.PyArray_DATA(cython.cast(cnp.ndarray, value)))


@cython.cfunc
@cython.exceptval(check=False)
def float_data(value: object) -> cython.pointer[cython.float]:
    return cython.cast(cython.pointer[cython.float],
                       cnp.PyArray_DATA(cython.cast(cnp.ndarray, value)))


@cython.cfunc
@cython.exceptval(check=False)
def long_data(value: object) -> cython.pointer[cython.longlong]:
    return cython.cast(cython.pointer[cython.longlong],
                       cnp.PyArray_DATA(cython.cast(cnp.ndarray, value)))


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def copy_ints(src: cython.pointer[cython.int], dst: cython.pointer[cython.int],
              m: cython.Py_ssize_t) -> cython.void:
    i: cython.Py_ssize_t
    for i in range(m):
        dst[i] = src[i]


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def sum_ints(value: object, size: cython.Py_ssize_t) -> cython.longlong:
    i: cython.Py_ssize_t
    total: cython.longlong = 0
    v: cython.pointer[cython.int] = int_data(value)
    for i in range(size):
        total += cython.cast(cython.longlong, v[i])
    return total


@cython.cfunc
@cython.exceptval(-1, check=True)
def check_columns(name: str, columns: tuple, values: Sequence[Any], n: cython.Py_ssize_t,
                   t: cython.Py_ssize_t, sums: cython.longlong[::1]) -> cython.longlong:
    """Check each column's values (dtype, layout, length, bounds); the uniform request
    columns; the sums of the columns without an output (into ``sums``)."""
    if len(values) != len(columns):
        raise RequestLayoutError(
            f"{name}: {len(values)} column values for {len(columns)} bound columns; pass "
            "one array per column, in binding order")
    mask: cython.longlong = 0
    k: cython.Py_ssize_t
    i: cython.Py_ssize_t
    size: cython.Py_ssize_t
    kind: cython.int
    for k in range(len(columns)):
        spec = columns[k]
        kind = spec[0]
        value = values[k]
        size = t if spec[2] else n
        if array_size(value, kind) != size:
            column_input_error(name, spec, value, size)
        if spec[6] is not None:
            i = _outside(value, kind, spec[6], size)
            if i >= 0:
                value_error(name, spec, value, i)
        if spec[7] is not None:
            i = _holding(value, kind, spec[7][0], size)
            if i >= 0:
                reserved_error(name, spec, i)
        if spec[1] is None:
            sums[k] = sum_ints(value, size)
        if spec[2] or size < 2:
            if not spec[2]:
                mask |= cython.cast(cython.longlong, 1) << k
            continue
        if _uniform(value, kind, size):
            mask |= cython.cast(cython.longlong, 1) << k
    return mask


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _outside(value: object, kind: cython.int, bounds: tuple,
             size: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """The index of the first of ``size`` values outside ``bounds`` (see :func:`_bounds`),
    or -1. A float32 NaN fails both comparisons, so it is always outside."""
    i: cython.Py_ssize_t
    if kind == 1:
        sf: cython.pointer[cython.float] = float_data(value)
        flo: cython.double = bounds[0]
        fhi: cython.double = bounds[1]
        x: cython.double
        if bounds[2]:  # an open lower bound
            for i in range(size):
                x = sf[i]
                if not (x > flo and x <= fhi):
                    return i
        else:
            for i in range(size):
                x = sf[i]
                if not (x >= flo and x <= fhi):
                    return i
        return -1
    lo: cython.longlong = bounds[0]
    hi: cython.longlong = bounds[1]
    v: cython.longlong
    if kind == 2:
        sl: cython.pointer[cython.longlong] = long_data(value)
        for i in range(size):
            v = cython.cast(cython.longlong, sl[i])
            if v < lo or v > hi:
                return i
        return -1
    si: cython.pointer[cython.int] = int_data(value)
    for i in range(size):
        v = cython.cast(cython.longlong, si[i])
        if v < lo or v > hi:
            return i
    return -1


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _holding(value: object, kind: cython.int, reserved: cython.longlong,
             size: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """The index of the first of ``size`` integer values equal to ``reserved``, or -1."""
    i: cython.Py_ssize_t
    if kind == 2:
        sl: cython.pointer[cython.longlong] = long_data(value)
        for i in range(size):
            if sl[i] == reserved:
                return i
        return -1
    si: cython.pointer[cython.int] = int_data(value)
    for i in range(size):
        if si[i] == reserved:
            return i
    return -1


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _uniform(value: object, kind: cython.int, size: cython.Py_ssize_t) -> cython.bint:
    """Whether ``value`` (``size`` >= 2 items of the kind) holds one value, bit for bit
    (as a bytes compare: NaN payloads count, -0.0 differs from 0.0)."""
    i: cython.Py_ssize_t
    if kind == 2:
        vl: cython.pointer[cython.longlong] = long_data(value)
        for i in range(1, size):  # noqa: SIM110 - a C loop when compiled
            if vl[i] != vl[0]:
                return False
        return True
    vi: cython.pointer[cython.int] = int_data(value)  # int32, or a float32's bits
    for i in range(1, size):  # noqa: SIM110 - a C loop when compiled
        if vi[i] != vi[0]:
            return False
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
@cython.boundscheck(False)
@cython.wraparound(False)
def copy_column(spec: tuple, value: object, m: cython.Py_ssize_t,
                end: cython.Py_ssize_t) -> cython.int:
    """``out[:m] = value`` (clamped for a float minimum), ``out[m:end] = pad``."""
    i: cython.Py_ssize_t
    kind: cython.int = spec[0]
    out = spec[1]
    if spec[3] is None:
        end = m
    if kind == 0:
        si: cython.pointer[cython.int] = int_data(value)
        di: cython.pointer[cython.int] = int_data(out)
        pi: cython.int = spec[3] if end > m else 0
        for i in range(m):
            di[i] = si[i]
        for i in range(m, end):
            di[i] = pi
    elif kind == 1:
        sf: cython.pointer[cython.float] = float_data(value)
        df: cython.pointer[cython.float] = float_data(out)
        pf: cython.float = spec[3] if end > m else 0.0
        x: cython.float
        lo: cython.float
        if spec[4] is None:
            for i in range(m):
                df[i] = sf[i]
        else:
            lo = spec[4]
            for i in range(m):
                x = sf[i]
                df[i] = x if (x != x or x > lo) else lo  # np.maximum: NaN propagates
        for i in range(m, end):
            df[i] = pf
    else:
        sl: cython.pointer[cython.longlong] = long_data(value)
        dl: cython.pointer[cython.longlong] = long_data(out)
        pl: cython.longlong = spec[3] if end > m else 0
        for i in range(m):
            dl[i] = sl[i]
        for i in range(m, end):
            dl[i] = pl
    return 0


@cython.cfunc
@cython.exceptval(-1, check=True)
@cython.boundscheck(False)
@cython.wraparound(False)
def check_distinct(name: str, columns: tuple, distinct: tuple, values: Sequence[Any],
                   n: cython.Py_ssize_t, sort_keys: object,
                   stamp: cython.pointer[cython.longlong]) -> cython.int:
    """Refuse a distinct column's value that an earlier request holds (the column's bounds
    were checked: every value indexes its stamp table). ``distinct`` holds per distinct
    column (column index, lowest value, stamp table or None: a sort into ``sort_keys``);
    ``stamp`` points at the last check's stamp, advanced here (kept when a check refuses:
    a stamp is never reused)."""
    if n < 2:
        return 0
    k: cython.Py_ssize_t
    i: cython.Py_ssize_t
    lo: cython.longlong
    mark: cython.longlong
    entry: cython.longlong
    seen: cython.pointer[cython.longlong]
    for k in range(len(distinct)):
        spec = distinct[k]
        v: cython.pointer[cython.int] = int_data(values[spec[0]])
        table = spec[2]
        if table is None:
            if _sorted_repeat(v, n, long_data(sort_keys)):
                distinct_error(name, columns[spec[0]][5], values[spec[0]], n)
            continue
        if stamp[0] >= _INT32_MAX:  # the stamps start over: every table cleared
            for d in distinct:
                if d[2] is not None:
                    d[2].fill(0)
            stamp[0] = 0
        stamp[0] += 1
        mark = stamp[0] * 4294967296
        lo = spec[1]
        seen = long_data(table)
        for i in range(n):
            entry = seen[v[i] - lo]
            if entry >= mark:  # this check's mark: request entry - mark holds it
                repeat_error(name, columns[spec[0]][5], v[i], i, entry - mark)
            seen[v[i] - lo] = mark + i
    return 0


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _sorted_repeat(v: cython.pointer[cython.int], n: cython.Py_ssize_t,
                   keys: cython.pointer[cython.longlong]) -> cython.bint:
    """Whether two of the ``n`` values repeat: a heap sort of ``value * 2**32 +
    request`` into ``keys``, then a look at neighbours."""
    i: cython.Py_ssize_t
    x: cython.longlong
    for i in range(n):
        keys[i] = cython.cast(cython.longlong, v[i]) * 4294967296 + i
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(keys, i, n)
    for i in range(n - 1, 0, -1):
        x = keys[0]
        keys[0] = keys[i]
        keys[i] = x
        _sift_down(keys, 0, i)
    for i in range(1, n):
        if keys[i] - (keys[i] & 0xFFFFFFFF) == keys[i - 1] - (keys[i - 1] & 0xFFFFFFFF):
            return True
    return False


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _sift_down(a: cython.pointer[cython.longlong], root: cython.Py_ssize_t,
               end: cython.Py_ssize_t) -> cython.void:
    child: cython.Py_ssize_t
    x: cython.longlong
    while True:
        child = 2 * root + 1
        if child >= end:
            return
        if child + 1 < end and a[child + 1] > a[child]:
            child += 1
        if a[root] >= a[child]:
            return
        x = a[root]
        a[root] = a[child]
        a[child] = x
        root = child


if not cython.compiled:  # interpreted: only name this build if it is missing (cimported)
    from block_tables.native import require_extension

    require_extension("h2d_core._layout_columns_native")
