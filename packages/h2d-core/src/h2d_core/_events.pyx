# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The slots' completion events through the GPU driver (``h2d_core._events_native``).

``bind_events`` fixes one event handle per slot and the driver's record / query /
synchronize entry points (addresses from :meth:`h2d_kernels.DeviceDriver.address`, so
nothing here names CUDA or HIP: both runtimes have these calls with the same signatures
and status codes). ``event_record`` and ``event_wait`` then cost one driver call each
(a wait on an event that already completed is one query); through torch's event objects
each costs ~1 µs of host time (docs/benchmarks.md, "CUDA call costs"). They run once per
step in :meth:`~h2d_core.state.H2DRunnerState.begin` / ``finish``, so this is compiled.

Python sees exactly what the C module this replaces (``_core_native.c``) showed: three
builtin functions that take positional arguments only, a ``PyCapsule`` named
``"h2d_events"`` as the binding, the same exceptions with the same messages, and the
arguments checked in the same order (the first bad one is the one reported). To keep
that and the C module's call cost, the three functions are registered as
``METH_FASTCALL`` builtins through the ``PyMethodDef`` table at the end: a Cython ``def``
would also take keywords (``METH_FASTCALL | METH_KEYWORDS``), whose argument parsing
costs ~50 instructions per call and words its errors differently.
"""

from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsSsize_t
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport PyCFunction, PyMethodDef, PyObject
from cpython.pycapsule cimport (PyCapsule_CheckExact, PyCapsule_GetContext, PyCapsule_GetName,
                               PyCapsule_GetPointer, PyCapsule_New, PyCapsule_SetContext)
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport int64_t, intptr_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef extern from "Python.h":
    enum: METH_FASTCALL
    object PyCFunction_NewEx(PyMethodDef *ml, PyObject *self, object module)

# The driver's entry points, called without the GIL where they may block. The driver
# returns its status code (0: success) and never raises, hence noexcept.
ctypedef int (*event_record_fn)(void *event, void *stream) noexcept nogil
ctypedef int (*event_fn)(void *event) noexcept nogil

# CUDA_ERROR_NOT_READY / hipErrorNotReady: an event query on work still pending
cdef enum:
    NOT_READY = 600

# The capsules' name. Those made here carry this very pointer as their name and the binding
# also as their context: events_slot knows them by one pointer compare instead of
# PyCapsule_GetPointer's strcmp. Any other object goes through PyCapsule_GetPointer (its
# ValueError; a capsule named "h2d_events" made elsewhere is taken, as before).
cdef const char *CAPSULE = b"h2d_events"


cdef struct Events:
    Py_ssize_t count
    event_record_fn record
    event_fn query
    event_fn synchronize
    PyObject *owner  # a strong reference: whatever owns the events (destroys them)
    void **events  # count handles, allocated right after this struct (one block)


# ---------------------------------------------------------------- checks and errors
# The errors are raised from functions of their own, so the hot paths do not carry the
# message formatting (and the registers it needs).

cdef int raise_slot_error(Py_ssize_t slot, Py_ssize_t count) except -1:
    raise IndexError(f"slot {slot} is not in [0, {count})")


cdef int raise_driver_error(Events *e, str call, int rc) except -1:
    # Named by the runtime's own entry point when the owner carries the driver's symbols
    # (h2d_kernels.driver.DriverSymbols: cuEventRecord or hipEventRecord), else neutrally.
    owner = <object>e.owner
    name = getattr(owner, call, None)
    runtime = getattr(owner, "runtime", None)
    if type(name) is not str or type(runtime) is not str:
        name, runtime = call, "driver"
    raise RuntimeError(f"{name} failed with {runtime} error {rc}")


cdef int raise_overflow() except -1:
    raise OverflowError("int too big to convert")  # PyLong_AsLongLong's message


cdef inline int64_t as_i64(object o) except? -1:
    """``PyLong_AsLongLong(o)`` (which the C module called), without its slow path: an int
    of more than one digit (any pointer or stream handle) goes through
    ``_PyLong_AsByteArray`` there (~200 instructions); this reads the digits in place. The
    same values and errors (TypeError from ``__index__``, the same OverflowError)."""
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(o, &overflow)
    if overflow:
        raise_overflow()
    return v


cdef inline Events *events_slot(object capsule, object slot, Py_ssize_t *s) except NULL:
    """The binding and the checked slot index (IndexError outside [0, count))."""
    cdef Events *e
    if PyCapsule_CheckExact(capsule) and PyCapsule_GetName(capsule) == CAPSULE:
        e = <Events *>PyCapsule_GetContext(capsule)
    else:
        e = <Events *>PyCapsule_GetPointer(capsule, CAPSULE)
    s[0] = PyLong_AsSsize_t(slot)  # ints only (no __index__), as in the C module
    if s[0] < 0 or s[0] >= e.count:
        raise_slot_error(s[0], e.count)
    return e


cdef void events_free(object capsule) noexcept:
    """The capsule's destructor: drop the owner reference and the one allocation."""
    cdef Events *e = <Events *>PyCapsule_GetPointer(capsule, CAPSULE)
    if e == NULL:
        return
    Py_XDECREF(e.owner)
    PyMem_Free(e)


# ---------------------------------------------------------------- the three functions
# Each receives the positional arguments as a vector (METH_FASTCALL; borrowed references).

