/* Compiled fast paths of PageTableSnapshot.prepare and changed_spans (see native.py).
 *
 * prepare_step covers the common decode step: every row is a BlockTable whose key equals
 * the stored key (a hit) or exceeds it by one (the same lineage grew by one page). Any
 * other row, and every error, returns None before the first write: the Python path then
 * handles the batch, so rules and messages live in one place (snapshot.py).
 *
 * write_replaced is the write phase of a fully replaced batch: the Python path has made
 * every check, the compiled sweep only writes (snapshot.py's _write_replaced is its twin).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

static PyTypeObject *table_type = NULL;
/* BlockTable's `_key` and `_last` slot descriptors and their getters, looked up once:
 * calling a descriptor's public tp_descr_get skips the generic attribute lookup (~30 ns a
 * row) without reading the instance layout. */
static PyObject *key_descr = NULL, *last_descr = NULL;
static descrgetfunc key_get = NULL, last_get = NULL;
static int length_bits = 24;
static int64_t length_mask = (1 << 24) - 1;

static PyObject *configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "configure(BlockTable, LENGTH_BITS)");
        return NULL;
    }
    long bits = PyLong_AsLong(args[1]);
    if (bits == -1 && PyErr_Occurred())
        return NULL;
    PyTypeObject *type = (PyTypeObject *)args[0];
    PyObject *descrs[2];
    const char *names[2] = {"_key", "_last"};
    for (int i = 0; i < 2; i++) {
        descrs[i] = PyObject_GetAttrString((PyObject *)type, names[i]);
        if (descrs[i] == NULL || Py_TYPE(descrs[i])->tp_descr_get == NULL) {
            if (descrs[i] != NULL)
                PyErr_Format(PyExc_TypeError, "%s.%s is not a slot descriptor", type->tp_name,
                             names[i]);
            Py_XDECREF(descrs[i]);
            if (i == 1)
                Py_DECREF(descrs[0]);
            return NULL;
        }
    }
    Py_XSETREF(key_descr, descrs[0]);
    Py_XSETREF(last_descr, descrs[1]);
    key_get = Py_TYPE(key_descr)->tp_descr_get;
    last_get = Py_TYPE(last_descr)->tp_descr_get;
    Py_XSETREF(table_type, (PyTypeObject *)Py_NewRef(args[0]));
    length_bits = (int)bits;
    length_mask = ((int64_t)1 << bits) - 1;
    Py_RETURN_NONE;
}

/* A writable C-contiguous buffer of at least `count` items of `itemsize` bytes. */
static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len < itemsize * count) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "internal array has the wrong item size or length");
        return -1;
    }
    return 0;
}

/* a BlockTable slot's value as an int64; 1 when it is unset or not an exact int (the
 * Python path handles such a row), -1 on an error */
static inline int slot_int64(PyObject *row, PyObject *descr, descrgetfunc get, int64_t *out)
{
    PyObject *v = get(descr, row, (PyObject *)table_type);
    if (v == NULL) {
        PyErr_Clear();
        return 1;
    }
    int rc = 1;
    if (PyLong_CheckExact(v)) {
        long long x = PyLong_AsLongLong(v);
        rc = (x == -1 && PyErr_Occurred()) ? -1 : 0;
        *out = (int64_t)x;
    }
    Py_DECREF(v);
    return rc;
}

