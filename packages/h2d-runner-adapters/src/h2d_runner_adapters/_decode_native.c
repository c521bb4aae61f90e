/* Compiled producer body of DecodeStepInputs (decode_step.py); built by block_tables.native.
 *
 * decode_step checks the batch, computes each request's required pages, calls the block
 * table's prepare (which validates the rows before writing the table), and only then
 * writes every per-request and per-token member of a plain decode step (sampling, token
 * ids, query prefixes, MHA decode metadata and KV slots from the prepared table, graph
 * padding included). A rejected batch therefore writes no source. The results are
 * bit-identical to the numpy path in decode_step.py (same int32 wrap-around, NaN
 * propagation of the temperature clamp). Batches it does not cover (other dtypes, mixed
 * query lengths, a token count that is not n * q, capacities exceeded, contexts shorter
 * than the query) return None before any write: decode_step.py then raises the specific
 * error, or runs the numpy path for a valid batch it merely does not cover.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

/* The pinned sources of one DecodeStepInputs, bound once (they never move). */
enum {
    TEMPS, TOP_KS, TOP_PS, INPUT_IDS, DECODE_CU, DECODE_SRC, CU_SEQLENS_Q, POSITIONS,
    CONTEXT_LENS, KV_INDPTR, REQUIRED, SLOT_MAPPING, NUM_OUTPUTS
};
static const Py_ssize_t out_itemsize[NUM_OUTPUTS] = {4, 4, 4, 4, 4, 4, 4, 8, 4, 4, 4, 8};

typedef struct {
    PyObject *arrays[NUM_OUTPUTS];
    void *ptr[NUM_OUTPUTS];
    Py_ssize_t len[NUM_OUTPUTS]; /* items */
    PyObject *table_owner;       /* the slot's pinned CPU block table, int32 [rows, width] */
    const int32_t *table;
    Py_ssize_t table_rows, width;
    /* the batch's columns, copied before the table's prepare callback (Python code: it
     * could change the caller's arrays) and read only from here afterwards */
    int32_t *copy;
    /* required[:padded] of the last call: reused while the caller passes the same array
     * and padded size (a slice costs ~0.2 µs per step) */
    PyObject *req_base, *req_view;
    Py_ssize_t req_len;
} Outputs;

static void outputs_free(PyObject *capsule)
{
    Outputs *o = (Outputs *)PyCapsule_GetPointer(capsule, "h2d_decode_outputs");
    if (o == NULL)
        return;
    for (int i = 0; i < NUM_OUTPUTS; i++)
        Py_XDECREF(o->arrays[i]);
    Py_XDECREF(o->table_owner);
    Py_XDECREF(o->req_base);
    Py_XDECREF(o->req_view);
    PyMem_Free(o->copy);
    PyMem_Free(o);
}

/* bind_outputs(temps, top_ks, top_ps, input_ids, decode_cu, decode_src, cu_seqlens_q,
 *              positions, context_lens, kv_indptr, required, slot_mapping, table)
 * -> capsule; table: the slot's CPU block table (int32 [rows, width], C-contiguous). */
