/* Compiled publication of a packed group (h2d_kernels.packed_group.PackedGroup.publish;
 * its Python twin there writes the same header rows and bytes).
 *
 * bind_publish: one slot's arena: host base, header, staging, staged members, every
 *       member's unit bytes and in-place offset, the captured graphs by size bucket and
 *       the driver's graph launch and capture query (as addresses; 0 when not launching).
 * publish_packed: write every member's header byte count from its count, copy staged
 *       members' used bytes and the pending ranges into staging (their header rows too),
 *       zero the range rows it does not use, then launch the graph that
 *       covers the DMA end through a function pointer: one C call per publication.
 *
 * No CUDA or HIP header is needed: entry points arrive as addresses and handles as
 * integers; their status codes are reported, never interpreted beyond success.
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
    int64_t header_rows;    /* rows of the header: members, then range rows */
    Py_ssize_t num_staged, num_src, num_execs, num_members;
    Staged *staged;
    int64_t *src_base;
    int64_t *unit_bytes; /* per member: bytes per counted unit */
    int64_t *inplace;    /* per member: fixed arena offset, or -1 for a staged member */
    void **execs; /* by bucket index: the graph of DMA size 2**index (NULL: none) */
    graph_launch_fn launch;
    is_capturing_fn is_capturing;
    PyObject *owner; /* keeps the arena (host memory, graphs) alive */
} Publish;

/* everything a binding holds (a partly built one too: its unset pointers are NULL) */
static void publish_release(Publish *p)
{
    Py_XDECREF(p->owner);
    PyMem_Free(p->staged);
    PyMem_Free(p->src_base);
    PyMem_Free(p->unit_bytes);
    PyMem_Free(p->inplace);
    PyMem_Free(p->execs);
    PyMem_Free(p);
}

static void publish_free(PyObject *capsule)
{
    Publish *p = (Publish *)PyCapsule_GetPointer(capsule, "h2d_publish");
    if (p != NULL)
        publish_release(p);
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
 *              header_bytes, total_bytes, execs, launch_fn, is_capturing_fn, owner,
 *              unit_bytes, inplace, header_rows)
 * -> capsule.  staged: tuple of (member, source address, unit bytes); execs: tuple of
 * graph exec handles by bucket index (0 where no graph covers that size); unit_bytes and
 * inplace: one int per member (inplace: fixed arena offset, -1 for staged members);
 * header_rows: the header's rows (members first, then the rows ranges may use).
 * launch_fn and is_capturing_fn both 0 (and no execs): a binding that only packs. */
static PyObject *bind_publish(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "bind_publish takes 15 arguments");
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
    if ((p->unit_bytes = i64_array(args[12], "unit_bytes")) == NULL ||
        (p->inplace = i64_array(args[13], "inplace")) == NULL)
        goto fail;
    p->num_members = PyTuple_GET_SIZE(args[12]);
    if (as_i64(args[14], &p->header_rows) < 0)
        goto fail;
    if (p->header_rows < p->first_extra || p->first_extra != p->num_members) {
        PyErr_SetString(PyExc_ValueError, "bind_publish: header rows do not fit the members");
        goto fail;
    }
    if (PyTuple_GET_SIZE(args[13]) != p->num_members) {
        PyErr_SetString(PyExc_ValueError, "bind_publish: unit_bytes and inplace differ in length");
        goto fail;
    }
    p->owner = Py_NewRef(args[11]);
    PyObject *capsule = PyCapsule_New(p, "h2d_publish", publish_free);
    if (capsule != NULL)
        return capsule;
fail:
    publish_release(p);
    return NULL;
}

static inline Py_ssize_t bucket_of(int64_t nbytes)
{
    return nbytes <= 1 ? 0 : (Py_ssize_t)(64 - __builtin_clzll((unsigned long long)(nbytes - 1)));
}