static int read_int64(PyObject *obj, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

/* The snapshot's own arrays, bound once (they never move): per-step calls then pay no
 * buffer-protocol lookups for them. */
typedef struct {
    PyObject *owner[5];
    int64_t *row_keys, *lengths, *changed, *scratch;
    int32_t *storage;
    Py_ssize_t capacity, width;
} Bound;

static void bound_free(PyObject *capsule)
{
    Bound *b = (Bound *)PyCapsule_GetPointer(capsule, "block_tables_snapshot");
    if (b == NULL)
        return;
    for (int i = 0; i < 5; i++)
        Py_XDECREF(b->owner[i]);
    PyMem_Free(b);
}

/* bind(row_keys, lengths, storage, changed, scratch) -> capsule
 * row_keys, lengths, changed: int64[capacity]; storage: int32[capacity, width];
 * scratch: int64[2 * capacity]. */
static PyObject *bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "bind(row_keys, lengths, storage, changed, scratch, width)");
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[5]);
    if (width == -1 && PyErr_Occurred())
        return NULL;
    Bound *b = PyMem_Calloc(1, sizeof(Bound));
    if (b == NULL)
        return PyErr_NoMemory();
    static const Py_ssize_t itemsize[5] = {8, 8, 4, 8, 8};
    void *ptr[5];
    Py_ssize_t items[5];
    for (int i = 0; i < 5; i++) {
        Py_buffer v;
        if (get_array(args[i], &v, itemsize[i], 0) < 0)
            goto fail;
        ptr[i] = v.buf;
        items[i] = v.len / itemsize[i];
        b->owner[i] = Py_NewRef(args[i]);
        PyBuffer_Release(&v);
    }
    b->capacity = items[0];
    b->width = width;
    if (items[1] < b->capacity || items[2] < b->capacity * width || items[3] < b->capacity ||
        items[4] < 2 * b->capacity) {
        PyErr_SetString(PyExc_ValueError, "bind: arrays too small for the capacity");
        goto fail;
    }
    b->row_keys = ptr[0];
    b->lengths = ptr[1];
    b->storage = ptr[2];
    b->changed = ptr[3];
    b->scratch = ptr[4];
    PyObject *capsule = PyCapsule_New(b, "block_tables_snapshot", bound_free);
    if (capsule != NULL)
        return capsule;
fail:
    for (int i = 0; i < 5; i++)
        Py_XDECREF(b->owner[i]);
    PyMem_Free(b);
    return NULL;
}

/* prepare_step(bound, rows, limit, required)
 *
 * rows: list or tuple; limit: pool limit or -1; required: None or a 1-D signed/unsigned
 * 4/8-byte integer array of len(rows).
 * Returns a new int64 array of the rows whose bytes changed, ascending (empty for a hit:
 * the snapshot's history keeps it as is, no copy in Python), or None when the batch is not
 * covered. */
