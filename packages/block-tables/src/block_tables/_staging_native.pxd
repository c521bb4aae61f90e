# The C declaration of staging.py's TableStaging (compiled as block_tables._staging_native):
# its fields and compiled methods, so a compiled publisher (h2d_core.table_stage) calls it
# through C, not through Python attribute lookups. Field meanings: staging.py.
cdef class TableStaging:
    cdef readonly object result
    cdef readonly object found
    cdef readonly Py_ssize_t pending_slot
    cdef readonly bint pending_unchanged
    cdef tuple _snapshots
    cdef tuple _bounds
    cdef tuple _pool_limits
    cdef tuple _stored_keys
    cdef Py_ssize_t[::1] _metas
    cdef long long _row_bytes
    cdef long long _max_ranges
    cdef bint _ranged
    cdef tuple _keys
    cdef object _params_obj
    cdef long long[::1] _params
    cdef long long[::1] _result
    cdef long long[::1] _limit_ranges
    cdef long long[::1] _limit_bytes
    cdef bint _pub_valid
    cdef Py_ssize_t _pub_slot
    cdef long long _pub_revision
    cdef Py_ssize_t _pub_rows
    cdef Py_ssize_t _pub_spare
    cdef long long _pend_revision
    cdef Py_ssize_t _pend_rows
    cdef Py_ssize_t _spare
    cdef object _pub_object

    cpdef forget(self)
    cpdef clear_pending(self)
    cpdef commit(self)
    cpdef prepare(self, Py_ssize_t slot, object rows, object required_pages,
                  object pad_row=*, Py_ssize_t pad=*, Py_ssize_t padding=*)
    cpdef int decide(self, Py_ssize_t slot, Py_ssize_t num_rows, object range_table,
                     Py_ssize_t first_row, Py_ssize_t tag)
