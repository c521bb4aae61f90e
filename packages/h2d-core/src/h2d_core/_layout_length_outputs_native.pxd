# The C declarations of layout_length_outputs.py (compiled as
# h2d_core._layout_length_outputs_native): the outputs of the lengths alone, bound. Meanings:
# layout_length_outputs.py.
from h2d_core._layout_outputs_native cimport BoundOutput

cdef class LastPageLensOutput(BoundOutput):
    cdef int[::1] out
    cdef long long page
    cdef int shift

cdef class ContextPrefixOutput(BoundOutput):
    cdef int[::1] out
    cdef long long cap

cdef class TokenPrefixOutput(BoundOutput):
    cdef int[::1] out
