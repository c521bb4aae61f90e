/* Compiled hot paths of h2d_core (built by block_tables.native; Python fallbacks in
 * packing.py and count_batch.py produce the same state and bytes).
 *
 * bind_publish / pack: copy staged members' used bytes and pending ranges into a packed
 *       arena's staging region and write their header rows (packing.pack).
 * store_counts: record a CountBatch's validated counts in one slot's group record
 *       (count_batch.CountBatch.set); any value the fast path does not accept returns
 *       None before the first write, and the Python path raises the specific error.
 * publish_packed: pack, then launch the arena's captured (DMA + scatter) graph with
 *       cuGraphLaunch through a function pointer (launch.py): one C call instead of the
 *       Python and ctypes layers around PackedArena.publish.
 * bind_events / event_record / event_wait: the slots' completion events recorded and
 *       waited on through the driver's function pointers (launch.py).
 *
 * No CUDA header is needed: driver entry points arrive as addresses and handles as
 * integers; their CUresult codes are reported, never interpreted beyond success.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define ALIGN 16

static inline int64_t align_up(int64_t n) { return (n + ALIGN - 1) & ~(int64_t)(ALIGN - 1); }

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
    int64_t inplace;     /* arena offset of an in-place member, else -1 */
    int64_t capacity;    /* largest count the fast path accepts (-1: never) */
} Entry;

typedef struct {
    Py_ssize_t count;
    int64_t *header_nbytes; /* NULL when the record is not packed */
    Py_ssize_t stride;      /* in int64 items */
    PyObject *owner;        /* keeps the header array alive */
    Entry entries[];
} Batch;

static void batch_free(PyObject *capsule)
{
    Batch *b = (Batch *)PyCapsule_GetPointer(capsule, "h2d_count_batch");
    if (b == NULL)
        return;
    Py_XDECREF(b->owner);
    PyMem_Free(b);
}

/* bind_counts(header_nbytes or None, entries) -> capsule
 * header_nbytes: the record's int64 byte-count column (a strided view is fine);
 * entries: tuple of (member index, unit bytes, inplace offset or -1, capacity or -1). */
static PyObject *bind_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind_counts(header_nbytes or None, entries tuple)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[1]);
    Batch *b = PyMem_Calloc(1, sizeof(Batch) + (size_t)n * sizeof(Entry));
    if (b == NULL)
        return PyErr_NoMemory();
    b->count = n;
    if (args[0] != Py_None) {
        Py_buffer v;
        if (PyObject_GetBuffer(args[0], &v, PyBUF_WRITABLE | PyBUF_STRIDES) < 0)
            goto fail;
        if (v.itemsize != 8 || v.ndim != 1 || v.strides[0] % 8) {
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_ValueError, "header_nbytes must be a 1-D int64 view");
            goto fail;
        }
        b->header_nbytes = v.buf;
        b->stride = v.strides[0] / 8;
        b->owner = Py_NewRef(args[0]);
        PyBuffer_Release(&v);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *e = PyTuple_GET_ITEM(args[1], k);
        int64_t idx;
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 4 ||
            as_i64(PyTuple_GET_ITEM(e, 0), &idx) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 1), &b->entries[k].unit_bytes) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 2), &b->entries[k].inplace) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 3), &b->entries[k].capacity) < 0) {
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
    Py_XDECREF(b->owner);
    PyMem_Free(b);
    return NULL;
}

/* store_counts(bound, counts_list, values, active, count_bytes, dma_end)
 * -> (active, count_bytes, dma_end), or None when a value is not a plain int in
 *    [0, capacity] or None (nothing written: the Python path raises the error). */
static PyObject *store_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "store_counts takes 6 arguments");
        return NULL;
    }
    Batch *b = (Batch *)PyCapsule_GetPointer(args[0], "h2d_count_batch");
    if (b == NULL)
        return NULL;
    PyObject *counts = args[1], *values = args[2];
    int64_t active, count_bytes, dma_end;
    if (!PyList_CheckExact(counts) || !PyTuple_CheckExact(values) ||
        PyTuple_GET_SIZE(values) != b->count) {
        PyErr_SetString(PyExc_TypeError, "store_counts: counts list and values tuple");
        return NULL;
    }
    if (as_i64(args[3], &active) < 0 || as_i64(args[4], &count_bytes) < 0 ||
        as_i64(args[5], &dma_end) < 0)
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
            if (b->header_nbytes)
                b->header_nbytes[e->index * b->stride] = 0;
        } else {
            int64_t nbytes = PyLong_AsLongLong(v) * e->unit_bytes;
            if (old == Py_None) {
                active += 1;
                count_bytes += nbytes;
            } else {
                count_bytes += nbytes - old_n * e->unit_bytes;
            }
            if (b->header_nbytes) {
                b->header_nbytes[e->index * b->stride] = nbytes;
                if (nbytes && e->inplace >= 0 && e->inplace + nbytes > dma_end)
                    dma_end = e->inplace + nbytes;
            }
        }
        Py_INCREF(v);
        PyList_SET_ITEM(counts, e->index, v);
        Py_DECREF(old);
    }
    return Py_BuildValue("(LLL)", (long long)active, (long long)count_bytes,
                         (long long)dma_end);
}