static PyObject *prepare_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "prepare_step takes 4 arguments");
        return NULL;
    }
    if (table_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "prepare_step before configure()");
        return NULL;
    }
    Bound *b = (Bound *)PyCapsule_GetPointer(args[0], "block_tables_snapshot");
    if (b == NULL)
        return NULL;
    PyObject *rows = args[1];
    if (!PyList_CheckExact(rows) && !PyTuple_CheckExact(rows))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(rows);
    PyObject **items = PySequence_Fast_ITEMS(rows);
    int64_t limit;
    if (read_int64(args[2], &limit) < 0)
        return NULL;
    Py_ssize_t capacity = b->capacity;
    int64_t width = b->width;
    if (n > capacity)
        Py_RETURN_NONE;
    PyObject *result = NULL;
    /* required pages: a 1-D aligned native-order numpy integer array of 4 or 8 bytes per
     * item (read through numpy's macros: the buffer protocol costs ~0.2 µs); anything else
     * goes to the Python path, which coerces and checks it */
    const char *req = NULL;
    Py_ssize_t req_stride = 0, req_size = 0;
    int unsigned_req = 0;
    if (args[3] != Py_None) {
        if (!PyArray_Check(args[3]))
            Py_RETURN_NONE;
        PyArrayObject *r = (PyArrayObject *)args[3];
        req_size = PyArray_ITEMSIZE(r);
        if (PyArray_NDIM(r) != 1 || PyArray_DIM(r, 0) != n || !PyArray_ISINTEGER(r) ||
            (req_size != 4 && req_size != 8) || !PyArray_ISALIGNED(r) ||
            !PyArray_ISNOTSWAPPED(r))
            Py_RETURN_NONE;
        req = PyArray_DATA(r);
        req_stride = PyArray_STRIDE(r, 0);
        unsigned_req = PyArray_ISUNSIGNED(r);
    }

    int64_t *row_keys = b->row_keys;
    int64_t *lengths = b->lengths;
    int32_t *storage = b->storage;
    int64_t *changed = b->changed;
    int64_t *new_keys = b->scratch;
    int64_t *lasts = new_keys + capacity; /* appended page ID, or INT64_MIN for a hit */

    /* ---- check everything; no write before the batch is known to be covered ---- */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = items[i];
        if (Py_TYPE(row) != table_type)
            goto not_covered;
        int64_t key;
        int got = slot_int64(row, key_descr, key_get, &key);
        if (got < 0)
            goto fail;
        if (got > 0)
            goto not_covered;
        int64_t length = key & length_mask;
        if (length > width)
            goto not_covered;
        if (req != NULL) {
            const char *cell = req + i * req_stride;
            int64_t need;
            if (req_size == 4)
                need = unsigned_req ? (int64_t) * (const uint32_t *)cell
                                    : (int64_t) * (const int32_t *)cell;
            else
                need = *(const int64_t *)cell; /* uint64 above 2**63 reads negative: huge */
            if ((uint64_t)need > (uint64_t)length) /* negative reads as huge */
                goto not_covered;
        }
        int64_t delta = key - row_keys[i];
        new_keys[i] = key;
        if (delta == 0) {
            lasts[i] = INT64_MIN;
        } else if (delta == 1) {
            int64_t last;
            got = slot_int64(row, last_descr, last_get, &last);
            if (got < 0)
                goto fail;
            if (got > 0)
                goto not_covered;
            if (limit >= 0 && (uint64_t)(uint32_t)last >= (uint64_t)limit)
                goto not_covered;
            lasts[i] = last;
        } else {
            goto not_covered;
        }
    }

    /* ---- write: one page ID per grown row, counted only when its bytes differ ---- */
    Py_ssize_t c = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lasts[i] != INT64_MIN) {
            int32_t *cell = storage + i * width + lengths[i];
            int32_t v = (int32_t)lasts[i];
            if (*cell != v) {
                *cell = v;
                changed[c++] = i;
            }
            row_keys[i] = new_keys[i];
            lengths[i] = new_keys[i] & length_mask;
        }
    }
    npy_intp dims[1] = {c};
    result = PyArray_SimpleNew(1, dims, NPY_INT64);
    if (result != NULL && c)
        memcpy(PyArray_DATA((PyArrayObject *)result), changed, (size_t)c * sizeof(int64_t));
    goto release_req;

not_covered:
    result = Py_NewRef(Py_None);
    goto release_req;
fail:
    result = NULL;
release_req:
    return result;
}

/* Set the `count` elements at `p` that differ from `fill` to it; return how many. The
 * only place the snapshot's compiled paths write the fill value. */
static inline int64_t clear_span(int32_t *p, int64_t count, int32_t fill)
{
    int64_t cleared = 0;
    for (int64_t k = 0; k < count; k++) {
        if (p[k] != fill) {
            p[k] = fill;
            cleared++;
        }
    }
    return cleared;
}

/* write_replaced(bound, ids, fill) -> (changed rows, cleared) or None
 *
 * The write phase of a fully replaced batch (PageTableSnapshot._write_replaced, every
 * check already made in Python): row i of [0, len(ids)) takes the int32 array ids[i].
 * First each row's IDs, compared first and copied without clearing; then one sweep over
 * rows [0, n) clears each exposed tail, columns [len(ids[i]), lengths[i]) (lengths: what
 * the rows held), writing only elements that differ from `fill`. Returns a new int64
 * array of the rows whose bytes changed, ascending, and the number of elements cleared;
 * None, before any write, when an item is not a 1-D aligned native-order C-contiguous
 * int32 array of at most `width` IDs (the numpy twin handles the batch then). */
