# The C declarations of layout_outputs.py (compiled as h2d_core._layout_outputs_native): the
# registered outputs' fields and their check/write methods, which the compiled layout
# (request_layout.py) calls through C. Meanings: layout_outputs.py.
from h2d_core._layout_sums_native cimport BoundSum

cdef class BoundOutput:
    cdef int check(self, str name, object values, int* qv, int* cv, Py_ssize_t n) except? -1
    cdef int write(self, object values, int* own_q, int* own_c, Py_ssize_t n, Py_ssize_t p,
                   Py_ssize_t t, Py_ssize_t pt) except? -1

cdef class RequestSums(BoundOutput):
    cdef tuple sums

cdef class TokenPlanesOutput(BoundOutput):
    cdef object out
    cdef Py_ssize_t column
    cdef Py_ssize_t planes

cdef class VerifyRowsOutput(BoundOutput):
    cdef Py_ssize_t drafts
    cdef object targets
    cdef object prefix
    cdef object bonus
    cdef long long capacity

cdef class RequestBoundOutput(BoundOutput):
    cdef BoundSum value
    cdef long long low
    cdef long long high
    cdef str rule
    cdef str note

cdef class RampRowsOutput(BoundOutput):
    cdef str output
    cdef object out
    cdef Py_ssize_t width
    cdef BoundSum start
    cdef BoundSum count
    cdef int fill
    cdef bint checked

cdef class RequestValuesOutput(BoundOutput):
    cdef str output
    cdef object out
    cdef BoundSum value
    cdef int fill
    cdef bint keep_padding
    cdef bint checked