/* ---------------------------------------------------------------- graph publication */
typedef int (*graph_launch_fn)(void *exec, void *stream);
typedef int (*is_capturing_fn)(void *stream, int *status);

typedef struct {
    int64_t index, src, unit_bytes;
} Staged;

typedef struct {
    char *host;
    int64_t *header;
    int64_t staging_offset, first_extra, header_bytes, total_bytes;
    Py_ssize_t num_staged, num_src, num_execs;
    Staged *staged;
    int64_t *src_base;
    void **execs; /* by bucket index: the graph of DMA size 2**index (NULL: none) */
    graph_launch_fn launch;
    is_capturing_fn is_capturing;
    PyObject *owner; /* keeps the arena (host memory, graphs) alive */
} Publish;

static void publish_free(PyObject *capsule)
{
    Publish *p = (Publish *)PyCapsule_GetPointer(capsule, "h2d_publish");
    if (p == NULL)
        return;
    Py_XDECREF(p->owner);
    PyMem_Free(p->staged);
    PyMem_Free(p->src_base);
    PyMem_Free(p->execs);
    PyMem_Free(p);
}

/* i64 items of a tuple of ints into a new array (NULL + exception on failure) */
static int64_t *i64_array(PyObject *t, const char *what)
{
    if (!PyTuple_CheckExact(t)) {
        PyErr_Format(PyExc_TypeError, "bind_publish: %s must be a tuple", what);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    int64_t *a = PyMem_Calloc((size_t)(n ? n : 1), sizeof(int64_t));
    if (a == NULL)
        return (int64_t *)PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < n; k++)
        if (as_i64(PyTuple_GET_ITEM(t, k), &a[k]) < 0) {
            PyMem_Free(a);
            return NULL;
        }
    return a;
}

/* bind_publish(host_base, header_addr, staging_offset, first_extra, staged, src_base,
 *              header_bytes, total_bytes, execs, launch_fn, is_capturing_fn, owner)
 * -> capsule.  staged: tuple of (member, source address, unit bytes); execs: tuple of
 * CUgraphExec handles by bucket index (0 where no graph covers that size). launch_fn and
 * is_capturing_fn both 0 (and no execs): a binding that only packs. */
static PyObject *bind_publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "bind_publish takes 12 arguments");
        return NULL;
    }
    Publish *p = PyMem_Calloc(1, sizeof(Publish));
    if (p == NULL)
        return PyErr_NoMemory();
    int64_t host, header, launch, capturing;
    if (as_i64(args[0], &host) < 0 || as_i64(args[1], &header) < 0 ||
        as_i64(args[2], &p->staging_offset) < 0 || as_i64(args[3], &p->first_extra) < 0 ||
        as_i64(args[6], &p->header_bytes) < 0 || as_i64(args[7], &p->total_bytes) < 0 ||
        as_i64(args[9], &launch) < 0 || as_i64(args[10], &capturing) < 0)
        goto fail;
    if (!launch != !capturing) {
        PyErr_SetString(PyExc_ValueError, "bind_publish: null driver function address");
        goto fail;
    }
    p->host = (char *)(intptr_t)host;
    p->header = (int64_t *)(intptr_t)header;
    p->launch = (graph_launch_fn)(intptr_t)launch;
    p->is_capturing = (is_capturing_fn)(intptr_t)capturing;
    if (!PyTuple_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "bind_publish: staged must be a tuple");
        goto fail;
    }
    p->num_staged = PyTuple_GET_SIZE(args[4]);
    p->staged = PyMem_Calloc((size_t)(p->num_staged ? p->num_staged : 1), sizeof(Staged));
    if (p->staged == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t k = 0; k < p->num_staged; k++) {
        PyObject *e = PyTuple_GET_ITEM(args[4], k);
        Staged *d = &p->staged[k];
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3 ||
            as_i64(PyTuple_GET_ITEM(e, 0), &d->index) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 1), &d->src) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 2), &d->unit_bytes) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "bind_publish: malformed staged entry");
            goto fail;
        }
    }
    if ((p->src_base = i64_array(args[5], "src_base")) == NULL)
        goto fail;
    p->num_src = PyTuple_GET_SIZE(args[5]);
    int64_t *execs = i64_array(args[8], "execs");
    if (execs == NULL)
        goto fail;
    p->execs = (void **)execs; /* int64 and pointers share a size on every target built */
    p->num_execs = PyTuple_GET_SIZE(args[8]);
    p->owner = Py_NewRef(args[11]);
    PyObject *capsule = PyCapsule_New(p, "h2d_publish", publish_free);
    if (capsule != NULL)
        return capsule;
    Py_DECREF(p->owner);
    p->owner = NULL;
fail:
    PyMem_Free(p->staged);
    PyMem_Free(p->src_base);
    PyMem_Free(p->execs);
    PyMem_Free(p);
    return NULL;
}

