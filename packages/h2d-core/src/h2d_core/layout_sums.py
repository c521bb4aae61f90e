"""A bound :class:`~h2d_core.RequestSum`: the per-request sums the generic outputs
(:class:`~h2d_core.RequestBound`, :class:`~h2d_core.RampRows`) check and write from.

Written in Cython's pure-Python mode and compiled as ``h2d_core._layout_sums_native``
(the fields and ``evaluate`` are declared in ``_layout_sums_native.pxd``, which the
compiled outputs cimport).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:
    from cython.cimports.h2d_core._layout_columns_native import int_data


#: a term's column index naming the query lengths (not a column; the compiled loop
#: below compares with the literal)
LENS = -1


@cython.cclass
class BoundSum:
    """A bound :class:`RequestSum`: its terms' column indices (:data:`LENS`: the query
    lengths), each term's fallback column (-1: none; an :class:`OrElse`), coefficients
    and offset, its text for refusals, and an int64 row per request that
    :meth:`evaluate` fills (sized by :meth:`reserve` at bind)."""

    def __init__(self, columns: Any, otherwise: Any, coefs: Any, offset: int, label: str,
                 names: tuple) -> None:
        self.columns = columns
        self.otherwise = otherwise
        self.coefs = coefs
        self.offset = offset
        self.label = label
        self.names = names
        self.acc: Any = None

    def reserve(self, max_reqs: int) -> None:
        self.acc = np.zeros(max(max_reqs, 1), np.int64)

    @cython.cfunc
    @cython.exceptval(check=False)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def evaluate(self, values: Sequence[Any], qv: cython.pointer[cython.int],
                 n: cython.Py_ssize_t) -> cython.pointer[cython.longlong]:
        """The sum of each of the ``n`` real requests (the binding bounds every product and
        the offset so that no sum leaves int64)."""
        acc: cython.pointer[cython.longlong] = cython.address(self.acc[0])
        i: cython.Py_ssize_t
        k: cython.Py_ssize_t
        terms: cython.Py_ssize_t = self.columns.shape[0]
        col: cython.int
        src: cython.pointer[cython.int]
        alt: cython.pointer[cython.int]
        coef: cython.longlong
        first: cython.bint
        off: cython.longlong = self.offset
        if terms == 0:
            for i in range(n):
                acc[i] = off
        for k in range(terms):  # the first term sets each sum (from the offset)
            col = self.columns[k]
            coef = self.coefs[k]
            first = k == 0
            src = qv if col == -1 else int_data(values[col])  # -1: LENS
            if self.otherwise[k] < 0 and first:
                for i in range(n):
                    acc[i] = off + coef * src[i]
            elif self.otherwise[k] < 0:
                for i in range(n):
                    acc[i] += coef * src[i]
            else:
                alt = int_data(values[self.otherwise[k]])
                for i in range(n):
                    acc[i] = (off if first else acc[i]) + coef * (
                        src[i] if src[i] >= 0 else alt[i])
        return acc

    @cython.cfunc
    @cython.exceptval(check=False)
    def result(self) -> cython.pointer[cython.longlong]:
        """The sums the last :meth:`evaluate` wrote (this batch's, once the layout's
        :class:`~h2d_core.layout_outputs.RequestSums` ran)."""
        return cython.address(self.acc[0])

    def terms_at(self, values: Sequence[Any], qv: Any, i: int) -> str:
        """Request ``i``'s term values, as a refusal lists them."""
        out = []
        for k in range(len(self.names)):
            col = self.columns[k]
            if col == LENS:
                value = qv[i]
            else:
                value = int(values[col][i])
                if self.otherwise[k] >= 0 and value < 0:
                    value = int(values[self.otherwise[k]][i])
            out.append(f"{self.names[k]}={value}")
        return ", ".join(out)


# This source is compiled by Cython, as ``h2d_core._layout_sums_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import layout_columns  # noqa: F401 - its build first: the sums cimport it

    BoundSum = require_extension("h2d_core._layout_sums_native").BoundSum  # type: ignore[misc]