static PyObject *write_replaced(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write_replaced(bound, ids, fill)");
        return NULL;
    }
    Bound *b = (Bound *)PyCapsule_GetPointer(args[0], "block_tables_snapshot");
    if (b == NULL)
        return NULL;
    PyObject *list = args[1];
    if (!PyList_CheckExact(list))
        Py_RETURN_NONE;
    int64_t fill64;
    if (read_int64(args[2], &fill64) < 0)
        return NULL;
    if (fill64 < INT32_MIN || fill64 > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "write_replaced: fill must be an int32");
        return NULL;
    }
    int32_t fill = (int32_t)fill64;
    Py_ssize_t n = PyList_GET_SIZE(list);
    Py_ssize_t width = b->width;
    if (n > b->capacity)
        Py_RETURN_NONE;
    PyObject **items = PySequence_Fast_ITEMS(list);
    int64_t *flags = b->scratch; /* per row: bytes changed */
    int64_t *lens = b->scratch + b->capacity;
    /* ---- check every row; nothing is written before all are known to be readable ---- */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyArray_Check(items[i]))
            Py_RETURN_NONE;
        PyArrayObject *a = (PyArrayObject *)items[i];
        if (PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != NPY_INT32 || !PyArray_ISALIGNED(a) ||
            !PyArray_ISNOTSWAPPED(a) || PyArray_DIM(a, 0) > width ||
            (PyArray_DIM(a, 0) > 1 && PyArray_STRIDE(a, 0) != (npy_intp)sizeof(int32_t)))
            Py_RETURN_NONE;
        lens[i] = PyArray_DIM(a, 0);
    }
    int32_t *storage = b->storage;
    /* ---- the IDs: compared first, copied without clearing what they replace ---- */
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t *row = storage + i * width;
        const int32_t *ids = PyArray_DATA((PyArrayObject *)items[i]);
        size_t nbytes = (size_t)lens[i] * sizeof(int32_t);
        flags[i] = nbytes && memcmp(row, ids, nbytes) != 0;
        if (flags[i])
            memmove(row, ids, nbytes); /* a caller's array may be a view of the storage */
    }
    /* ---- one sweep over rows [0, n): the exposed tails ---- */
    int64_t cleared = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t exposed = b->lengths[i] - lens[i];
        if (exposed > 0) {
            int64_t k = clear_span(storage + i * width + lens[i], exposed, fill);
            cleared += k;
            flags[i] |= k > 0;
        }
    }
    Py_ssize_t c = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (flags[i])
            b->changed[c++] = i;
    npy_intp dims[1] = {c};
    PyObject *rows = PyArray_SimpleNew(1, dims, NPY_INT64);
    if (rows == NULL)
        return NULL;
    if (c)
        memcpy(PyArray_DATA((PyArrayObject *)rows), b->changed, (size_t)c * sizeof(int64_t));
    PyObject *out = Py_BuildValue("(NL)", rows, (long long)cleared);
    return out;
}

/* A 1-D aligned native-order signed int64 numpy array (any stride) of at least `count`
 * items: 0 and its data/stride in items, or 1 (anything else: the Python path). */
static int get_keys(PyObject *obj, const int64_t **data, Py_ssize_t count, Py_ssize_t *stride)
{
    if (!PyArray_Check(obj))
        return 1;
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_NDIM(a) != 1 || PyArray_ITEMSIZE(a) != 8 || !PyArray_ISSIGNED(a) ||
        !PyArray_ISINTEGER(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a) ||
        PyArray_DIM(a, 0) < count || PyArray_STRIDE(a, 0) % 8)
        return 1;
    *data = PyArray_DATA(a);
    *stride = PyArray_STRIDE(a, 0) / 8;
    return 0;
}

