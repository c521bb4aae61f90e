# The C declarations of records.py (compiled as h2d_core._records_native): a group record's
# fields and count/range rules, which the compiled count program (count_program.py) calls
# through C. Meanings: records.py.
cdef class GroupRecord

cdef class GroupCounters:
    cdef public long long publications
    cdef public long long bytes
    cdef public long long dmas
    cdef public long long scatters
    cdef public long long direct_copies
    cdef public long long direct_fallbacks
    cdef public long long second_publications
    cpdef count_packed(self, GroupRecord rec)
    cpdef count_publication(self, long long nbytes)

cdef class GroupRecord:
    cdef public object plan
    cdef public object packed
    cdef public list counts
    # per member, the last count stored, kept across epochs: the same count next epoch
    # stores this object again (a count above 256 would be a new int each epoch)
    cdef list _kept
    cdef readonly object range_table
    cdef readonly Py_ssize_t num_ranges
    # the table's data address (an int made once: what a packed publication reads)
    cdef readonly object range_table_address
    cdef long long[:, ::1] _rt
    cdef public set ranged
    cdef public long long range_bytes
    cdef public long long count_bytes
    cdef public long long active
    cdef public bint fused
    cpdef clear_counts(self)
    cpdef omit(self, Py_ssize_t i)
    cdef void _drop_ranges(self, Py_ssize_t i)
    cpdef store_count(self, Py_ssize_t i, long long n, long long unit_bytes)
    cpdef bint store_counts(self, tuple entries, tuple values)
    cpdef take_ranges(self, Py_ssize_t i, Py_ssize_t start, Py_ssize_t count, long long total)
    cpdef end_ranges(self)
    cpdef bint sent(self, Py_ssize_t i)
    cpdef long long range_room(self, Py_ssize_t i)
