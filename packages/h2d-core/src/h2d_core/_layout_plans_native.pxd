# The C declarations of layout_plans.py (compiled as h2d_core._layout_plans_native): the plan
# steps the compiled layout (request_layout.py) calls through C. Meanings: layout_plans.py.
cdef int check_plans(str name, tuple plans, int* qv, int* cv, Py_ssize_t n,
                     long long padded_reqs, long long width_q) except? -1
cdef int publish_plans(tuple plans, list published, long long padded_reqs,
                       long long width_q) except? -1
cdef int write_plans(tuple plans, int[::1] own_q, int[::1] own_c, Py_ssize_t n, list real,
                     list published) except? -1
cdef Py_ssize_t write_plan_rows(tuple spec, int[::1] own_q, int[::1] own_c, Py_ssize_t n,
                                Py_ssize_t count) except? -1
