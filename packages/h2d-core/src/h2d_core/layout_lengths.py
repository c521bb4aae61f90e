"""The layout core's pass over a batch's lengths: each request's query and context length
checked and counted (tokens, KV pages, the shortest and longest query), then, once the
whole batch passed, kept as the layout's private copy with each request's page count.

:meth:`~h2d_core.RequestLayout.plan` calls both through C: :func:`check_lengths` before
anything is written, :func:`keep_lengths` after every check passed.

Written in Cython's pure-Python mode and compiled as ``h2d_core._layout_lengths_native``
(declared in ``_layout_lengths_native.pxd``).
"""

from __future__ import annotations

from .errors import RequestLayoutError

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

_INT32_MAX = cython.declare(cython.longlong, 2**31 - 1)  # a C constant: comparing boxes nothing


@cython.cfunc
@cython.exceptval(-1, check=True)
@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)  # non-negative operands
def check_lengths(name: str, qv: cython.pointer[cython.int], cv: cython.pointer[cython.int],
                  n: cython.Py_ssize_t, page: cython.longlong, shift: cython.int,
                  width: cython.Py_ssize_t, paged: cython.bint,
                  counts: cython.pointer[cython.longlong]) -> cython.int:
    """Refuse a request that runs no token, whose context is shorter than its query, or
    (``paged``) needs more pages than a table row of ``width`` holds, and a batch whose
    pages overflow an int32 prefix; else set ``counts`` to (tokens, KV pages, shortest
    query, longest query), 0 for an empty batch."""
    i: cython.Py_ssize_t
    t: cython.longlong = 0
    total: cython.longlong = 0
    lo: cython.int = 0
    hi: cython.int = 0
    pages: cython.longlong
    q: cython.int
    c: cython.int
    for i in range(n):
        q = qv[i]
        c = cv[i]
        if q < 1:
            raise RequestLayoutError(
                f"{name}: request {i} runs {q} query tokens; a scheduled request runs >= 1")
        if c < q:
            raise RequestLayoutError(
                f"{name}: request {i} has context_len {c}, shorter than its {q} query "
                "tokens; context_len counts the tokens after this step")
        t += cython.cast(cython.longlong, q)
        if i == 0 or q < lo:
            lo = q
        if q > hi:
            hi = q
        pages = cython.cast(cython.longlong, c) + page - 1
        pages = pages >> shift if shift >= 0 else pages // page  # a shift: no divide
        if pages > width and paged:
            raise RequestLayoutError(
                f"{name}: request {i} has context_len {c}, which needs {pages} pages of "
                f"{page} tokens; the table holds {width} per row")
        total += pages
    if total > _INT32_MAX:  # needs a table of 8 GiB or more: a guard, not a limit
        raise RequestLayoutError(
            f"{name}: the batch needs {total} KV pages in all, more than an int32 page "
            "prefix holds; split the batch")
    counts[0] = t
    counts[1] = total
    counts[2] = lo
    counts[3] = hi
    return 0


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)
def keep_lengths(qv: cython.pointer[cython.int], cv: cython.pointer[cython.int],
                 n: cython.Py_ssize_t, p: cython.Py_ssize_t, page: cython.longlong,
                 shift: cython.int, own_q: cython.pointer[cython.int],
                 own_c: cython.pointer[cython.int],
                 required: cython.pointer[cython.int]) -> cython.void:
    """Copy a checked batch's lengths into the layout's own arrays (the table's preparation
    runs Python code before the write, which could change the caller's) and each
    request's page count into ``required``: 0 for the padded requests up to ``p``."""
    i: cython.Py_ssize_t
    pages: cython.longlong
    for i in range(n):
        own_q[i] = qv[i]
        own_c[i] = cv[i]
        pages = cython.cast(cython.longlong, cv[i]) + page - 1
        pages = pages >> shift if shift >= 0 else pages // page
        required[i] = cython.cast(cython.int, pages)  # <= the context length: fits int32
    for i in range(n, p):
        required[i] = 0


# This source is compiled by Cython, as ``h2d_core._layout_lengths_native``, when the package
# is built; run interpreted, it only checks that build is there (required): its functions
# are reached through C only.
if not cython.compiled:
    from block_tables.native import require_extension

    require_extension("h2d_core._layout_lengths_native")
