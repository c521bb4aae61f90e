# The C declarations of completions.py (compiled as h2d_core._completions_native): the
# slots' completion record, which the compiled epoch (epoch.py) calls through C.
# Meanings: completions.py.
cdef class SlotCompletions:
    cdef readonly Py_ssize_t num_slots
    # the slots' driver events (a launch.SlotEvents), or None: torch_events instead
    cdef readonly object driver_events
    cdef readonly list torch_events
    # begin() calls that asked the driver nothing: the slot was known complete
    cdef public long long checks_skipped
    # the epoch's last enqueue was a publication graph that recorded the slot's event
    cdef public bint graph_recorded
    cdef list _recorded
    # driver events attach() replaced: kept alive, the graphs bound with them record them
    cdef list _replaced
    cdef long long _record_seq
    cdef long long _synced_seq
    cdef long long _done_seq
    cdef long long _done_stream
    cdef long long _slot_seq[64]
    cdef long long _slot_stream[64]
    cpdef long long wait(self, Py_ssize_t s) except? -1
    cpdef record(self, Py_ssize_t s, object stream_id, object stream)
    cdef bint _known_complete(self, Py_ssize_t s) noexcept
    cdef void _waited(self, Py_ssize_t s) noexcept
