/* Compiled hot paths of h2d_core (built into the wheel by hatch_build.py; the Python
 * fallback in count_batch.py produces the same state).
 *
 * store_counts: record a CountBatch's validated counts in one slot's group record
 *       (count_batch.CountBatch.set); any value the fast path does not accept returns
 *       None before the first write, and the Python path raises the specific error.
 * bind_events / event_record / event_wait: the slots' completion events recorded and
 *       waited on through the driver's function pointers (launch.py).
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

/* One CountBatch member in one slot's record. */
typedef struct {
    Py_ssize_t index;    /* member index in the record */
    int64_t unit_bytes;
    int64_t capacity;    /* largest count the fast path accepts (-1: never) */
} Entry;

typedef struct {
    Py_ssize_t count;
    Entry entries[];
} Batch;

static void batch_free(PyObject *capsule)
{
    Batch *b = (Batch *)PyCapsule_GetPointer(capsule, "h2d_count_batch");
    if (b != NULL)
        PyMem_Free(b);
}

/* bind_counts(entries) -> capsule
 * entries: tuple of (member index, unit bytes, capacity or -1). */
static PyObject *bind_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyTuple_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "bind_counts(entries tuple)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    Batch *b = PyMem_Calloc(1, sizeof(Batch) + (size_t)n * sizeof(Entry));
    if (b == NULL)
        return PyErr_NoMemory();
    b->count = n;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *e = PyTuple_GET_ITEM(args[0], k);
        int64_t idx;
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3 ||
            as_i64(PyTuple_GET_ITEM(e, 0), &idx) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 1), &b->entries[k].unit_bytes) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 2), &b->entries[k].capacity) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "bind_counts: malformed entry");
            goto fail;
        }
        b->entries[k].index = (Py_ssize_t)idx;
    }
    PyObject *capsule = PyCapsule_New(b, "h2d_count_batch", batch_free);
    if (capsule != NULL)
        return capsule;
fail:
    PyMem_Free(b);
    return NULL;
}

/* store_counts(bound, counts_list, values, active, count_bytes)
 * -> (active, count_bytes), or None when a value is not a plain int in
 *    [0, capacity] or None (nothing written: the Python path raises the error). */
static PyObject *store_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "store_counts takes 5 arguments");
        return NULL;
    }
    Batch *b = (Batch *)PyCapsule_GetPointer(args[0], "h2d_count_batch");
    if (b == NULL)
        return NULL;
    PyObject *counts = args[1], *values = args[2];
    int64_t active, count_bytes;
    if (!PyList_CheckExact(counts) || !PyTuple_CheckExact(values) ||
        PyTuple_GET_SIZE(values) != b->count) {
        PyErr_SetString(PyExc_TypeError, "store_counts: counts list and values tuple");
        return NULL;
    }
    if (as_i64(args[3], &active) < 0 || as_i64(args[4], &count_bytes) < 0)
        return NULL;
    /* check every value first */
    for (Py_ssize_t k = 0; k < b->count; k++) {
        PyObject *v = PyTuple_GET_ITEM(values, k);
        if (b->entries[k].index >= PyList_GET_SIZE(counts)) {
            PyErr_SetString(PyExc_IndexError, "store_counts: member index past the record");
            return NULL;
        }
        PyObject *old = PyList_GET_ITEM(counts, b->entries[k].index);
        if (old != Py_None && !PyLong_CheckExact(old))
            Py_RETURN_NONE; /* not a count this store wrote: the Python path decides */
        if (v == Py_None)
            continue;
        if (!PyLong_CheckExact(v))
            Py_RETURN_NONE;
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x < 0 || x > b->entries[k].capacity)
            Py_RETURN_NONE;
    }
    for (Py_ssize_t k = 0; k < b->count; k++) {
        Entry *e = &b->entries[k];
        PyObject *v = PyTuple_GET_ITEM(values, k);
        PyObject *old = PyList_GET_ITEM(counts, e->index);
        int64_t old_n = 0;
        if (old != Py_None && as_i64(old, &old_n) < 0)
            return NULL;
        if (v == Py_None) {
            if (old == Py_None)
                continue;
            active -= 1;
            count_bytes -= old_n * e->unit_bytes;
        } else {
            int64_t nbytes = PyLong_AsLongLong(v) * e->unit_bytes;
            if (old == Py_None) {
                active += 1;
                count_bytes += nbytes;
            } else {
                count_bytes += nbytes - old_n * e->unit_bytes;
            }
        }
        Py_INCREF(v);
        PyList_SET_ITEM(counts, e->index, v);
        Py_DECREF(old);
    }
    return Py_BuildValue("(LL)", (long long)active, (long long)count_bytes);
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
    {"bind_counts", (PyCFunction)(void (*)(void))bind_counts, METH_FASTCALL, NULL},
    {"store_counts", (PyCFunction)(void (*)(void))store_counts, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_h2d_core_native", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__h2d_core_native(void) { return PyModule_Create(&module); }
