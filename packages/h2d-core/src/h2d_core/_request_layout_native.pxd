# The C declarations of request_layout.py (compiled as h2d_core._request_layout_native): the
# layout's fields and its per-step calls, which compiled callers reach through C. Meanings:
# request_layout.py.
cdef class RequestLayout:
    cdef readonly str name
    cdef readonly long long page_size
    cdef int _shift
    cdef int[:, ::1] _table
    cdef int[::1] _required
    cdef long long[::1] _positions
    cdef long long[::1] _slots
    cdef int[::1] _owners
    cdef int[::1] _cu_query
    cdef tuple _cu_copies
    cdef object _cu_array
    cdef object _required_view
    cdef int[::1] _kv_indptr
    cdef int[::1] _context
    # the registered outputs, bound (layout_outputs.py): checked in plan, written in write
    cdef tuple _outputs
    # per distinct column: (column index, low, stamp table or None: a sort), the stamp of
    # the last check (a table entry is stamp * 2**32 + request) and the sort's scratch
    cdef tuple _distinct
    cdef long long _stamp
    cdef object _sort_keys
    # the planned batch: a private copy of its lengths (the table's preparation runs
    # Python code between plan and write, which could change the caller's arrays)
    cdef int[::1] _q
    cdef int[::1] _c
    cdef Py_ssize_t _max_reqs
    cdef Py_ssize_t _max_tokens
    cdef Py_ssize_t _n
    cdef Py_ssize_t _p
    cdef Py_ssize_t _t
    cdef Py_ssize_t _pt
    cdef bint _planned
    cdef bint _paged
    # per column: (kind, out, per_token, pad, minimum or None, name, bounds or None); the
    # planned batch's values; the sums of the planned batch (and the next plan's scratch,
    # swapped in only when the whole batch passed)
    cdef tuple _columns
    cdef object _values
    # C integers, not a list: a sum above 256 stored in a list boxes an int per step
    cdef long long[::1] _sums
    cdef long long[::1] _spare_sums
    # per plan: (flat out, ratio, window, tail, capacity, graph, name)
    cdef tuple _plans
    # per plan, the last written batch's published rows and its real rows: lists the
    # layout updates in place (read them, never change them), so a compiled caller
    # reads the counts without a tuple per plan (:meth:`plan_rows` gives one pair)
    cdef readonly list plan_published
    cdef readonly list plan_real
    # the planned batch's request and token counts, real and padded
    cdef readonly Py_ssize_t num_reqs
    cdef readonly Py_ssize_t padded_reqs
    cdef readonly Py_ssize_t num_tokens
    cdef readonly Py_ssize_t padded_tokens
    # the planned batch's shortest and longest query (0 for an empty batch): a uniform
    # width, or the widest request, without another pass over the lengths
    cdef readonly int min_query_len
    cdef readonly int max_query_len
    # bit k set: request column k holds one value (bit for bit) for every request of the
    # planned batch
    cdef readonly long long uniform_mask
    # the planned batch's KV pages in all (what :meth:`write` writes the table's rows for)
    cdef readonly long long kv_pages
    # the arrays, as bound (the memoryviews above are their compiled views)
    cdef readonly dict arrays
    # the planned batch's counts as int64 (see meta_address), and their compiled view
    cdef object _meta
    cdef long long[::1] _metav
    cpdef Py_ssize_t plan(self, object query_lens, object context_lens,
                          Py_ssize_t padded_reqs, Py_ssize_t padded_tokens, object values=*)
    cpdef plan_step(self, object query_lens, object context_lens, Py_ssize_t padded_reqs,
                    Py_ssize_t padded_tokens, object values)
    cpdef write(self)