/* key_spans(now, then, limit) -> (rows, starts, stops), or NotImplemented (not int64)
 *
 * The all-versioned branch of spans.changed_spans: rows of [0, limit) whose int64 keys
 * differ; an append in the same lineage differs in columns [len_then, len_now), anything
 * else in [0, max(len_then, len_now)). */
static PyObject *key_spans(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "key_spans takes 3 arguments");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    const int64_t *now, *then;
    Py_ssize_t ns, ts;
    if (get_keys(args[0], &now, limit, &ns) || get_keys(args[1], &then, limit, &ts))
        return Py_NewRef(Py_NotImplemented);
    PyObject *out = NULL, *rows = NULL, *starts = NULL, *stops = NULL;
    rows = PyList_New(0);
    starts = PyList_New(0);
    stops = PyList_New(0);
    if (!rows || !starts || !stops)
        goto done;
    for (Py_ssize_t r = 0; r < limit; r++) {
        int64_t t = then[r * ts], w = now[r * ns];
        if (t == w)
            continue;
        int64_t len_then = t & length_mask, len_now = w & length_mask;
        int64_t version = w >> length_bits;
        int64_t start, stop;
        if ((t >> length_bits) == version && version > 0 && len_now >= len_then) {
            start = len_then;
            stop = len_now;
        } else {
            start = 0;
            stop = len_then > len_now ? len_then : len_now;
        }
        if (stop <= start)
            continue;
        PyObject *a = PyLong_FromSsize_t(r), *b = PyLong_FromLongLong(start),
                 *e = PyLong_FromLongLong(stop);
        int bad = !a || !b || !e || PyList_Append(rows, a) || PyList_Append(starts, b) ||
                  PyList_Append(stops, e);
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_XDECREF(e);
        if (bad)
            goto done;
    }
    out = PyTuple_Pack(3, rows, starts, stops);
done:
    Py_XDECREF(rows);
    Py_XDECREF(starts);
    Py_XDECREF(stops);
    return out;
}

/* list.append((start, stop)), or (tag, start, stop - start) when tag >= 0; -1 on error */
static int append_range(PyObject *list, int64_t start, int64_t stop, int64_t tag)
{
    PyObject *pair = tag < 0 ? Py_BuildValue("(LL)", (long long)start, (long long)stop)
                             : Py_BuildValue("(LLL)", (long long)tag, (long long)start,
                                             (long long)(stop - start));
    int bad = pair == NULL || PyList_Append(list, pair) < 0;
    Py_XDECREF(pair);
    return bad ? -1 : 0;
}

/* changed_byte_ranges(now, then, rows_then, num_rows, row_bytes, max_ranges, max_bytes
 *                     [, keys_out[, tag]]) -> (ranges, total_bytes) or None
 *
 * What a publisher holding rows [0, rows_then) with keys `then` must send so the GPU
 * holds rows [0, num_rows) with keys `now` (all versioned): the key_spans of rows below
 * min(num_rows, rows_then) as byte ranges of a row-major int32 table, plus rows
 * [rows_then, num_rows) whole, byte-adjacent pieces merged. None when more than
 * max_ranges ranges or more than max_bytes bytes would travel; NotImplemented when the
 * keys (or keys_out) are not int64 views (the Python path handles them). keys_out, when
 * given, receives now[0, num_rows) whatever the result: the keys to remember for this
 * upload, without a separate copy. tag (an int >= 0), when given, makes each range the
 * triple (tag, start, nbytes) a publication record takes (h2d_core's block-table state). */