/* Write every member's header byte count from its count, copy staged members' used
 * bytes, then the ranges, into the staging region (their header rows too), and zero every
 * range row this publication does not use: the header is a function of the counts and
 * ranges alone. *end_out: where the DMA must
 * end (the header at least). -1 on error. counts: one int or None per member, validated
 * against capacity by the caller; ranges: (member index, byte offset in the destination,
 * byte count), validated against capacity and the staging room by the caller. */
static int pack_into(Publish *p, PyObject *counts, PyObject *ranges, int64_t *end_out)
{
    if (!PyList_CheckExact(counts) || !PyList_CheckExact(ranges) ||
        PyList_GET_SIZE(counts) != p->num_members) {
        PyErr_SetString(PyExc_TypeError, "publish: counts (one per member) and ranges lists");
        return -1;
    }
    int64_t end = p->header_bytes;
    for (Py_ssize_t i = 0; i < p->num_members; i++) {
        PyObject *c = PyList_GET_ITEM(counts, i);
        int64_t n = 0;
        if (c != Py_None && as_i64(c, &n) < 0)
            return -1;
        int64_t nbytes = n * p->unit_bytes[i];
        p->header[4 * i + 1] = nbytes;
        if (nbytes && p->inplace[i] >= 0 && p->inplace[i] + nbytes > end)
            end = p->inplace[i] + nbytes;
    }
    int64_t off = p->staging_offset, row = p->first_extra;
    for (Py_ssize_t k = 0; k < p->num_staged; k++) {
        Staged *d = &p->staged[k];
        if (d->index < 0 || d->index >= p->num_members)
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
        if (off > end)
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
        if (off > end)
            end = off;
    }
    for (int64_t r = row; r < p->header_rows; r++)
        p->header[4 * r + 1] = 0; /* an unused range row scatters nothing */
    *end_out = end;
    return 0;
bad:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "publish: malformed count or range");
    return -1;
}

/* publish_packed(capsule, counts, ranges, stream) -> int
 * Writes the header and packs (pack_into), then launches the graph of the bucket covering
 * the DMA end on the raw stream handle. Returns that DMA size when launched, or its
 * negation when nothing was launched because the binding only packs, the stream is being
 * captured or no graph covers the size: the caller then enqueues through
 * PackedArena.publish. A driver error raises RuntimeError naming the call and the status. */
static PyObject *publish_packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "publish_packed takes 4 arguments");
        return NULL;
    }
    Publish *p = (Publish *)PyCapsule_GetPointer(args[0], "h2d_publish");
    if (p == NULL)
        return NULL;
    int64_t stream, end;
    if (as_i64(args[3], &stream) < 0)
        return NULL;
    if (pack_into(p, args[1], args[2], &end) < 0)
        return NULL;
    if (p->launch == NULL || end < p->header_bytes || end > p->total_bytes)
        return PyLong_FromLongLong(-end); /* the arena's publish launches (or raises) */
    Py_ssize_t b = bucket_of(end);
    void *exec = b < p->num_execs ? p->execs[b] : NULL;
    if (exec == NULL)
        return PyLong_FromLongLong(-end);
    int capturing = 0;
    int rc = p->is_capturing((void *)(intptr_t)stream, &capturing);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "stream capture query failed with driver error %d", rc);
        return NULL;
    }
    if (capturing) /* a graph cannot be launched into a capture: the plain launch can */
        return PyLong_FromLongLong(-end);
    rc = p->launch(exec, (void *)(intptr_t)stream);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "graph launch failed with driver error %d", rc);
        return NULL;
    }
    return PyLong_FromLongLong(end);
}

/* ---------------------------------------------------------------- slot events */

static PyMethodDef methods[] = {
    {"bind_publish", (PyCFunction)(void (*)(void))bind_publish, METH_FASTCALL, NULL},
    {"publish_packed", (PyCFunction)(void (*)(void))publish_packed, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_h2d_kernels_native", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__h2d_kernels_native(void) { return PyModule_Create(&module); }
