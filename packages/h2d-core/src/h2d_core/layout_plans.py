"""A layout's compressed-KV plans (:class:`~h2d_core.LayoutPlan`, DeepSeek-V4's compress
and write plans): bound once, their rows checked in :meth:`~h2d_core.RequestLayout.plan`
before anything is written, then counted and written in
:meth:`~h2d_core.RequestLayout.write`.

A bound plan is ``(flat out, ratio, window, tail, rows, graph, name)``. A graph plan
publishes the grid's rows (``padded_reqs`` requests of the widest query); an eager plan
its real rows (a tail plan: the whole array).

Written in Cython's pure-Python mode and compiled as ``h2d_core._layout_plans_native``
(the functions the layout calls through C are declared in ``_layout_plans_native.pxd``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import RequestLayoutError, describe_value
from .layout_records import LayoutPlan

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:
    from cython.cimports.h2d_core._layout_columns_native import int_data


def bind_plans(name: str, plans: Sequence[LayoutPlan], arrays: dict) -> list:
    """Each :class:`LayoutPlan` checked and bound: (flat out, ratio, window, tail, rows,
    graph, name)."""
    bound_plans = []
    for plan in plans:
        out = plan.out
        if (not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.ndim != 2
                or out.shape[1] != 4 or not out.flags.c_contiguous
                or not out.flags.writeable or plan.name in arrays):
            raise RequestLayoutError(
                f"{name}: plan {plan.name!r} needs a unique name and a writeable "
                f"C-contiguous int32 [rows, 4] array, got {describe_value(out)}")
        if (type(plan.ratio) is not int or type(plan.window) is not int
                or plan.ratio < 1 or plan.window < 1):
            raise RequestLayoutError(
                f"{name}: plan {plan.name!r}: ratio and window must be ints >= 1, got "
                f"{plan.ratio!r} and {plan.window!r}")
        arrays[plan.name] = out
        bound_plans.append((out.reshape(-1), plan.ratio, plan.window, bool(plan.tail),
                            out.shape[0], bool(plan.graph), plan.name))
    return bound_plans


@cython.cfunc
@cython.exceptval(-1, check=True)
@cython.cdivision(True)
def check_plans(name: str, plans: tuple, qv: cython.pointer[cython.int],
                cv: cython.pointer[cython.int], n: cython.Py_ssize_t,
                padded_reqs: cython.longlong, width_q: cython.longlong) -> cython.int:
    """Refuse a batch whose rows a plan's array cannot hold: an eager plan's real rows, or
    a graph plan's grid (``padded_reqs`` requests of ``width_q`` tokens)."""
    k: cython.Py_ssize_t
    i: cython.Py_ssize_t
    rows: cython.longlong
    q: cython.longlong
    c: cython.longlong
    for k in range(len(plans)):
        spec = plans[k]
        if not spec[5]:  # eager: the real rows (exactly), the whole array for a tail
            rows = 0
            for i in range(n):
                q = qv[i]
                c = cv[i]
                if spec[3]:
                    rows += min(q, spec[2])
                else:
                    rows += c // spec[1] - (c - q) // spec[1]
            if rows > spec[4]:
                raise RequestLayoutError(
                    f"{name}: plan {spec[6]!r} needs {rows} rows, more than its "
                    f"{spec[4]}; declare a larger array")
            continue
        rows = padded_reqs * (min(width_q, cython.cast(cython.longlong, spec[2])) if spec[3]
                              else (width_q + spec[1] - 1) // spec[1])
        if rows > spec[4]:
            raise RequestLayoutError(
                f"{name}: plan {spec[6]!r} needs {rows} rows ({padded_reqs} requests of "
                f"up to {width_q} tokens), more than its {spec[4]}; declare a larger array")
    return 0


@cython.cfunc
@cython.exceptval(-1, check=True)
@cython.cdivision(True)
def publish_plans(plans: tuple, published: list, padded_reqs: cython.longlong,
                  width_q: cython.longlong) -> cython.int:
    """Each plan's published rows for a checked batch (-1: its real rows, known once
    written)."""
    k: cython.Py_ssize_t
    for k in range(len(plans)):
        spec = plans[k]
        if not spec[5]:  # eager: the whole array for a tail, the real rows otherwise
            published[k] = spec[4] if spec[3] else -1
        else:
            published[k] = (padded_reqs * min(width_q, spec[2]) if spec[3]
                            else padded_reqs * ((width_q + spec[1] - 1) // spec[1]))
    return 0


@cython.cfunc
@cython.exceptval(-1, check=True)
def write_plans(plans: tuple, own_q: cython.int[::1], own_c: cython.int[::1],
                n: cython.Py_ssize_t, real: list, published: list) -> cython.int:
    """Write every plan's rows; record its real rows (and, for an eager non-tail plan, its
    published rows: the real ones)."""
    k: cython.Py_ssize_t
    for k in range(len(plans)):
        real[k] = write_plan_rows(plans[k], own_q, own_c, n, published[k])
        if published[k] < 0:
            published[k] = real[k]
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


# This source is compiled by Cython, as ``h2d_core._layout_plans_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import layout_columns  # noqa: F401 - built first: cimported here

    bind_plans = require_extension("h2d_core._layout_plans_native").bind_plans