static inline Py_ssize_t bucket_of(int64_t nbytes)
{
    return nbytes <= 1 ? 0 : (Py_ssize_t)(64 - __builtin_clzll((unsigned long long)(nbytes - 1)));
}

/* Copy staged members' used bytes, then the ranges, into the staging region and write
 * their header rows; *end is where the copied bytes end (0: nothing copied). -1 on error.
 * ranges are (member index, byte offset in the destination, byte count), validated by the
 * caller against capacity and the staging room. */
static int pack_into(Publish *p, PyObject *counts, PyObject *ranges, int64_t *end_out)
{
    if (!PyList_CheckExact(counts) || !PyList_CheckExact(ranges)) {
        PyErr_SetString(PyExc_TypeError, "pack: counts and ranges must be lists");
        return -1;
    }
    int64_t off = p->staging_offset, row = p->first_extra, end = 0;
    for (Py_ssize_t k = 0; k < p->num_staged; k++) {
        Staged *d = &p->staged[k];
        if (d->index < 0 || d->index >= PyList_GET_SIZE(counts))
            goto bad;
        PyObject *c = PyList_GET_ITEM(counts, d->index);
        if (c == Py_None)
            continue;
        int64_t n;
        if (as_i64(c, &n) < 0)
            return -1;
        if (n == 0)
            continue;
        int64_t nbytes = n * d->unit_bytes;
        memmove(p->host + off, (const char *)(intptr_t)d->src, (size_t)nbytes);
        p->header[4 * d->index] = off;
        off = align_up(off + nbytes);
        end = off;
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(ranges); k++) {
        PyObject *r = PyList_GET_ITEM(ranges, k);
        int64_t i, dst_off, nbytes;
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 3 ||
            as_i64(PyTuple_GET_ITEM(r, 0), &i) < 0 ||
            as_i64(PyTuple_GET_ITEM(r, 1), &dst_off) < 0 ||
            as_i64(PyTuple_GET_ITEM(r, 2), &nbytes) < 0 || i < 0 || i >= p->num_src)
            goto bad;
        memmove(p->host + off, (const char *)(intptr_t)(p->src_base[i] + dst_off),
                (size_t)nbytes);
        int64_t *h = p->header + 4 * row;
        h[0] = off;
        h[1] = nbytes;
        h[2] = i;
        h[3] = dst_off;
        row++;
        off = align_up(off + nbytes);
        end = off;
    }
    *end_out = end;
    return 0;
bad:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "pack: malformed count or range");
    return -1;
}

/* pack(capsule, counts, ranges) -> end of the copied bytes (0 when nothing was copied) */
static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pack(capsule, counts list, ranges list)");
        return NULL;
    }
    Publish *p = (Publish *)PyCapsule_GetPointer(args[0], "h2d_publish");
    int64_t end;
    if (p == NULL || pack_into(p, args[1], args[2], &end) < 0)
        return NULL;
    return PyLong_FromLongLong(end);
}

/* publish_packed(capsule, counts, ranges, dma_end, stream) -> int
 * Packs as pack(), then launches the graph of the bucket covering max(packed end,
 * dma_end) on the raw stream handle. Returns that DMA size when launched, or its negation
 * when nothing was launched because the binding only packs, the stream is being captured
 * or no graph covers the size: the caller then enqueues through PackedArena.publish. A
 * driver error raises RuntimeError naming the call and the CUresult. */
static PyObject *publish_packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "publish_packed takes 5 arguments");
        return NULL;
    }
    Publish *p = (Publish *)PyCapsule_GetPointer(args[0], "h2d_publish");
    if (p == NULL)
        return NULL;
    int64_t dma_end, stream, end;
    if (as_i64(args[3], &dma_end) < 0 || as_i64(args[4], &stream) < 0)
        return NULL;
    if (pack_into(p, args[1], args[2], &end) < 0)
        return NULL;
    if (dma_end > end)
        end = dma_end;
    if (p->launch == NULL || end < p->header_bytes || end > p->total_bytes)
        return PyLong_FromLongLong(-end); /* the arena's publish launches (or raises) */
    Py_ssize_t b = bucket_of(end);
    void *exec = b < p->num_execs ? p->execs[b] : NULL;
    if (exec == NULL)
        return PyLong_FromLongLong(-end);
    int capturing = 0;
    int rc = p->is_capturing((void *)(intptr_t)stream, &capturing);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "cuStreamIsCapturing failed with CUDA error %d", rc);
        return NULL;
    }
    if (capturing) /* a graph cannot be launched into a capture: the plain launch can */
        return PyLong_FromLongLong(-end);
    rc = p->launch(exec, (void *)(intptr_t)stream);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "cuGraphLaunch failed with CUDA error %d", rc);
        return NULL;
    }
    return PyLong_FromLongLong(end);
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
    {"bind_publish", (PyCFunction)(void (*)(void))bind_publish, METH_FASTCALL, NULL},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, NULL},
    {"publish_packed", (PyCFunction)(void (*)(void))publish_packed, METH_FASTCALL, NULL},
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