static PyObject *bind_outputs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != NUM_OUTPUTS + 1) {
        PyErr_Format(PyExc_TypeError, "bind_outputs takes %d arrays", NUM_OUTPUTS + 1);
        return NULL;
    }
    Outputs *o = PyMem_Calloc(1, sizeof(Outputs));
    if (o == NULL)
        return PyErr_NoMemory();
    {
        Py_buffer v;
        if (PyObject_GetBuffer(args[NUM_OUTPUTS], &v, PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        if (v.ndim != 2 || v.itemsize != 4) {
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_ValueError, "the block table must be int32 [rows, width]");
            goto fail;
        }
        o->table = v.buf;
        o->table_rows = v.shape[0];
        o->width = v.shape[1];
        o->table_owner = Py_NewRef(args[NUM_OUTPUTS]);
        PyBuffer_Release(&v);
    }
    for (int i = 0; i < NUM_OUTPUTS; i++) {
        Py_buffer v;
        if (PyObject_GetBuffer(args[i], &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        if (v.itemsize != out_itemsize[i]) {
            PyBuffer_Release(&v);
            PyErr_Format(PyExc_ValueError, "output %d has item size %zd, expected %zd", i,
                         v.itemsize, out_itemsize[i]);
            goto fail;
        }
        o->ptr[i] = v.buf;
        o->len[i] = v.len / v.itemsize;
        /* the reference keeps the (pinned, never reallocated) memory alive */
        o->arrays[i] = Py_NewRef(args[i]);
        PyBuffer_Release(&v);
    }
    /* five per-request columns and the token ids */
    o->copy = PyMem_Malloc((size_t)(5 * o->len[CONTEXT_LENS] + o->len[INPUT_IDS] + 1) * 4);
    if (o->copy == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    PyObject *capsule = PyCapsule_New(o, "h2d_decode_outputs", outputs_free);
    if (capsule != NULL)
        return capsule;
fail:
    for (int i = 0; i < NUM_OUTPUTS; i++)
        Py_XDECREF(o->arrays[i]);
    Py_XDECREF(o->table_owner);
    Py_XDECREF(o->req_base);
    Py_XDECREF(o->req_view);
    PyMem_Free(o->copy);
    PyMem_Free(o);
    return NULL;
}

/* A 1-D C-contiguous aligned native-order numpy array of int32 (kind 'i') or float32
 * ('f'): its data and item count, or -1. Read through numpy's macros: the buffer protocol
 * costs ~0.2 µs per array, several times this whole function. */
static Py_ssize_t get_input(PyObject *obj, const void **data, char kind)
{
    if (!PyArray_Check(obj))
        return -1;
    PyArrayObject *a = (PyArrayObject *)obj;
    int ok = PyArray_NDIM(a) == 1 && PyArray_ITEMSIZE(a) == 4 &&
             PyArray_IS_C_CONTIGUOUS(a) && PyArray_ISALIGNED(a) && PyArray_ISNOTSWAPPED(a) &&
             (kind == 'f' ? PyArray_TYPE(a) == NPY_FLOAT32
                          : PyArray_ISSIGNED(a) && PyArray_ISINTEGER(a));
    if (!ok)
        return -1;
    *data = PyArray_DATA(a);
    return PyArray_DIM(a, 0);
}

static int32_t ceil_pages(int32_t ctx, int32_t page, int shift)
{
    /* numpy int32 arithmetic: the addition wraps, the shift is arithmetic, // floors */
    int32_t up = (int32_t)((uint32_t)ctx + (uint32_t)(page - 1));
    if (shift >= 0)
        return up >> shift;
    int32_t q = up / page;
    if ((up % page != 0) && ((up < 0) != (page < 0)))
        q -= 1;
    return q;
}

enum { IN_QLENS, IN_CTX, IN_TEMPS, IN_TOP_K, IN_TOP_P, IN_PREV, IN_DRAFTS, IN_TOKENS, NUM_INPUTS };

/* decode_step(outputs, qlens, ctx, temps, top_k, top_p, prev_rows, num_drafts,
 *             token_ids, padded, page_size, greedy_temperature, prepare, rows, required)
 * -> (q, per_request_top_k (bool), per_request_top_p (bool), total_pages, draft_tokens,
 *     first request's top_k, first request's top_p)
 *    or None (not covered; nothing written).
 * prepare(rows, required_pages=required[:padded]) is the block-table state's prepare; an
 * exception it raises propagates before any source is written. */
static PyObject *decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "decode_step takes 15 arguments");
        return NULL;
    }
    Outputs *o = (Outputs *)PyCapsule_GetPointer(args[0], "h2d_decode_outputs");
    if (o == NULL)
        return NULL;
    Py_ssize_t p = PyLong_AsSsize_t(args[9]);
    if (p == -1 && PyErr_Occurred())
        return NULL;
    long page = PyLong_AsLong(args[10]);
    if (page == -1 && PyErr_Occurred())
        return NULL;
    double greedy_d = PyFloat_AsDouble(args[11]);
    if (greedy_d == -1.0 && PyErr_Occurred())
        return NULL;
    float greedy = (float)greedy_d;

    static const char in_kind[NUM_INPUTS] = {'i', 'i', 'f', 'i', 'f', 'i', 'i', 'i'};
    const void *in[NUM_INPUTS];
    Py_ssize_t len[NUM_INPUTS];
    PyObject *result = NULL;
    /* the caller holds every argument for the duration of the call (including across the
     * prepare callback), so the arrays' data stay valid */
    for (int k = 0; k < NUM_INPUTS; k++) {
        len[k] = get_input(args[1 + k], &in[k], in_kind[k]);
        if (len[k] < 0)
            goto not_covered;
    }
    Py_ssize_t n = len[IN_QLENS];
    for (int i = IN_CTX; i < IN_TOKENS; i++)
        if (len[i] != n)
            goto not_covered;
    const int32_t *qlens = in[IN_QLENS], *ctx = in[IN_CTX];
    const float *temps = in[IN_TEMPS], *top_p = in[IN_TOP_P];
    const int32_t *top_k = in[IN_TOP_K], *prev = in[IN_PREV];
    const int32_t *tokens = in[IN_TOKENS], *drafts = in[IN_DRAFTS];
    Py_ssize_t t = len[IN_TOKENS];
    int32_t q = n ? qlens[0] : 1;
    if (q < 1 || p < n || page < 1 || page > INT32_MAX || t != n * (Py_ssize_t)q)
        goto not_covered;
    for (Py_ssize_t i = 1; i < n; i++)
        if (qlens[i] != q)
            goto not_covered;
    Py_ssize_t pt = p * q;
    if (p > o->len[TEMPS] || p > o->len[TOP_KS] || p > o->len[TOP_PS] ||
        pt > o->len[INPUT_IDS] || p + 1 > o->len[DECODE_CU] || p > o->len[DECODE_SRC] ||
        p + 1 > o->len[CU_SEQLENS_Q] || pt > o->len[POSITIONS] || p > o->len[CONTEXT_LENS] ||
        p + 1 > o->len[KV_INDPTR] || p > o->len[REQUIRED] || pt > o->len[SLOT_MAPPING])
        goto not_covered;
    if (p > o->table_rows)
        goto not_covered;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((int64_t)ctx[i] - q < 0) /* a context shorter than its query */
            goto not_covered;

    /* ---- copy the columns: the prepare callback runs Python code, so nothing after it
     * may read the caller's arrays (n <= p <= the context_lens capacity, t <= pt <= the
     * input_ids capacity: checked above) ---- */
    {
        int32_t *cp = o->copy;
        Py_ssize_t stride = o->len[CONTEXT_LENS];
        memcpy(cp, ctx, (size_t)n * 4);
        ctx = cp;
        memcpy(cp + stride, temps, (size_t)n * 4);
        temps = (const float *)(cp + stride);
        memcpy(cp + 2 * stride, top_k, (size_t)n * 4);
        top_k = cp + 2 * stride;
        memcpy(cp + 3 * stride, top_p, (size_t)n * 4);
        top_p = (const float *)(cp + 3 * stride);
        memcpy(cp + 4 * stride, prev, (size_t)n * 4);
        prev = cp + 4 * stride;
        memcpy(cp + 5 * stride, tokens, (size_t)t * 4);
        tokens = cp + 5 * stride;
    }
    int64_t draft_tokens = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        draft_tokens += drafts[i];

    /* ---- required pages (scratch, not a source), then the table's own checks + write -- */
    int32_t *req = o->ptr[REQUIRED];
    int shift = (page & (page - 1)) == 0 ? __builtin_ctzl((unsigned long)page) : -1;
    for (Py_ssize_t i = 0; i < n; i++)
        req[i] = ceil_pages(ctx[i], (int32_t)page, shift);
    for (Py_ssize_t i = n; i < p; i++)
        req[i] = 0;
    {
        if (o->req_base != args[14] || o->req_len != p || o->req_view == NULL) {
            PyObject *view = PySequence_GetSlice(args[14], 0, p);
            if (view == NULL)
                goto release;
            Py_XSETREF(o->req_view, view);
            Py_XSETREF(o->req_base, Py_NewRef(args[14]));
            o->req_len = p;
        }
        static PyObject *kwnames = NULL;
        if (kwnames == NULL && (kwnames = Py_BuildValue("(s)", "required_pages")) == NULL)
            goto release;
        PyObject *view = Py_NewRef(o->req_view); /* the callback may replace the cache */
        PyObject *call_args[2] = {args[13], view};
        PyObject *r = PyObject_Vectorcall(args[12], call_args, 1, kwnames);
        Py_DECREF(view);
        if (r == NULL)
            goto release; /* the rows were rejected: no source written */
        Py_DECREF(r);
    }

    /* ---- sampling: clamp temperatures; per-request filters only when they differ ---- */
    float *out_t = o->ptr[TEMPS];
    for (Py_ssize_t i = 0; i < n; i++) {
        float x = temps[i];
        out_t[i] = (x != x || x > greedy) ? x : greedy; /* np.maximum: NaN propagates */
    }
    int k_rows = n > 1 && memcmp(top_k, top_k + 1, (size_t)(n - 1) * 4) != 0;
    int p_rows = n > 1 && memcmp(top_p, top_p + 1, (size_t)(n - 1) * 4) != 0;
    if (k_rows)
        memcpy(o->ptr[TOP_KS], top_k, (size_t)n * 4);
    if (p_rows)
        memcpy(o->ptr[TOP_PS], top_p, (size_t)n * 4);

    /* ---- token inputs: ids (padding 0), prefixes (tail repeats t), deferred rows ---- */
    int32_t *ids = o->ptr[INPUT_IDS];
    memcpy(ids, tokens, (size_t)t * 4);
    memset(ids + t, 0, (size_t)(pt - t) * 4);
    int32_t *cu = o->ptr[DECODE_CU], *cuq = o->ptr[CU_SEQLENS_Q];
    uint32_t acc = 0;
    cu[0] = cuq[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        acc += (uint32_t)q; /* every request runs q tokens: checked above */
        cu[i + 1] = cuq[i + 1] = (int32_t)acc;
    }
    for (Py_ssize_t i = n + 1; i <= p; i++)
        cu[i] = cuq[i] = (int32_t)acc;
    int32_t *src = o->ptr[DECODE_SRC];
    memcpy(src, prev, (size_t)n * 4);
    for (Py_ssize_t i = n; i < p; i++)
        src[i] = -1;

    /* ---- MHA decode: positions, slots, context lengths, KV prefix (padding empty) ---- */
    int64_t *pos = o->ptr[POSITIONS], *slots = o->ptr[SLOT_MAPPING];
    int32_t *lens = o->ptr[CONTEXT_LENS], *indptr = o->ptr[KV_INDPTR];
    uint32_t total = 0;
    indptr[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t c = ctx[i];
        const int32_t *row = o->table + i * o->width;
        for (int32_t j = 0; j < q; j++) {
            int64_t x = (int64_t)c - q + j; /* >= 0: checked above */
            int64_t col = shift >= 0 ? x >> shift : x / page;
            int64_t off = shift >= 0 ? (x & (page - 1)) : x % page;
            pos[i * q + j] = x;
            /* col < required <= the row's length (checked by prepare); numpy multiplies
             * the int32 page ID by the page size in int32 (wrapping), then widens */
            slots[i * q + j] = (int64_t)(int32_t)((uint32_t)row[col] * (uint32_t)page) + off;
        }
        lens[i] = c;
        total += (uint32_t)req[i];
        indptr[i + 1] = (int32_t)total;
    }
    memset(pos + t, 0, (size_t)(pt - t) * 8);
    for (Py_ssize_t k = t; k < pt; k++)
        slots[k] = -1;
    for (Py_ssize_t i = n; i < p; i++) {
        lens[i] = 0;
        indptr[i + 1] = (int32_t)total;
    }
    /* the first request's top-k / top-p: the uniform CPU scalars when no row differs */
    result = Py_BuildValue("(iOOLLid)", (int)q, k_rows ? Py_True : Py_False,
                           p_rows ? Py_True : Py_False, (long long)(int32_t)total,
                           (long long)draft_tokens, n ? (int)top_k[0] : 0,
                           n ? (double)top_p[0] : 1.0);
    goto release;

not_covered:
    result = Py_NewRef(Py_None);
release:
    return result;
}

static PyMethodDef methods[] = {
    {"bind_outputs", (PyCFunction)(void (*)(void))bind_outputs, METH_FASTCALL, NULL},
    {"decode_step", (PyCFunction)(void (*)(void))decode_step, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_h2d_decode_native", NULL, -1, methods,
};

PyMODINIT_FUNC PyInit__h2d_decode_native(void)
{
    import_array();
    return PyModule_Create(&module);
}
