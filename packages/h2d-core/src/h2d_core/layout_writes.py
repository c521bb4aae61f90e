"""The layout core's writes over raw arrays: each token's position, KV slot and owner, and
the per-request prefixes and lengths, padding included.

:meth:`~h2d_core.RequestLayout.write` calls them through C with its bound arrays' data
(NULL for an array it does not write) once the batch is planned and its page-table rows
are prepared. Padding: positions 0, KV slots -1 (no write), owners -1; a prefix repeats
its total; a per-request length is 0.

Written in Cython's pure-Python mode and compiled as ``h2d_core._layout_writes_native``
(declared in ``_layout_writes_native.pxd``).
"""

from __future__ import annotations

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)  # non-negative operands
def write_tokens(own_q: cython.pointer[cython.int], own_c: cython.pointer[cython.int],
                 n: cython.Py_ssize_t, t: cython.Py_ssize_t, pt: cython.Py_ssize_t,
                 table: cython.pointer[cython.int], width: cython.Py_ssize_t,
                 page: cython.longlong, shift: cython.int,
                 positions: cython.pointer[cython.longlong],
                 slots: cython.pointer[cython.longlong],
                 owners: cython.pointer[cython.int]) -> cython.void:
    """Token ``j`` of request ``i`` sits at ``x = context_len - query_len + j``; its KV slot
    is ``table[i, x // page] * page + x % page`` (``shift >= 0``: the page is ``1 <<
    shift``). Writes the ``t`` real tokens, then pads up to ``pt``."""
    i: cython.Py_ssize_t
    j: cython.Py_ssize_t
    k: cython.Py_ssize_t = 0
    q: cython.longlong
    c: cython.longlong
    x: cython.longlong
    col: cython.longlong
    off: cython.longlong
    for i in range(n):
        q = cython.cast(cython.longlong, own_q[i])
        c = cython.cast(cython.longlong, own_c[i])
        for j in range(q):
            x = c - q + j
            if positions:
                positions[k] = x
            if slots:
                if shift >= 0:
                    col = x >> shift
                    off = x & (page - 1)
                else:
                    col = x // page
                    off = x % page
                slots[k] = cython.cast(cython.longlong, table[i * width + col]) * page + off
            if owners:
                owners[k] = cython.cast(cython.int, i)
            k += 1
    for k in range(t, pt):
        if positions:
            positions[k] = 0
        if slots:
            slots[k] = -1
        if owners:
            owners[k] = -1


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def write_prefix(out: cython.pointer[cython.int], values: cython.pointer[cython.int],
                 n: cython.Py_ssize_t, p: cython.Py_ssize_t) -> cython.void:
    """``out[0..p]``: the exclusive prefix of ``values[0..n)``, its total repeated after."""
    acc: cython.longlong = 0
    i: cython.Py_ssize_t
    out[0] = 0
    for i in range(n):
        acc += cython.cast(cython.longlong, values[i])
        out[i + 1] = cython.cast(cython.int, acc)
    for i in range(n, p):
        out[i + 1] = cython.cast(cython.int, acc)


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def write_padded(out: cython.pointer[cython.int], values: cython.pointer[cython.int],
                 n: cython.Py_ssize_t, p: cython.Py_ssize_t) -> cython.void:
    """``out[0..p)``: ``values[0..n)``, then 0."""
    i: cython.Py_ssize_t
    for i in range(n):
        out[i] = values[i]
    for i in range(n, p):
        out[i] = 0


# This source is compiled by Cython, as ``h2d_core._layout_writes_native``, when the package
# is built; run interpreted, it only checks that build is there (required): its functions
# are reached through C only.
if not cython.compiled:
    from block_tables.native import require_extension

    require_extension("h2d_core._layout_writes_native")
