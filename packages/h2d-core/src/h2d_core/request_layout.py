"""The per-token layout of a batch of requests over a paged KV cache, in one pass.

Every attention family derives the same things from a batch's query and context lengths
and its page table: where each token sits (position), where its key/value goes (KV slot),
the query prefix (``cu_seqlens_q``), the KV page prefix (``kv_indptr``), which request
owns each token, and how many pages each request needs. :class:`RequestLayout` binds the
output arrays once and writes all of them, graph padding included, with two calls:

1. :meth:`RequestLayout.plan` checks the batch, keeps a private copy of its lengths and
   computes ``required_pages`` (for the block-table preparation); it writes no output;
2. :meth:`RequestLayout.write`, after the page table is prepared, writes every bound
   output from that copy and the table.

Padding (requests ``n..padded_reqs``, tokens ``t..padded_tokens``): positions 0, KV slots
-1 (no write), token owners -1, context lengths 0, required pages 0, and the prefixes
repeat their total (padded requests own no tokens and no pages; padded tokens are
queries of no tokens).

Compiled (Cython's pure-Python mode) as ``h2d_core._request_layout_native``, required.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import RequestLayoutError
from .layout_arrays import layout_arrays
from .layout_binding import (
    bind_columns,
    bind_outputs,
    distinct_columns,
)
from .layout_length_outputs import length_outputs
from .layout_plans import bind_plans
from .layout_records import LayoutColumn, LayoutOutput, LayoutPlan
from .layout_refusals import (
    lengths_input_error,
)

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:  # the column and output steps through C (their .pxd declarations)
    from cython.cimports.h2d_core._layout_columns_native import (
        array_size,
        check_columns,
        check_distinct,
        copy_column,
        copy_ints,
        int_data,
    )
    from cython.cimports.h2d_core._layout_lengths_native import check_lengths, keep_lengths
    from cython.cimports.h2d_core._layout_outputs_native import BoundOutput
    from cython.cimports.h2d_core._layout_plans_native import (
        check_plans,
        publish_plans,
        write_plans,
    )
    from cython.cimports.h2d_core._layout_writes_native import (
        write_padded,
        write_prefix,
        write_tokens,
    )

#: the fields of RequestLayout.meta_address's int64 counts
META_NUM_REQS, META_PADDED_REQS, META_NUM_TOKENS, META_PADDED_TOKENS = 0, 1, 2, 3
META_MIN_QUERY, META_MAX_QUERY, META_UNIFORM_MASK, META_KV_PAGES = 4, 5, 6, 7
META_SIZE = 8
_INT32_MAX = cython.declare(cython.longlong, 2**31 - 1)  # a C constant: a comparison boxes nothing
#: ``padded_tokens`` of :meth:`RequestLayout.plan` for an eager step: exactly the tokens
EXACT_TOKENS = -2


@cython.cclass
class RequestLayout:
    """Positions, KV slots, prefixes and token owners of a batch, over one page table.

    ``table`` is the (pinned CPU) page table the batch's rows are prepared into, int32
    ``[rows, width]``; ``required_pages`` (int32, >= rows) receives each request's page
    count in :meth:`plan`. Both may be None for a layout without pages (token inputs:
    query prefixes and columns), which then takes no ``slot_mapping`` or
    ``kv_page_indptr``. Every other output is optional (``None``: not written):
    ``positions`` / ``slot_mapping`` int64 ``[tokens]``, ``token_requests`` int32
    ``[tokens]``, ``cu_query`` / ``kv_page_indptr`` int32 ``[requests + 1]`` (``cu_query``
    may be a tuple of such arrays: the same prefix goes to each),
    ``context_lens`` int32 ``[requests]``; and the outputs of the lengths alone
    (:mod:`h2d_core.layout_length_outputs`): ``token_prefix`` int32 ``[tokens + 1]`` (a
    per-token kernel's ``qo_indptr``), ``last_page_lens`` int32 ``[requests]`` and
    ``context_prefix`` int32 ``[requests + 1]`` (the prefix of ``min(context_len,
    context_cap)``, refused past int32).
    ``outputs``: what a family registers (:mod:`h2d_core.layout_records`), checked and
    written in the same pass.
    ``name`` prefixes every error message.

    The fields are declared in ``_request_layout_native.pxd``.
    """

    _table: Any  # (for type checkers: Cython takes the .pxd's C types)
    _required_view: Any
    _cu_array: Any
    _cu_query: Any
    _required: Any
    _values: Any

    @cython.annotation_typing(False)  # the checks below give the specific errors
    def __init__(
        self,
        name: str,
        page_size: int,
        table: np.ndarray | None,
        required_pages: np.ndarray | None,
        *,
        positions: np.ndarray | None = None,
        slot_mapping: np.ndarray | None = None,
        token_requests: np.ndarray | None = None,
        cu_query: np.ndarray | tuple[np.ndarray, ...] | None = None,
        kv_page_indptr: np.ndarray | None = None,
        context_lens: np.ndarray | None = None,
        token_prefix: np.ndarray | None = None,
        last_page_lens: np.ndarray | None = None,
        context_prefix: np.ndarray | None = None,
        context_cap: int | None = None,
        columns: Sequence[LayoutColumn] = (),
        plans: Sequence[LayoutPlan] = (),
        outputs: Sequence[LayoutOutput] = (),
    ) -> None:
        checked = layout_arrays(name, page_size, context_cap, {
            "table": table, "required_pages": required_pages, "positions": positions,
            "slot_mapping": slot_mapping, "token_requests": token_requests,
            "cu_query": cu_query, "kv_page_indptr": kv_page_indptr,
            "context_lens": context_lens, "token_prefix": token_prefix,
            "last_page_lens": last_page_lens, "context_prefix": context_prefix})
        cu_query, copies = checked.cu_query, checked.copies
        req_caps, tok_caps = checked.req_caps, checked.tok_caps
        self._paged = table is not None
        self.name = name
        self.page_size = page_size
        self._shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        self.arrays = checked.arrays
        bound = bind_columns(name, columns, self.arrays, req_caps, tok_caps)
        if len(bound) > 62:
            raise RequestLayoutError(f"{name}: at most 62 columns, got {len(bound)}")
        self._columns = tuple(bound)
        # the family's registered outputs, then those of the lengths alone
        self._outputs = bind_outputs(name, bound, outputs, self.arrays, req_caps,
                                     tok_caps) + length_outputs(
            page_size, self._shift, last_page_lens, context_prefix, context_cap, token_prefix)
        self._distinct = distinct_columns(name, columns, bound)
        self._stamp = 0
        self._sums = np.zeros(len(bound), np.int64)
        self._spare_sums = np.zeros(len(bound), np.int64)
        self._plans = tuple(bind_plans(name, plans, self.arrays))
        self.plan_published = [0] * len(self._plans)
        self.plan_real = [0] * len(self._plans)
        self._values = ()
        self._max_reqs = max(min(req_caps), 0) if req_caps else 0
        for registered in self._outputs:  # their per-request scratch, sized now
            registered.reserve(self._max_reqs)
        self._max_tokens = min(tok_caps) if tok_caps else _INT32_MAX
        if not self._paged:  # private stand-ins: page counts are computed, never read
            table = np.zeros((1, 1), dtype=np.int32)
            required_pages = np.zeros(self._max_reqs, dtype=np.int32)
        self._table = table
        self._required = required_pages
        self._positions = positions
        self._slots = slot_mapping
        self._owners = token_requests
        self._cu_query = cu_query
        self._cu_copies = copies
        self._cu_array = cu_query
        self._required_view = None
        self._kv_indptr = kv_page_indptr
        self._context = context_lens
        self._q = np.zeros(self._max_reqs, dtype=np.int32)
        self._c = np.zeros(self._max_reqs, dtype=np.int32)
        self._sort_keys = np.zeros(self._max_reqs if any(
            d[2] is None for d in self._distinct) else 0, dtype=np.int64)
        self._meta = np.zeros(META_SIZE, dtype=np.int64)
        self._metav = self._meta

    @property
    def meta_address(self) -> int:
        """The address of the planned batch's counts: int64 ``[num_reqs, padded_reqs,
        num_tokens, padded_tokens, min_query_len, max_query_len, uniform_mask,
        kv_pages]`` (``META_*`` indices), refreshed by each successful :meth:`plan`. A
        compiled caller reads them there: a count above 256 read as an attribute makes
        an int object."""
        return int(self._meta.ctypes.data)

    @property
    def max_reqs(self) -> int:
        """The most requests (padding included) the bound arrays hold."""
        return self._max_reqs

    @property
    def max_tokens(self) -> int:
        """The most tokens (padding included) the bound per-token arrays hold."""
        return self._max_tokens

    @property
    def required_pages(self) -> np.ndarray:
        """``required_pages[:padded_reqs]`` of the planned batch (what the table's
        ``prepare`` checks the rows against)."""
        if not self._paged:
            raise RequestLayoutError(f"{self.name}: a layout without a table has no pages")
        if self._required_view is None or self._required_view.size != self._p:
            self._required_view = self.arrays["required_pages"][: self._p]
        return self._required_view

    def plan_rows(self, k: int) -> tuple[int, int]:
        """Plan ``k``'s rows in the last written batch: (real rows, published rows)."""
        return self.plan_real[k], self.plan_published[k]

    def column_sum(self, k: int) -> int:
        """The sum of column ``k``'s values in the planned batch (columns bound without
        an output array only; 0 for the others)."""
        return self._sums[k]

    @cython.ccall
    @cython.boundscheck(False)  # every index is checked against the bound sizes first
    @cython.wraparound(False)
    def plan(self, query_lens: object, context_lens: object, padded_reqs: cython.Py_ssize_t,
             padded_tokens: cython.Py_ssize_t, values: Sequence[Any] = ()) -> cython.Py_ssize_t:
        """Check a batch and compute its ``required_pages``; returns its token count.

        ``query_lens[i]`` tokens of request ``i`` run this step at positions
        ``[context_lens[i] - query_lens[i], context_lens[i])``; both are 1-D int32 of the
        same length n. The batch is padded to ``padded_reqs`` requests (-1: n) and
        ``padded_tokens`` tokens (-1: ``padded_reqs`` times the widest query, at least 1,
        the graph grid of a decode step; ``EXACT_TOKENS`` (-2): exactly the batch's tokens,
        an eager step). ``values`` holds one array per bound column, in order (n values, or
        t per-token, of the column's dtype and bounds; it and they unchanged until
        :meth:`write`, which reads them again). Raises :class:`RequestLayoutError`
        (naming the request or column and the rule) before changing anything; sets
        :attr:`uniform_mask`, :attr:`min_query_len` and :attr:`max_query_len`.
        """
        name = self.name
        n: cython.Py_ssize_t = array_size(query_lens, 0)
        if n < 0:
            lengths_input_error(name, "query_lens", query_lens)
        nc: cython.Py_ssize_t = array_size(context_lens, 0)
        if nc < 0:
            lengths_input_error(name, "context_lens", context_lens)
        qv: cython.pointer[cython.int] = int_data(query_lens)
        cv: cython.pointer[cython.int] = int_data(context_lens)
        if nc != n:
            raise RequestLayoutError(
                f"{name}: context_lens has {nc} entries but query_lens has {n}; "
                "pass one of each per request")
        if n > self._max_reqs:
            raise RequestLayoutError(
                f"{name}: {n} requests exceed the bound arrays' capacity of "
                f"{self._max_reqs} requests; split the batch")
        if padded_reqs < 0:
            padded_reqs = n
        if not n <= padded_reqs <= self._max_reqs:
            raise RequestLayoutError(
                f"{name}: {padded_reqs} padded requests for {n} requests; the padded count "
                f"must lie in [{n}, {self._max_reqs}] (the bound arrays' capacity)")
        counts = cython.declare(cython.longlong[4])  # tokens, KV pages, the query bounds
        check_lengths(name, qv, cv, n, self.page_size, self._shift, self._table.shape[1],
                      self._paged, counts)
        t: cython.longlong = counts[0]
        total: cython.longlong = counts[1]
        lo: cython.int = cython.cast(cython.int, counts[2])
        hi: cython.int = cython.cast(cython.int, counts[3])
        if t > self._max_tokens:
            raise RequestLayoutError(
                f"{name}: {t} tokens exceed the bound arrays' capacity of "
                f"{self._max_tokens} tokens; split the batch")
        if padded_tokens == EXACT_TOKENS:  # eager: exactly the real tokens
            padded_tokens = t
        elif padded_tokens < 0:  # the graph grid: every padded request runs the widest query
            padded_tokens = padded_reqs * (hi if hi > 0 else 1)
        if not t <= padded_tokens <= self._max_tokens:
            raise RequestLayoutError(
                f"{name}: {padded_tokens} padded tokens for {t} tokens; the padded count "
                f"must lie in [{t}, {self._max_tokens}] (the bound arrays' capacity)")
        width_q: cython.longlong = hi if hi > 0 else 1
        if self._plans:
            check_plans(name, self._plans, qv, cv, n, padded_reqs, width_q)
        sums: cython.longlong[::1] = self._spare_sums
        mask: cython.longlong = check_columns(name, self._columns, values, n, t, sums)
        if self._distinct:
            check_distinct(name, self._columns, self._distinct, values, n, self._sort_keys,
                           cython.address(self._stamp))
        for registered in self._outputs:
            cython.cast(BoundOutput, registered).check(name, values, qv, cv, n)
        # the whole batch passed: nothing below raises
        self._spare_sums = self._sums
        self._sums = sums
        if self._plans:
            publish_plans(self._plans, self.plan_published, padded_reqs, width_q)
        keep_lengths(qv, cv, n, padded_reqs, self.page_size, self._shift,
                     cython.address(self._q[0]), cython.address(self._c[0]),
                     cython.address(self._required[0]))
        self._n = n
        self._p = padded_reqs
        self._t = t
        self._pt = padded_tokens
        self.kv_pages = total
        self._values = values  # read again by write (a copy would cost every step)
        self.num_reqs, self.padded_reqs = n, padded_reqs
        self.num_tokens, self.padded_tokens = t, padded_tokens
        self.uniform_mask = mask
        self.min_query_len = lo
        self.max_query_len = hi
        meta: cython.longlong[::1] = self._metav
        meta[0] = n
        meta[1] = padded_reqs
        meta[2] = t
        meta[3] = padded_tokens
        meta[4] = lo
        meta[5] = hi
        meta[6] = mask
        meta[7] = total
        self._planned = True
        return t

    @cython.ccall
    def plan_step(self, query_lens: object, context_lens: object,
                  padded_reqs: cython.Py_ssize_t, padded_tokens: cython.Py_ssize_t,
                  values: Sequence[Any]) -> None:
        """:meth:`plan` for a compiled caller: returns nothing (a token count above 256
        returned to Python would make an int object); the counts are at
        :attr:`meta_address`."""
        self.plan(query_lens, context_lens, padded_reqs, padded_tokens, values)

    @cython.ccall
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def write(self) -> None:
        """Write every bound output for the planned batch from the prepared table (its
        KV pages in all are :attr:`kv_pages`). Call once per :meth:`plan`, after the rows
        were prepared into ``table`` with ``required_pages``. Returns None: a compiled
        caller reads the counts it needs as C fields, and boxes no page total per step."""
        if not self._planned:
            raise RequestLayoutError(
                f"{self.name}: write() needs a planned batch; call plan() first (once "
                "per write)")
        self._planned = False
        n: cython.Py_ssize_t = self._n
        p: cython.Py_ssize_t = self._p
        t: cython.Py_ssize_t = self._t
        pt: cython.Py_ssize_t = self._pt
        own_q: cython.int[::1] = self._q
        own_c: cython.int[::1] = self._c
        # the private lengths' data (a memoryview's first item: an empty one is not read)
        q_data: cython.pointer[cython.int] = cython.address(own_q[0])
        c_data: cython.pointer[cython.int] = cython.address(own_c[0])
        positions: cython.pointer[cython.longlong] = cython.NULL
        slots: cython.pointer[cython.longlong] = cython.NULL
        owners: cython.pointer[cython.int] = cython.NULL
        if self._positions is not None:
            positions = cython.address(self._positions[0])
        if self._slots is not None:
            slots = cython.address(self._slots[0])
        if self._owners is not None:
            owners = cython.address(self._owners[0])
        if positions or slots or owners:
            write_tokens(q_data, c_data, n, t, pt, cython.address(self._table[0, 0]),
                         self._table.shape[1], self.page_size, self._shift, positions,
                         slots, owners)
        if self._cu_query is not None:
            write_prefix(cython.address(self._cu_query[0]), q_data, n, p)
            for copy in self._cu_copies:  # raw pointers: a memoryview made per call costs
                copy_ints(int_data(self._cu_array), int_data(copy), p + 1)  # more than the copy
        if self._kv_indptr is not None:  # padded requests need no pages: sum them all
            write_prefix(cython.address(self._kv_indptr[0]), cython.address(self._required[0]),
                         p, p)
        if self._context is not None:
            write_padded(cython.address(self._context[0]), c_data, n, p)
        values = self._values
        self._values = ()
        for registered in self._outputs:
            cython.cast(BoundOutput, registered).write(values, q_data, c_data, n, p, t, pt)
        spec: tuple
        for i in range(len(values)):
            spec = self._columns[i]
            if spec[1] is not None:
                copy_column(spec, values[i], t if spec[2] else n, pt if spec[2] else p)
        if self._plans:
            write_plans(self._plans, own_q, own_c, n, self.plan_real, self.plan_published)


# This source is compiled by Cython, as ``h2d_core._request_layout_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import layout_lengths, layout_writes  # noqa: F401 - built first: cimported here

    RequestLayout = require_extension(  # type: ignore[misc]
        "h2d_core._request_layout_native").RequestLayout

