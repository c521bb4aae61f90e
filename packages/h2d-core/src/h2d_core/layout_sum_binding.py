"""Binding the :class:`~h2d_core.RequestSum` terms a layout's registered outputs read.

Plain Python, run at bind: :class:`SumBinder` checks each sum, binds it once however many
outputs read it (the layout evaluates each distinct sum once per batch, in
:class:`~h2d_core.layout_outputs.RequestSums`), and bounds its values from the columns'
bounds, so that an output whose entries provably fit its dtype checks nothing per batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import RequestLayoutError
from .layout_records import QUERY_LENS, OrElse, RequestSum
from .layout_sums import LENS, BoundSum

#: what a RequestSum may hold: at most MAX_TERMS terms, each coefficient within
#: +-MAX_COEF, the offset within +-MAX_OFFSET, so that no sum of int32 values leaves int64
MAX_TERMS, MAX_COEF, MAX_OFFSET = 8, 1 << 16, 1 << 62
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def request_column(bound: list, col: object) -> int:
    """The index of ``col`` when it names a bound int32 per-request column, else -1 (what
    every registered output reads its request values from)."""
    for k, spec in enumerate(bound):
        if spec[5] == col:
            return k if spec[0] == 0 and not spec[2] else -1
    return -1


class SumBinder:
    """The sums of one layout's outputs: each checked and bound once (equal sums share one
    :class:`BoundSum`), with the range its values provably lie in."""

    def __init__(self, name: str, bound: list) -> None:
        self.name = name
        self.bound = bound
        self.sums: dict[RequestSum, BoundSum] = {}

    def check(self, value: Any, what: str) -> None:
        """Refuse ``value`` (naming ``what``) unless it is a sum this layout can bind."""
        self._terms(value, what)

    def bind(self, value: Any, what: str) -> BoundSum:
        """``value`` checked (refused naming ``what``) and bound, or the bound sum an
        equal one already has."""
        columns, otherwise, coefs, names = self._terms(value, what)
        if value not in self.sums:
            self.sums[value] = BoundSum(
                np.array(columns, np.int32), np.array(otherwise, np.int32),
                np.array(coefs, np.int64), value.offset, value.describe(), tuple(names))
        return self.sums[value]

    def _terms(self, value: Any, what: str) -> tuple[list, list, list, list]:
        terms: Any = getattr(value, "terms", None)
        ok = (isinstance(value, RequestSum) and isinstance(terms, tuple)
              and len(terms) <= MAX_TERMS and type(value.offset) is int
              and abs(value.offset) <= MAX_OFFSET)
        columns: list[int] = []
        otherwise: list[int] = []
        coefs: list[int] = []
        names: list[str] = []
        for term in terms if ok else ():
            col, coef = term if isinstance(term, tuple) and len(term) == 2 else (None, None)
            if isinstance(col, OrElse):
                k, other = (request_column(self.bound, col.column),
                            request_column(self.bound, col.otherwise))
                ok = (isinstance(col.column, str) and isinstance(col.otherwise, str)
                      and k >= 0 and other >= 0)
                label = col.describe() if ok else ""
            elif isinstance(col, str):
                k = LENS if col == QUERY_LENS else request_column(self.bound, col)
                other, ok, label = -1, k >= 0 or col == QUERY_LENS, col
            else:
                ok = False
            if not ok or type(coef) is not int or not 0 < abs(coef) <= MAX_COEF:
                ok = False
                break
            columns.append(k)
            otherwise.append(other)
            coefs.append(coef)
            names.append(label)
        if not ok:
            raise RequestLayoutError(
                f"{self.name}: {what} must be a RequestSum of at most {MAX_TERMS} (column, "
                f"coefficient) terms, each column a bound int32 per-request column, an "
                f"OrElse of two, or {QUERY_LENS!r}, and each coefficient a nonzero int within "
                f"+-{MAX_COEF}, and an int offset within +-2**62; got {value!r}")
        return columns, otherwise, coefs, names

    def value_range(self, value: RequestSum) -> tuple[int, int]:
        """The lowest and highest values a bound sum can take, from its columns' bounds
        (a query length: any int32 >= 0)."""
        low = high = value.offset
        for col, coef in value.terms:
            if isinstance(col, OrElse):  # the column where >= 0, else the fallback
                a, b = self._column_range(col.column), self._column_range(col.otherwise)
                kept = [(max(a[0], 0), a[1])] if a[1] >= 0 else []
                taken = kept + ([b] if a[0] < 0 else [])
                lo, hi = min(r[0] for r in taken), max(r[1] for r in taken)
            elif col == QUERY_LENS:
                lo, hi = 0, INT32_MAX
            else:
                lo, hi = self._column_range(col)
            low += min(coef * lo, coef * hi)
            high += max(coef * lo, coef * hi)
        return low, high

    def _column_range(self, col: str) -> tuple[int, int]:
        bounds = self.bound[request_column(self.bound, col)][6]
        if bounds is None:
            return INT32_MIN, INT32_MAX
        return max(bounds[0], INT32_MIN), min(bounds[1], INT32_MAX)
