# The C declarations of layout_sums.py (compiled as h2d_core._layout_sums_native): a bound
# RequestSum, which the compiled outputs (layout_outputs.py) evaluate through C. Meanings:
# layout_sums.py.
cdef class BoundSum:
    cdef int[::1] columns
    cdef int[::1] otherwise
    cdef long long[::1] coefs
    cdef long long offset
    cdef str label
    cdef tuple names
    cdef long long[::1] acc
    cdef long long* evaluate(self, object values, int* qv, Py_ssize_t n) noexcept
    cdef long long* result(self) noexcept
