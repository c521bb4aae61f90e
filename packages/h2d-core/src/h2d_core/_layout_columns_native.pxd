# The C declarations of layout_columns.py (compiled as h2d_core._layout_columns_native),
# so the other compiled layout modules call them through C. Meanings: layout_columns.py.
cdef Py_ssize_t array_size(object value, int kind) noexcept
cdef int* int_data(object value) noexcept
cdef float* float_data(object value) noexcept
cdef long long* long_data(object value) noexcept
cdef void copy_ints(int* src, int* dst, Py_ssize_t m) noexcept
cdef long long sum_ints(object value, Py_ssize_t size) noexcept
cdef long long check_columns(str name, tuple columns, object values, Py_ssize_t n,
                             Py_ssize_t t, long long[::1] sums) except? -1
cdef int copy_column(tuple spec, object value, Py_ssize_t m, Py_ssize_t end) except? -1
cdef int check_distinct(str name, tuple columns, tuple distinct, object values,
                        Py_ssize_t n, object sort_keys, long long* stamp) except? -1