static PyObject *changed_byte_ranges(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 7 || nargs > 9) {
        PyErr_SetString(PyExc_TypeError, "changed_byte_ranges takes 7 to 9 arguments");
        return NULL;
    }
    int64_t rows_then, num_rows, row_bytes, max_ranges, max_bytes, tag = -1;
    if (read_int64(args[2], &rows_then) < 0 || read_int64(args[3], &num_rows) < 0 ||
        read_int64(args[4], &row_bytes) < 0 || read_int64(args[5], &max_ranges) < 0 ||
        read_int64(args[6], &max_bytes) < 0)
        return NULL;
    if (nargs == 9 && args[8] != Py_None) {
        if (read_int64(args[8], &tag) < 0)
            return NULL;
        if (tag < 0) {
            PyErr_SetString(PyExc_ValueError, "changed_byte_ranges: tag must be >= 0");
            return NULL;
        }
    }
    int64_t limit = num_rows < rows_then ? num_rows : rows_then;
    const int64_t *now, *then;
    Py_ssize_t ns, ts;
    if (get_keys(args[0], &now, limit, &ns) || get_keys(args[1], &then, limit, &ts))
        return Py_NewRef(Py_NotImplemented);
    if (nargs >= 8 && args[7] != Py_None) {
        const int64_t *all;
        Py_ssize_t as, os;
        int64_t *dst;
        if (num_rows < 0 || get_keys(args[0], &all, num_rows, &as) ||
            get_keys(args[7], (const int64_t **)&dst, num_rows, &os) ||
            !PyArray_ISWRITEABLE((PyArrayObject *)args[7]))
            return Py_NewRef(Py_NotImplemented);
        for (int64_t r = 0; r < num_rows; r++)
            dst[r * os] = all[r * as];
    }
    PyObject *out = NULL, *list = NULL;
    /* first pass: count ranges and bytes without allocating; second: build the list */
    int64_t count = 0, total = 0;
    for (int pass = 0; pass < 2; pass++) {
        int64_t cur_start = -1, cur_stop = -1;
        count = 0;
        total = 0;
        for (int64_t r = 0; r <= limit; r++) {
            int64_t a, e;
            if (r < limit) {
                int64_t t = then[r * ts], w = now[r * ns];
                if (t == w)
                    continue;
                int64_t len_then = t & length_mask, len_now = w & length_mask;
                int64_t version = w >> length_bits;
                if ((t >> length_bits) == version && version > 0 && len_now >= len_then) {
                    a = len_then;
                    e = len_now;
                } else {
                    a = 0;
                    e = len_then > len_now ? len_then : len_now;
                }
                if (e <= a)
                    continue;
                a = r * row_bytes + 4 * a;
                e = r * row_bytes + 4 * e;
            } else {
                if (num_rows <= rows_then)
                    break;
                a = rows_then * row_bytes;
                e = num_rows * row_bytes;
            }
            total += e - a;
            if (cur_stop == a) {
                cur_stop = e;
                continue;
            }
            if (cur_start >= 0) {
                if (pass == 1 && append_range(list, cur_start, cur_stop, tag) < 0)
                    goto done;
                count++;
            }
            cur_start = a;
            cur_stop = e;
        }
        if (cur_start >= 0) {
            if (pass == 1 && append_range(list, cur_start, cur_stop, tag) < 0)
                goto done;
            count++;
        }
        if (pass == 0) {
            if (count > max_ranges || total > max_bytes) {
                out = Py_NewRef(Py_None);
                goto done;
            }
            list = PyList_New(0);
            if (list == NULL)
                goto done;
        }
    }
    out = Py_BuildValue("(OL)", list, (long long)total);
done:
    Py_XDECREF(list);
    return out;
}

static PyMethodDef methods[] = {
    {"changed_byte_ranges", (PyCFunction)(void (*)(void))changed_byte_ranges, METH_FASTCALL,
     NULL},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL, NULL},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, NULL},
    {"prepare_step", (PyCFunction)(void (*)(void))prepare_step, METH_FASTCALL, NULL},
    {"write_replaced", (PyCFunction)(void (*)(void))write_replaced, METH_FASTCALL, NULL},
    {"key_spans", (PyCFunction)(void (*)(void))key_spans, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_block_tables_native", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__block_tables_native(void)
{
    import_array();
    return PyModule_Create(&module);
}
