/* Compiled hot paths of h2d_core (built by block_tables.native; Python fallbacks in
 * packing.py and count_batch.py produce the same state and bytes).
 *
 * pack: copy staged members' used bytes and pending ranges into a packed arena's staging
 *       region and write their header rows (packing.pack).
 * store_counts: record a CountBatch's validated counts in one slot's group record
 *       (count_batch.CountBatch.set); any value the fast path does not accept returns
 *       None before the first write, and the Python path raises the specific error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/* pack(host_base, header_addr, staging_offset, first_extra, staged, counts, src_base,
 *      ranges) -> end
 * header rows are 4 int64: (src_offset, nbytes, member, dst_offset). */
static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "pack takes 8 arguments");
        return NULL;
    }
    int64_t base, header_addr, off, row;
    if (as_i64(args[0], &base) < 0 || as_i64(args[1], &header_addr) < 0 ||
        as_i64(args[2], &off) < 0 || as_i64(args[3], &row) < 0)
        return NULL;
    PyObject *staged = args[4], *counts = args[5], *src_base = args[6], *ranges = args[7];
    if (!PyTuple_CheckExact(staged) || !PyList_CheckExact(counts) ||
        !PyTuple_CheckExact(src_base) || !PyList_CheckExact(ranges)) {
        PyErr_SetString(PyExc_TypeError, "pack(…, staged tuple, counts list, src_base tuple, "
                                         "ranges list)");
        return NULL;
    }
    char *host = (char *)(intptr_t)base;
    int64_t *header = (int64_t *)(intptr_t)header_addr;
    int64_t end = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(staged); k++) {
        PyObject *e = PyTuple_GET_ITEM(staged, k);
        int64_t i, src, unit;
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3 ||
            as_i64(PyTuple_GET_ITEM(e, 0), &i) < 0 || as_i64(PyTuple_GET_ITEM(e, 1), &src) < 0 ||
            as_i64(PyTuple_GET_ITEM(e, 2), &unit) < 0)
            goto bad;
        if (i < 0 || i >= PyList_GET_SIZE(counts))
            goto bad;
        PyObject *c = PyList_GET_ITEM(counts, i);
        if (c == Py_None)
            continue;
        int64_t n;
        if (as_i64(c, &n) < 0)
            return NULL;
        if (n == 0)
            continue;
        int64_t nbytes = n * unit;
        memmove(host + off, (const char *)(intptr_t)src, (size_t)nbytes);
        header[4 * i] = off;
        off = align_up(off + nbytes);
        end = off;
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(ranges); k++) {
        PyObject *r = PyList_GET_ITEM(ranges, k);
        int64_t i, dst_off, nbytes, src;
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 3 ||
            as_i64(PyTuple_GET_ITEM(r, 0), &i) < 0 ||
            as_i64(PyTuple_GET_ITEM(r, 1), &dst_off) < 0 ||
            as_i64(PyTuple_GET_ITEM(r, 2), &nbytes) < 0)
            goto bad;
        if (i < 0 || i >= PyTuple_GET_SIZE(src_base) ||
            as_i64(PyTuple_GET_ITEM(src_base, i), &src) < 0)
            goto bad;
        memmove(host + off, (const char *)(intptr_t)(src + dst_off), (size_t)nbytes);
        int64_t *h = header + 4 * row;
        h[0] = off;
        h[1] = nbytes;
        h[2] = i;
        h[3] = dst_off;
        row++;
        off = align_up(off + nbytes);
        end = off;
    }
    return PyLong_FromLongLong(end);
bad:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "pack: malformed staged entry or range");
    return NULL;
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

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, NULL},
    {"bind_counts", (PyCFunction)(void (*)(void))bind_counts, METH_FASTCALL, NULL},
    {"store_counts", (PyCFunction)(void (*)(void))store_counts, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_h2d_core_native", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__h2d_core_native(void) { return PyModule_Create(&module); }