cdef object c_bind_events(PyObject *module, PyObject **args, Py_ssize_t nargs):
    """bind_events(events, record_fn, query_fn, synchronize_fn, owner) -> capsule

    ``events``: a tuple of event handles (ints), one per slot; the three functions are
    driver entry-point addresses (ints, none 0); ``owner`` is kept alive as long as the
    capsule (the driver's symbols, ``h2d_kernels.driver.DriverSymbols``, whose names the
    errors use; or any object, or None: neutral names). Nothing is called here.
    """
    cdef Py_ssize_t n, k
    cdef int64_t record, query, sync
    cdef Events *e
    if nargs != 5 or type(<object>args[0]) is not tuple:  # PyTuple_CheckExact
        raise TypeError("bind_events(events tuple, record_fn, query_fn, synchronize_fn, owner)")
    events = <object>args[0]
    n = PyTuple_GET_SIZE(events)
    # TypeError / OverflowError here, in argument order, before anything is allocated
    record = as_i64(<object>args[1])
    query = as_i64(<object>args[2])
    sync = as_i64(<object>args[3])
    if record == 0 or query == 0 or sync == 0:
        raise ValueError("bind_events: null driver function address")
    e = <Events *>PyMem_Calloc(1, sizeof(Events) + <size_t>n * sizeof(void *))
    if e == NULL:
        raise MemoryError()
    e.events = <void **>(e + 1)  # sizeof(Events) keeps the pointer array aligned
    e.count = n
    e.record = <event_record_fn><intptr_t>record
    e.query = <event_fn><intptr_t>query
    e.synchronize = <event_fn><intptr_t>sync
    try:
        for k in range(n):
            e.events[k] = <void *><intptr_t>as_i64(<object>PyTuple_GET_ITEM(events, k))
        capsule = PyCapsule_New(e, CAPSULE, events_free)
    except BaseException:
        PyMem_Free(e)  # no capsule was made: nothing else refers to e
        raise
    PyCapsule_SetContext(capsule, e)  # events_slot's fast path reads it there
    # the capsule's destructor now owns e and drops this reference
    Py_INCREF(<object>args[4])
    e.owner = args[4]
    return capsule


cdef object c_event_record(PyObject *module, PyObject **args, Py_ssize_t nargs):
    """event_record(capsule, slot, stream): record the slot's event on the raw stream
    handle ``stream``; RuntimeError naming the driver's status when it fails."""
    cdef Py_ssize_t s = 0  # set by events_slot
    if nargs != 3:
        raise TypeError("event_record(capsule, slot, stream)")
    cdef Events *e = events_slot(<object>args[0], <object>args[1], &s)
    cdef int64_t stream = as_i64(<object>args[2])
    cdef int rc = e.record(e.events[s], <void *><intptr_t>stream)
    if rc:
        raise_driver_error(e, "event_record", rc)
    return None


cdef object c_event_wait(PyObject *module, PyObject **args, Py_ssize_t nargs):
    """event_wait(capsule, slot) -> host ns spent waiting for the slot's last recorded
    event (0 when it had completed: one query; at least 1 when it was pending). An event
    never recorded counts as completed."""
    cdef Py_ssize_t s = 0  # set by events_slot
    cdef timespec t0, t1
    cdef long long ns
    if nargs != 2:
        raise TypeError("event_wait(capsule, slot)")
    cdef Events *e = events_slot(<object>args[0], <object>args[1], &s)
    cdef void *event = e.events[s]
    cdef int rc = e.query(event)
    if rc == 0:
        return 0
    if rc != NOT_READY:
        raise_driver_error(e, "event_query", rc)
    clock_gettime(CLOCK_MONOTONIC, &t0)
    with nogil:  # other Python threads run while this one blocks in the driver
        rc = e.synchronize(event)
    clock_gettime(CLOCK_MONOTONIC, &t1)
    if rc:
        raise_driver_error(e, "event_synchronize", rc)
    ns = <long long>(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec)
    return ns if ns > 0 else 1


# ---------------------------------------------------------------- the module's functions
# Builtins with this module as __module__ and no self (NULL: errors are worded as for the
# C module's functions, "h2d_core._events_native.event_wait() takes no keyword
# arguments"; only __self__ differs, None instead of the module). The table is static.
cdef PyMethodDef METHODS[3]
METHODS[0] = PyMethodDef(
    ml_name=b"bind_events", ml_meth=<PyCFunction><void *>c_bind_events, ml_flags=METH_FASTCALL,
    ml_doc=b"bind_events(events, record_fn, query_fn, synchronize_fn, owner) -> binding capsule")
METHODS[1] = PyMethodDef(
    ml_name=b"event_record", ml_meth=<PyCFunction><void *>c_event_record,
    ml_flags=METH_FASTCALL, ml_doc=b"event_record(capsule, slot, stream): record the slot's event")
METHODS[2] = PyMethodDef(
    ml_name=b"event_wait", ml_meth=<PyCFunction><void *>c_event_wait, ml_flags=METH_FASTCALL,
    ml_doc=b"event_wait(capsule, slot) -> host ns waited for the slot's event (0: completed)")
bind_events = PyCFunction_NewEx(&METHODS[0], NULL, __name__)
event_record = PyCFunction_NewEx(&METHODS[1], NULL, __name__)
event_wait = PyCFunction_NewEx(&METHODS[2], NULL, __name__)
