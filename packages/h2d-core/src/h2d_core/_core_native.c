/* The slots' completion events of h2d_core (built into the wheel by hatch_build.py):
 * bind_events / event_record / event_wait record and wait on them through the driver's
 * function pointers (launch.py; torch events run where this is not installed).
 * The count and range rules are records.py, compiled by Cython with the wheel.
 *
 * The packed publication itself (header, packing, graph launch) belongs to h2d_kernels
 * (PackedGroup.publish). No CUDA header is needed: driver entry points arrive as
 * addresses and handles as integers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>


static int as_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* ---------------------------------------------------------------- slot events */
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*event_fn)(void *event);

#define NOT_READY 600 /* CUDA_ERROR_NOT_READY: cuEventQuery on pending work */

typedef struct {
    Py_ssize_t count;
    event_record_fn record;
    event_fn query, synchronize;
    PyObject *owner; /* owns the events (destroys them when collected) */
    void *events[];
} Events;

static void events_free(PyObject *capsule)
{
    Events *e = (Events *)PyCapsule_GetPointer(capsule, "h2d_events");
    if (e == NULL)
        return;
    Py_XDECREF(e->owner);
    PyMem_Free(e);
}

/* bind_events(events, record_fn, query_fn, synchronize_fn, owner) -> capsule
 * events: tuple of CUevent handles, one per slot. */
static PyObject *bind_events(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyTuple_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "bind_events(events tuple, record_fn, query_fn, synchronize_fn, owner)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    Events *e = PyMem_Calloc(1, sizeof(Events) + (size_t)n * sizeof(void *));
    if (e == NULL)
        return PyErr_NoMemory();
    e->count = n;
    int64_t record, query, sync;
    if (as_i64(args[1], &record) < 0 || as_i64(args[2], &query) < 0 ||
        as_i64(args[3], &sync) < 0)
        goto fail;
    if (!record || !query || !sync) {
        PyErr_SetString(PyExc_ValueError, "bind_events: null driver function address");
        goto fail;
    }
    e->record = (event_record_fn)(intptr_t)record;
    e->query = (event_fn)(intptr_t)query;
    e->synchronize = (event_fn)(intptr_t)sync;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t h;
        if (as_i64(PyTuple_GET_ITEM(args[0], k), &h) < 0)
            goto fail;
        e->events[k] = (void *)(intptr_t)h;
    }
    e->owner = Py_NewRef(args[4]);
    PyObject *capsule = PyCapsule_New(e, "h2d_events", events_free);
    if (capsule != NULL)
        return capsule;
    Py_DECREF(e->owner);
fail:
    PyMem_Free(e);
    return NULL;
}

static Events *events_slot(PyObject *const *args, Py_ssize_t *slot)
{
    Events *e = (Events *)PyCapsule_GetPointer(args[0], "h2d_events");
    if (e == NULL)
        return NULL;
    Py_ssize_t s = PyLong_AsSsize_t(args[1]);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    if (s < 0 || s >= e->count) {
        PyErr_Format(PyExc_IndexError, "slot %zd is not in [0, %zd)", s, e->count);
        return NULL;
    }
    *slot = s;
    return e;
}

/* event_record(capsule, slot, stream): record the slot's event on the raw stream. */
static PyObject *event_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "event_record(capsule, slot, stream)");
        return NULL;
    }
    Py_ssize_t s;
    Events *e = events_slot(args, &s);
    int64_t stream;
    if (e == NULL || as_i64(args[2], &stream) < 0)
        return NULL;
    int rc = e->record(e->events[s], (void *)(intptr_t)stream);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "cuEventRecord failed with CUDA error %d", rc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* event_wait(capsule, slot) -> host ns spent waiting (0 when the event had completed). */
static PyObject *event_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "event_wait(capsule, slot)");
        return NULL;
    }
    Py_ssize_t s;
    Events *e = events_slot(args, &s);
    if (e == NULL)
        return NULL;
    int rc = e->query(e->events[s]);
    if (rc == 0)
        return PyLong_FromLong(0);
    if (rc != NOT_READY) {
        PyErr_Format(PyExc_RuntimeError, "cuEventQuery failed with CUDA error %d", rc);
        return NULL;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    Py_BEGIN_ALLOW_THREADS
    rc = e->synchronize(e->events[s]);
    Py_END_ALLOW_THREADS
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "cuEventSynchronize failed with CUDA error %d", rc);
        return NULL;
    }
    long long ns = (long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
    return PyLong_FromLongLong(ns > 0 ? ns : 1);
}

static PyMethodDef methods[] = {
    {"bind_events", (PyCFunction)(void (*)(void))bind_events, METH_FASTCALL, NULL},
    {"event_record", (PyCFunction)(void (*)(void))event_record, METH_FASTCALL, NULL},
    {"event_wait", (PyCFunction)(void (*)(void))event_wait, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_h2d_core_native", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__h2d_core_native(void) { return PyModule_Create(&module); }
