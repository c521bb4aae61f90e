# The C declarations of layout_lengths.py (compiled as h2d_core._layout_lengths_native): the
# layout core's pass over the lengths, which the compiled layout (request_layout.py) calls.
# Meanings: layout_lengths.py.
cdef int check_lengths(str name, int* qv, int* cv, Py_ssize_t n, long long page, int shift,
                       Py_ssize_t width, bint paged, long long* counts) except? -1
cdef void keep_lengths(int* qv, int* cv, Py_ssize_t n, Py_ssize_t p, long long page,
                       int shift, int* own_q, int* own_c, int* required) noexcept
