# The C declarations of layout_writes.py (compiled as h2d_core._layout_writes_native): the
# layout core's writes, which the compiled layout (request_layout.py) calls. Meanings:
# layout_writes.py.
cdef void write_tokens(int* own_q, int* own_c, Py_ssize_t n, Py_ssize_t t, Py_ssize_t pt,
                       int* table, Py_ssize_t width, long long page, int shift,
                       long long* positions, long long* slots, int* owners) noexcept
cdef void write_prefix(int* out, int* values, Py_ssize_t n, Py_ssize_t p) noexcept
cdef void write_padded(int* out, int* values, Py_ssize_t n, Py_ssize_t p) noexcept
