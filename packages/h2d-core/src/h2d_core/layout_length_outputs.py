"""The outputs a :class:`~h2d_core.RequestLayout` derives from the lengths alone, bound as
registered outputs: each request's last-page length (MLA kernels' convention), the capped
context prefix (prefill's ``cu_seqlens_k``) and the per-token query prefix (an fp8
per-token kernel's ``qo_indptr``).

The layout's constructor takes their arrays (``last_page_lens``, ``context_prefix`` with
``context_cap``, ``token_prefix``) and binds one object per given array with
:func:`length_outputs`; per step they are checked and written with the family outputs
(:mod:`h2d_core.layout_outputs`), through C.

Written in Cython's pure-Python mode and compiled as ``h2d_core._layout_length_outputs_native``
(the fields are declared in ``_layout_length_outputs_native.pxd``).
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
    from cython.cimports.h2d_core._layout_outputs_native import BoundOutput
else:
    from .layout_outputs import BoundOutput

INT32_MAX = cython.declare(cython.longlong, 2**31 - 1)  # a C constant: comparing boxes nothing


@cython.cclass
class LastPageLensOutput(BoundOutput):
    """The tokens in each request's last page, ``(context_len - 1) % page_size + 1``; 0 for
    padded requests (no pages)."""

    def __init__(self, out: Any, page_size: int, shift: int) -> None:
        self.out = out
        self.page = page_size
        self.shift = shift

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.cdivision(True)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        out: cython.pointer[cython.int] = cython.address(self.out[0])
        page: cython.longlong = self.page
        i: cython.Py_ssize_t
        c: cython.longlong
        for i in range(n):
            c = cython.cast(cython.longlong, own_c[i]) - 1
            out[i] = cython.cast(cython.int, (c & (page - 1) if self.shift >= 0
                                              else c % page) + 1)
        for i in range(n, p):
            out[i] = 0
        return 0


@cython.cclass
class ContextPrefixOutput(BoundOutput):
    """The exclusive prefix of ``min(context_len, cap)`` (the keys each request reads; the
    padded requests' tail repeats the total), refused past int32."""

    def __init__(self, out: Any, cap: int) -> None:
        self.out = out
        self.cap = cap

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def check(self, name: str, values: Sequence[Any], qv: cython.pointer[cython.int],
              cv: cython.pointer[cython.int], n: cython.Py_ssize_t) -> cython.int:
        keys: cython.longlong = 0
        i: cython.Py_ssize_t
        for i in range(n):
            keys += min(cython.cast(cython.longlong, cv[i]), self.cap)
        if keys > INT32_MAX:
            what = "context_len" if self.cap == INT32_MAX else f"min(context_len, {self.cap})"
            raise RequestLayoutError(
                f"{name}: the batch's context prefix (the sum of {what} over its requests) "
                f"is {keys}, more than its int32 array holds; split the batch")
        return 0

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        out: cython.pointer[cython.int] = cython.address(self.out[0])
        acc: cython.longlong = 0
        i: cython.Py_ssize_t
        out[0] = 0
        for i in range(n):
            acc += min(cython.cast(cython.longlong, own_c[i]), self.cap)
            out[i + 1] = cython.cast(cython.int, acc)
        for i in range(n, p):
            out[i + 1] = cython.cast(cython.int, acc)
        return 0


@cython.cclass
class TokenPrefixOutput(BoundOutput):
    """Every token its own query: ``0, 1, ..., t``, then ``t`` up to ``padded_tokens``."""

    def __init__(self, out: Any) -> None:
        self.out = out

    @cython.cfunc
    @cython.exceptval(-1, check=True)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self, values: Sequence[Any], own_q: cython.pointer[cython.int],
              own_c: cython.pointer[cython.int], n: cython.Py_ssize_t, p: cython.Py_ssize_t,
              t: cython.Py_ssize_t, pt: cython.Py_ssize_t) -> cython.int:
        out: cython.pointer[cython.int] = cython.address(self.out[0])
        i: cython.Py_ssize_t
        for i in range(t + 1):
            out[i] = cython.cast(cython.int, i)
        for i in range(t + 1, pt + 1):
            out[i] = cython.cast(cython.int, t)
        return 0


def length_outputs(page_size: int, shift: int, last_page_lens: Any, context_prefix: Any,
                   context_cap: int | None, token_prefix: Any) -> tuple:
    """One bound output per given array (checked already by
    :func:`~h2d_core.layout_arrays.layout_arrays`), in that order."""
    out: list = []
    if last_page_lens is not None:
        out.append(LastPageLensOutput(last_page_lens, page_size, shift))
    if context_prefix is not None:
        out.append(ContextPrefixOutput(context_prefix,
                                       INT32_MAX if context_cap is None else context_cap))
    if token_prefix is not None:
        out.append(TokenPrefixOutput(token_prefix))
    return tuple(out)


# This source is compiled by Cython, as ``h2d_core._layout_length_outputs_native``, when the
# package is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import layout_outputs  # noqa: F401 - built first: cimported here

    _built = require_extension("h2d_core._layout_length_outputs_native")
    LastPageLensOutput = _built.LastPageLensOutput  # type: ignore[misc]
    ContextPrefixOutput = _built.ContextPrefixOutput  # type: ignore[misc]
    TokenPrefixOutput = _built.TokenPrefixOutput  # type: ignore[misc]
    length_outputs = _built.length_outputs
