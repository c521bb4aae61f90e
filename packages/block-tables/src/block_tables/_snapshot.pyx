# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: binding=False, embedsignature=False
"""Compiled paths of PageTableSnapshot (``block_tables._snapshot_native``).

A decode step's prepare reads 64-256 row keys, scatters a few appended page IDs and
diffs row keys into byte ranges: a few hundred nanoseconds of arithmetic, tens of
microseconds as Python and numpy calls. These are that arithmetic, compiled:

* ``prepare_step`` covers the common decode and prefill-chunk steps: every row a
  ``BlockTable`` whose key equals the stored key (a hit) or exceeds it by at most the
  table's width (the same lineage grew: one page from its ``_last`` slot, more from its
  lineage's ``ids`` array).
  Any other batch, and every error, returns None before the first write: snapshot.py then
  handles the batch, so its rules and messages live in one place.
* ``write_replaced`` is the write phase of a fully replaced batch (snapshot.py has made
  every check): the rows' IDs, then one sweep over the exposed tails.
* ``key_spans`` and ``changed_byte_ranges`` diff two all-versioned row-key vectors into
  column spans, or byte ranges of the row-major table (spans.py).

Python sees what the C module it replaces (``_snapshot_native.c``) showed: builtin
functions taking positional arguments, a ``PyCapsule`` named ``"block_tables_snapshot"``
as the binding, None / NotImplemented for what they hand back, and the same exceptions
with the same messages. Integer arguments go through ``PyLong_AsLongLong`` /
``PyLong_AsSsize_t`` in the C code's order. Differences, none visible to snapshot.py:
a call that changed no byte returns a shared read-only empty array (the caller only takes
its length), not a new one; ``configure`` takes only ``__slots__`` members (it reads
their offsets); a ``_key`` / ``_last`` slot set by hand to an int outside int64 raises
OverflowError with Cython's message rather than the C API's.
"""

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release,
                             PyObject_GetBuffer)
# PyList_Append called directly: Cython's list.append() inlines a check that short lists
# fail anyway (~10 instructions an item more)
from cpython.list cimport PyList_Append, PyList_CheckExact, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLong, PyLong_AsLongLong, PyLong_AsSsize_t
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.sequence cimport PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS
from cpython.tuple cimport PyTuple_CheckExact
from libc.stdint cimport INT32_MAX, INT32_MIN, INT64_MIN, int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove

cdef extern from "Python.h":
    ctypedef struct RawType "PyTypeObject":
        const char *tp_name
    RawType *type_of "Py_TYPE"(PyObject *)
    bint long_check_exact "PyLong_CheckExact"(PyObject *)
    # a __slots__ entry's descriptor: the member it reads (structmember.h)
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    RawType PyMemberDescr_Type

cdef extern from "structmember.h":
    enum:
        T_OBJECT_EX  # an object slot; unset reads raise AttributeError

# numpy's C API, through its macros on raw pointers (as the C module read arrays: the
# buffer protocol costs ~0.2 µs a call)
cdef extern from *:
    """
    #define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
    """
cdef extern from "numpy/arrayobject.h":
    ctypedef Py_ssize_t npy_intp
    ctypedef struct PyArrayObject:
        pass
    enum:
        NPY_INT32
        NPY_INT64
    bint PyArray_Check(PyObject *)
    int PyArray_NDIM(PyArrayObject *)
    npy_intp PyArray_DIM(PyArrayObject *, int)
    npy_intp PyArray_STRIDE(PyArrayObject *, int)
    npy_intp PyArray_ITEMSIZE(PyArrayObject *)
    int PyArray_TYPE(PyArrayObject *)
    void *PyArray_DATA(PyArrayObject *)
    bint PyArray_ISINTEGER(PyArrayObject *)
    bint PyArray_ISSIGNED(PyArrayObject *)
    bint PyArray_ISUNSIGNED(PyArrayObject *)
    bint PyArray_ISALIGNED(PyArrayObject *)
    bint PyArray_ISNOTSWAPPED(PyArrayObject *)
    bint PyArray_ISWRITEABLE(PyArrayObject *)
    object PyArray_SimpleNew(int, npy_intp *, int)
    int _import_array() except -1

_import_array()

# ---- configuration: BlockTable's slots and the key layout (configure) -----------------

# BlockTable and where its `_key` / `_last` slots live, read once from their member
# descriptors: a row's slot is then one load (a borrowed reference, NULL when unset), not
# a generic attribute lookup (~30 ns a row) nor a descriptor call (~10 ns). Every row is
# checked to be exactly BlockTable first. `configured` holds the references.
cdef object configured = None
cdef PyObject *table_type = NULL
cdef Py_ssize_t key_offset = 0
cdef Py_ssize_t last_offset = 0
# BlockTable's `_lin` slot and its lineage's `ids` slot (the lineage's int32 page IDs)
cdef Py_ssize_t lin_offset = 0
cdef Py_ssize_t ids_offset = 0
cdef PyObject *lineage_type = NULL
cdef int length_bits = 24
cdef int64_t length_mask = (1 << 24) - 1


cdef object empty_rows():
    cdef npy_intp dims[1]
    dims[0] = 0
    rows = PyArray_SimpleNew(1, dims, NPY_INT64)
    rows.setflags(write=False)
    return rows


# what a call that changed no byte returns (the caller only takes its length)
cdef object EMPTY = empty_rows()


def configure(table, bits, lineage, /):
    """configure(BlockTable, LENGTH_BITS, lineage type): the row type, the key's length
    field and the lineage type (its ``ids`` slot)."""
    global configured, table_type, key_offset, last_offset, length_bits, length_mask
    global lin_offset, ids_offset, lineage_type
    cdef long nbits
    cdef Py_ssize_t offsets[4]
    cdef PyMemberDef *member
    cdef int k
    if not isinstance(table, type) or not isinstance(lineage, type):
        raise TypeError("configure(BlockTable, LENGTH_BITS, lineage type)")
    nbits = PyLong_AsLong(bits)
    for k, (owner, name) in enumerate(((table, "_key"), (table, "_last"), (table, "_lin"),
                                       (lineage, "ids"))):
        descr = getattr(owner, name)
        member = (<PyMemberDescrObject *><PyObject *>descr).d_member
        if type_of(<PyObject *>descr) != &PyMemberDescr_Type or member.type != T_OBJECT_EX:
            raise TypeError(f"{(<RawType *><PyObject *>owner).tp_name.decode()}.{name} "
                            "is not a slot descriptor")
        offsets[k] = member.offset
    configured = (table, lineage)
    table_type = <PyObject *>table
    key_offset = offsets[0]
    last_offset = offsets[1]
    lin_offset = offsets[2]
    ids_offset = offsets[3]
    lineage_type = <PyObject *>lineage
    length_bits = <int>nbits
    length_mask = (<int64_t>1 << nbits) - 1


cdef inline int slot_int64(PyObject *row, Py_ssize_t offset, int64_t *out) except -1:
    """A BlockTable slot's value: 0 and it in out; 1 when it is unset or not an exact int
    (snapshot.py handles such a row); -1 with the exception set (OverflowError)."""
    cdef PyObject *v = (<PyObject **>(<char *>row + offset))[0]  # borrowed, or NULL
    if v == NULL or not long_check_exact(v):
        return 1
    out[0] = <int64_t><object>v
    return 0


# ---- the binding: the snapshot's own arrays (bind) -------------------------------------

cdef const char *CAPSULE = b"block_tables_snapshot"
# prepare_step's mark of a row grown by several pages (its IDs read from its lineage)
cdef int64_t MULTI = INT64_MIN + 1

# the snapshot's bookkeeping, int64 fields of its ``meta`` array (snapshot.py reads them
# through properties): C integers, so a step that bumps the revision past CPython's small
# ints boxes nothing
cdef enum:
    META_REVISION = 0
    META_NUM_ROWS = 1
    META_ALL_VERSIONED = 2  # every row of the last batch was a BlockTable
    META_KEYS_VALID = 3  # snapshot.py's packed keys of the last batch still describe it
    META_SIZE = 4


cdef struct Bound:
    PyObject *owner  # a strong reference: the tuple of the arrays (they never move)
    int64_t *row_keys
    int64_t *lengths
    int64_t *changed
    int64_t *scratch
    int32_t *storage
    int64_t *meta
    # the history ring: revision r's changed rows are hist_rows[r % hist_len] (its first
    # hist_count[r % hist_len] items; -1: every row)
    int64_t *hist_count
    int64_t *hist_rows
    Py_ssize_t hist_len
    Py_ssize_t capacity
    Py_ssize_t width
    # the page only padding rows may hold (-1: none): a real row appending it is handed
    # back, so snapshot.py refuses it with the specific error
    int64_t reserved


cdef void bound_free(object capsule) noexcept:
    cdef Bound *b = <Bound *>PyCapsule_GetPointer(capsule, CAPSULE)
    if b == NULL:
        return
    Py_XDECREF(b.owner)
    PyMem_Free(b)


def bind(row_keys, lengths, storage, changed, scratch, width, meta, hist_count, hist_rows,
         reserved, /):
    """bind(row_keys, lengths, storage, changed, scratch, width, meta, hist_count,
    hist_rows, reserved) -> capsule

    row_keys, lengths, changed: int64[capacity]; storage: int32[capacity, width];
    scratch: int64[3 * capacity]; meta: int64[4] (revision, rows, all versioned, keys
    valid); hist_count: int64[history]; hist_rows: int64[history * capacity]; each
    writable and C-contiguous; reserved: the page only padding rows hold, or -1. Bound
    once, so per-step calls pay no buffer-protocol lookup for them."""
    cdef Py_ssize_t w = PyLong_AsSsize_t(width)
    cdef int64_t kept = PyLong_AsLongLong(reserved)
    cdef Py_ssize_t itemsize[8]
    cdef Py_ssize_t items[8]
    cdef void *ptr[8]
    cdef Py_buffer view
    cdef Py_ssize_t capacity
    cdef bint bad
    cdef Bound *b
    cdef int i
    arrays = (row_keys, lengths, storage, changed, scratch, meta, hist_count, hist_rows)
    itemsize[:] = [8, 8, 4, 8, 8, 8, 8, 8]
    for i in range(8):
        PyObject_GetBuffer(arrays[i], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
        ptr[i] = view.buf
        items[i] = view.len // itemsize[i]
        bad = view.itemsize != itemsize[i]
        PyBuffer_Release(&view)  # the arrays stay alive (owner), and never reallocate
        if bad:
            raise ValueError("internal array has the wrong item size or length")
    capacity = items[0]
    if (items[1] < capacity or items[2] < capacity * w or items[3] < capacity
            or items[4] < 3 * capacity or items[5] < META_SIZE or items[6] < 1
            or items[7] < items[6] * capacity):
        raise ValueError("bind: arrays too small for the capacity")
    b = <Bound *>PyMem_Calloc(1, sizeof(Bound))
    if b == NULL:
        raise MemoryError()
    b.row_keys = <int64_t *>ptr[0]
    b.lengths = <int64_t *>ptr[1]
    b.storage = <int32_t *>ptr[2]
    b.changed = <int64_t *>ptr[3]
    b.scratch = <int64_t *>ptr[4]
    b.meta = <int64_t *>ptr[5]
    b.hist_count = <int64_t *>ptr[6]
    b.hist_rows = <int64_t *>ptr[7]
    b.hist_len = items[6]
    b.capacity = capacity
    b.width = w
    b.reserved = kept
    try:
        capsule = PyCapsule_New(b, CAPSULE, bound_free)
    except BaseException:
        PyMem_Free(b)  # no capsule: nothing else refers to b
        raise
    Py_INCREF(arrays)  # dropped by the capsule's destructor
    b.owner = <PyObject *>arrays
    return capsule


cdef inline object rows_array(const int64_t *rows, Py_ssize_t count):
    """A new int64 array of ``rows[0, count)`` (EMPTY when there are none)."""
    cdef npy_intp dims[1]
    if count == 0:
        return EMPTY
    dims[0] = count
    out = PyArray_SimpleNew(1, dims, NPY_INT64)
    memcpy(PyArray_DATA(<PyArrayObject *>out), rows, <size_t>count * sizeof(int64_t))
    return out


# ---- the common decode step -------------------------------------------------------------

def prepare_step(bound, rows, limit, required, pad_row=None, pad=0, /):
    """prepare_step(bound, rows, limit, required[, pad_row, pad]) -> rows changed, or -1

    The batch is ``rows`` followed by ``pad`` times ``pad_row`` (graph padding, without
    a list built for it).

    rows: list or tuple; limit: the pool limit, or -1 for none (every appended ID is
    still checked to be >= 0: -1 is never a page; a real row's appended ID is the bound
    reserved page: handed back); required: None or a 1-D signed or
    unsigned 4/8-byte integer array of len(rows). Returns how many rows' bytes changed
    (0 for a hit; they are the bound ``changed`` array's first items, ascending, and the
    history's entry of the revision this advanced to), the snapshot's bookkeeping (the
    ``meta`` fields) updated; or -1, before any write, when the batch is not covered."""
    cdef Bound *b
    cdef PyObject **items
    cdef PyObject *row
    cdef PyArrayObject *r
    cdef Py_ssize_t n, nr, extra, i, c
    cdef int64_t lim, width, key, stored, length, need, last
    cdef int64_t *new_keys
    cdef int64_t *lasts
    cdef int64_t *sources
    cdef int64_t grown
    cdef PyObject *lin
    cdef PyObject *ids
    cdef PyArrayObject *a
    cdef const int32_t *src
    cdef int32_t *cell
    cdef const char *req = NULL
    cdef const char *at
    cdef Py_ssize_t req_stride = 0, req_size = 0
    cdef bint unsigned_req = False
    if table_type == NULL:
        raise RuntimeError("prepare_step before configure()")
    b = <Bound *>PyCapsule_GetPointer(bound, CAPSULE)
    if not PyList_CheckExact(rows) and not PyTuple_CheckExact(rows):
        return -1
    nr = PySequence_Fast_GET_SIZE(rows)
    items = PySequence_Fast_ITEMS(rows)
    extra = PyLong_AsSsize_t(pad)
    if extra < 0 or (extra and pad_row is None):
        return -1
    n = nr + extra
    lim = PyLong_AsLongLong(limit)
    if lim < 0:  # no pool limit: [0, 2**31), the lower bound in the same comparison
        lim = <int64_t>INT32_MAX + 1
    width = b.width
    if n > b.capacity:
        return -1
    # required pages: a 1-D aligned native-order integer array of 4 or 8 bytes per item;
    # anything else goes to snapshot.py, which coerces and checks it
    if required is not None:
        if not PyArray_Check(<PyObject *>required):
            return -1
        r = <PyArrayObject *><PyObject *>required
        req_size = PyArray_ITEMSIZE(r)
        if (PyArray_NDIM(r) != 1 or PyArray_DIM(r, 0) != n or not PyArray_ISINTEGER(r)
                or (req_size != 4 and req_size != 8) or not PyArray_ISALIGNED(r)
                or not PyArray_ISNOTSWAPPED(r)):
            return -1
        req = <const char *>PyArray_DATA(r)
        req_stride = PyArray_STRIDE(r, 0)
        unsigned_req = PyArray_ISUNSIGNED(r)

    new_keys = b.scratch
    lasts = b.scratch + b.capacity  # the appended page ID, INT64_MIN a hit, MULTI more
    sources = b.scratch + 2 * b.capacity  # a grown row's int32 IDs (its lineage's array)

    # ---- check everything: no write before the batch is known to be covered ----
    for i in range(n):
        row = items[i] if i < nr else <PyObject *>pad_row
        if <PyObject *>type_of(row) != table_type:
            return -1
        if slot_int64(row, key_offset, &key):
            return -1
        length = key & length_mask
        if length > width:
            return -1
        if req != NULL:
            at = req + i * req_stride
            if req_size == 4:
                need = (<int64_t>(<const uint32_t *>at)[0] if unsigned_req
                        else <int64_t>(<const int32_t *>at)[0])
            else:
                need = (<const int64_t *>at)[0]  # uint64 past 2**63 reads negative: huge
            if <uint64_t>need > <uint64_t>length:  # negative reads as huge
                return -1
        new_keys[i] = key
        stored = b.row_keys[i]
        if key == stored:
            lasts[i] = INT64_MIN
        elif <uint64_t>key - <uint64_t>stored == 1:  # unsigned: no overflow
            if slot_int64(row, last_offset, &last):
                return -1
            if <uint64_t>last >= <uint64_t>lim:  # negative (or past int32) reads as huge
                return -1
            if last == b.reserved and i < nr:  # only the padding rows may hold it
                return -1
            lasts[i] = last
        elif <uint64_t>key - <uint64_t>stored <= <uint64_t>width:
            # The same lineage grew by several pages (a prefill chunk): with width below
            # half the key's length field, a difference this small means the same
            # version. Its new IDs are its lineage's ids[stored length, length).
            grown = key - stored
            lin = (<PyObject **>(<char *>row + lin_offset))[0]
            if lin == NULL or <PyObject *>type_of(lin) != lineage_type:
                return -1
            ids = (<PyObject **>(<char *>lin + ids_offset))[0]
            if ids == NULL or not PyArray_Check(ids):
                return -1
            a = <PyArrayObject *>ids
            if (PyArray_NDIM(a) != 1 or PyArray_TYPE(a) != NPY_INT32
                    or PyArray_DIM(a, 0) < length or PyArray_STRIDE(a, 0) != 4
                    or not PyArray_ISALIGNED(a) or not PyArray_ISNOTSWAPPED(a)):
                return -1
            src = (<const int32_t *>PyArray_DATA(a)) + (length - grown)
            for c in range(grown):
                if <uint64_t><uint32_t>src[c] >= <uint64_t>lim:
                    return -1
                if src[c] == b.reserved and i < nr:
                    return -1
            lasts[i] = MULTI
            sources[i] = <int64_t>src
        else:
            return -1

    # ---- write: each grown row's new IDs, counted only when its bytes differ ----
    c = 0
    for i in range(n):
        if lasts[i] == MULTI:
            cell = b.storage + i * width + b.lengths[i]
            grown = (new_keys[i] & length_mask) - b.lengths[i]
            src = <const int32_t *>sources[i]
            if memcmp(cell, src, <size_t>grown * sizeof(int32_t)):
                memcpy(cell, src, <size_t>grown * sizeof(int32_t))
                b.changed[c] = i
                c += 1
            b.row_keys[i] = new_keys[i]
            b.lengths[i] = new_keys[i] & length_mask
        elif lasts[i] != INT64_MIN:
            cell = b.storage + i * width + b.lengths[i]
            if cell[0] != <int32_t>lasts[i]:
                cell[0] = <int32_t>lasts[i]
                b.changed[c] = i
                c += 1
            b.row_keys[i] = new_keys[i]
            b.lengths[i] = new_keys[i] & length_mask
    b.meta[META_NUM_ROWS] = n
    b.meta[META_ALL_VERSIONED] = 1
    b.meta[META_KEYS_VALID] = 0  # snapshot.py's packed keys describe an older batch
    if c:
        bump_revision(b, b.changed, c)
    return c


# ---- the revision and its history --------------------------------------------------------

cdef void bump_revision(Bound *b, const int64_t *rows, Py_ssize_t count) noexcept:
    """The next revision changed ``rows[0, count)`` (ascending; count -1: every row):
    advance the revision and record it in the history ring, over its oldest entry."""
    cdef int64_t revision = b.meta[META_REVISION] + 1
    cdef Py_ssize_t at = <Py_ssize_t>(revision % b.hist_len)
    b.meta[META_REVISION] = revision
    b.hist_count[at] = count
    if count > 0:
        memcpy(b.hist_rows + at * b.capacity, rows, <size_t>count * sizeof(int64_t))


def record_revision(bound, rows, /):
    """record_revision(bound, rows) -> the new revision

    snapshot.py's write paths: the next revision changed ``rows`` (a 1-D int64 array of
    distinct rows below the capacity, ascending) or every row (None)."""
    cdef Bound *b = <Bound *>PyCapsule_GetPointer(bound, CAPSULE)
    cdef PyArrayObject *a
    cdef Py_ssize_t count = -1
    cdef const int64_t *data = NULL
    if rows is not None:
        if not PyArray_Check(<PyObject *>rows):
            raise TypeError("record_revision: rows must be an int64 array or None")
        a = <PyArrayObject *><PyObject *>rows
        if (PyArray_NDIM(a) != 1 or PyArray_TYPE(a) != NPY_INT64 or not PyArray_ISALIGNED(a)
                or not PyArray_ISNOTSWAPPED(a) or PyArray_DIM(a, 0) > b.capacity
                or (PyArray_DIM(a, 0) > 1
                    and PyArray_STRIDE(a, 0) != <npy_intp>sizeof(int64_t))):
            raise ValueError("record_revision: rows must be a contiguous 1-D int64 array of "
                             "at most the capacity")
        count = PyArray_DIM(a, 0)
        data = <const int64_t *>PyArray_DATA(a)
    bump_revision(b, data, count)
    return b.meta[META_REVISION]


# ---- a fully replaced batch ---------------------------------------------------------------

cdef inline int64_t clear_span(int32_t *p, int64_t count, int32_t fill) noexcept nogil:
    """Set the ``count`` elements at ``p`` that differ from ``fill`` to it; return how
    many. The only place this module writes the fill value."""
    cdef int64_t k, cleared = 0
    for k in range(count):
        if p[k] != fill:
            p[k] = fill
            cleared += 1
    return cleared


def write_replaced(bound, ids, fill, /):
    """write_replaced(bound, ids, fill) -> (changed rows, cleared), or None

    The write phase of a fully replaced batch (every check made in snapshot.py): row i of
    [0, len(ids)) takes the int32 array ids[i]. First each row's IDs, compared first and
    copied without clearing; then one sweep over rows [0, n) clears each exposed tail,
    columns [len(ids[i]), lengths[i]) (lengths: what the rows held), writing only elements
    that differ from ``fill``. Returns an int64 array of the rows whose bytes changed,
    ascending, and the number of elements cleared; None, before any write, when an item
    is not a 1-D aligned native-order C-contiguous int32 array of at most ``width`` IDs."""
    cdef Bound *b
    cdef PyObject **items
    cdef PyArrayObject *a
    cdef Py_ssize_t n, i, c, width
    cdef int64_t fill64, exposed, k, cleared = 0
    cdef int32_t value
    cdef int64_t *flags
    cdef int64_t *lens
    cdef int32_t *row
    cdef size_t nbytes
    b = <Bound *>PyCapsule_GetPointer(bound, CAPSULE)
    if not PyList_CheckExact(ids):
        return None
    fill64 = PyLong_AsLongLong(fill)
    if fill64 < INT32_MIN or fill64 > INT32_MAX:
        raise ValueError("write_replaced: fill must be an int32")
    value = <int32_t>fill64
    n = PyList_GET_SIZE(ids)
    width = b.width
    if n > b.capacity:
        return None
    items = PySequence_Fast_ITEMS(ids)
    flags = b.scratch  # per row: bytes changed
    lens = b.scratch + b.capacity
    # ---- check every row: nothing is written before all are known to be readable ----
    for i in range(n):
        if not PyArray_Check(items[i]):
            return None
        a = <PyArrayObject *>items[i]
        if (PyArray_NDIM(a) != 1 or PyArray_TYPE(a) != NPY_INT32 or not PyArray_ISALIGNED(a)
                or not PyArray_ISNOTSWAPPED(a) or PyArray_DIM(a, 0) > width
                or (PyArray_DIM(a, 0) > 1 and PyArray_STRIDE(a, 0) != <npy_intp>sizeof(int32_t))):
            return None
        lens[i] = PyArray_DIM(a, 0)
    # ---- the IDs: compared first, copied without clearing what they replace ----
    for i in range(n):
        row = b.storage + i * width
        nbytes = <size_t>lens[i] * sizeof(int32_t)
        flags[i] = nbytes != 0 and memcmp(row, PyArray_DATA(<PyArrayObject *>items[i]),
                                          nbytes) != 0
        if flags[i]:  # memmove: a caller's array may be a view of the storage
            memmove(row, PyArray_DATA(<PyArrayObject *>items[i]), nbytes)
    # ---- one sweep over rows [0, n): the exposed tails ----
    for i in range(n):
        exposed = b.lengths[i] - lens[i]
        if exposed > 0:
            k = clear_span(b.storage + i * width + lens[i], exposed, value)
            cleared += k
            if k > 0:
                flags[i] = 1
    c = 0
    for i in range(n):
        if flags[i]:
            b.changed[c] = i
            c += 1
    return rows_array(b.changed, c), cleared


# ---- row-key diffs (spans.py) -----------------------------------------------------------

cdef inline bint get_keys(object obj, const int64_t **data, Py_ssize_t count,
                          Py_ssize_t *stride):
    """False and data/stride (in items) for a 1-D aligned native-order signed int64
    array (any stride) of at least ``count`` items; True for anything else (the caller
    hands it back to the Python path)."""
    cdef PyArrayObject *a
    if not PyArray_Check(<PyObject *>obj):
        return True
    a = <PyArrayObject *><PyObject *>obj
    if (PyArray_NDIM(a) != 1 or PyArray_ITEMSIZE(a) != 8 or not PyArray_ISSIGNED(a)
            or not PyArray_ISINTEGER(a) or not PyArray_ISALIGNED(a)
            or not PyArray_ISNOTSWAPPED(a) or PyArray_DIM(a, 0) < count
            or PyArray_STRIDE(a, 0) % 8):
        return True
    data[0] = <const int64_t *>PyArray_DATA(a)
    stride[0] = PyArray_STRIDE(a, 0) // 8
    return False


cdef inline bint span_of(int64_t then, int64_t now, int64_t *start, int64_t *stop) noexcept:
    """The columns a row with key ``then`` and now ``now`` differs in: an append in the
    same lineage (a version above 0, not shorter) in [len_then, len_now), anything else in
    [0, max(len_then, len_now)). False when that is empty (equal keys included)."""
    cdef int64_t len_then, len_now, version
    if then == now:
        return False
    len_then = then & length_mask
    len_now = now & length_mask
    version = now >> length_bits
    if (then >> length_bits) == version and version > 0 and len_now >= len_then:
        start[0] = len_then
        stop[0] = len_now
    else:
        start[0] = 0
        stop[0] = len_then if len_then > len_now else len_now
    return stop[0] > start[0]


def key_spans(now, then, limit, /):
    """key_spans(now, then, limit) -> (rows, starts, stops), or NotImplemented

    The all-versioned branch of spans.changed_spans: rows of [0, limit) whose int64 keys
    differ, with their column spans (span_of); NotImplemented when the keys are not int64
    arrays this reads."""
    cdef Py_ssize_t lim = PyLong_AsSsize_t(limit)
    cdef const int64_t *w
    cdef const int64_t *t
    cdef Py_ssize_t ns, ts, r
    cdef int64_t start, stop
    cdef list rows, starts, stops
    if get_keys(now, &w, lim, &ns) or get_keys(then, &t, lim, &ts):
        return NotImplemented
    rows, starts, stops = [], [], []
    for r in range(lim):
        if span_of(t[r * ts], w[r * ns], &start, &stop):
            PyList_Append(rows, r)
            PyList_Append(starts, start)
            PyList_Append(stops, stop)
    return rows, starts, stops


cdef void byte_ranges(const int64_t *now, Py_ssize_t ns, const int64_t *then, Py_ssize_t ts,
                      int64_t limit, int64_t rows_then, int64_t num_rows, int64_t row_bytes,
                      int64_t tag, int64_t *out, int64_t *count, int64_t *total) noexcept:
    """One pass of the byte-range diff: count the merged ranges and their bytes, and write
    each as the triple (tag, start, nbytes) at ``out[3 * k]`` unless ``out`` is NULL."""
    cdef int64_t r, a, e, cur_start = -1, cur_stop = -1
    count[0] = 0
    total[0] = 0
    for r in range(limit + 1):
        if r < limit:
            if not span_of(then[r * ts], now[r * ns], &a, &e):
                continue
            a = r * row_bytes + 4 * a
            e = r * row_bytes + 4 * e
        elif num_rows > rows_then:  # rows the destination never held travel whole
            a = rows_then * row_bytes
            e = num_rows * row_bytes
        else:
            break
        total[0] += e - a
        if cur_stop == a:  # byte-adjacent: one range
            cur_stop = e
            continue
        if cur_start >= 0:
            if out != NULL:
                out[3 * count[0]] = tag
                out[3 * count[0] + 1] = cur_start
                out[3 * count[0] + 2] = cur_stop - cur_start
            count[0] += 1
        cur_start = a
        cur_stop = e
    if cur_start >= 0:
        if out != NULL:
            out[3 * count[0]] = tag
            out[3 * count[0] + 1] = cur_start
            out[3 * count[0] + 2] = cur_stop - cur_start
        count[0] += 1


cdef int copy_keys(object now, object keys_out, int64_t n_now) except -1:
    """keys_out[0, n_now) = now[0, n_now); 1 (nothing copied) when either is not an int64
    array this reads or keys_out is read-only."""
    cdef const int64_t *src
    cdef int64_t *dst
    cdef Py_ssize_t ss, ds
    cdef int64_t r
    if (n_now < 0 or get_keys(now, &src, n_now, &ss)
            or get_keys(keys_out, <const int64_t **>&dst, n_now, &ds)
            or not PyArray_ISWRITEABLE(<PyArrayObject *><PyObject *>keys_out)):
        return 1
    for r in range(n_now):
        dst[r * ds] = src[r * ss]
    return 0


def changed_byte_ranges(now, then, rows_then, num_rows, row_bytes, max_ranges, max_bytes,
                        keys_out=None, tag=None, /):
    """changed_byte_ranges(now, then, rows_then, num_rows, row_bytes, max_ranges,
    max_bytes[, keys_out[, tag]]) -> (ranges, total_bytes), None or NotImplemented

    What a publisher holding rows [0, rows_then) with keys ``then`` must send so the GPU
    holds rows [0, num_rows) with keys ``now`` (all versioned): the key spans of rows
    below min(num_rows, rows_then) as byte ranges of a row-major int32 table, plus rows
    [rows_then, num_rows) whole, byte-adjacent pieces merged. None when more than
    max_ranges ranges or max_bytes bytes would travel; NotImplemented when the keys (or
    keys_out) are not int64 arrays this reads (the Python path handles them). keys_out,
    when given, receives now[0, num_rows) whatever the result: the keys to remember for
    this upload, without a separate copy. tag (an int >= 0), when given, makes each range
    the triple (tag, start, nbytes) a publication record takes (h2d_core); without it
    each is (start, stop). :func:`changed_ranges_into` is the same diff into an array."""
    cdef int64_t n_then = PyLong_AsLongLong(rows_then)
    cdef int64_t n_now = PyLong_AsLongLong(num_rows)
    cdef int64_t nbytes = PyLong_AsLongLong(row_bytes)
    cdef int64_t most_ranges = PyLong_AsLongLong(max_ranges)
    cdef int64_t most_bytes = PyLong_AsLongLong(max_bytes)
    cdef int64_t label = -1, limit, count, total, k
    cdef const int64_t *w
    cdef const int64_t *t
    cdef Py_ssize_t ns, ts
    cdef int64_t *buf
    if tag is not None:
        label = PyLong_AsLongLong(tag)
        if label < 0:
            raise ValueError("changed_byte_ranges: tag must be >= 0")
    limit = n_now if n_now < n_then else n_then
    if get_keys(now, &w, limit, &ns) or get_keys(then, &t, limit, &ts):
        return NotImplemented
    if keys_out is not None and copy_keys(now, keys_out, n_now):
        return NotImplemented
    # first pass: count ranges and bytes without writing; second: the ranges themselves
    byte_ranges(w, ns, t, ts, limit, n_then, n_now, nbytes, label, NULL, &count, &total)
    if count > most_ranges or total > most_bytes:
        return None
    buf = <int64_t *>PyMem_Calloc(<size_t>(3 * count + 3), sizeof(int64_t))
    if buf == NULL:
        raise MemoryError()
    try:
        byte_ranges(w, ns, t, ts, limit, n_then, n_now, nbytes, label, buf, &count, &total)
        ranges = []
        for k in range(count):
            if label < 0:
                PyList_Append(ranges, (buf[3 * k + 1], buf[3 * k + 1] + buf[3 * k + 2]))
            else:
                PyList_Append(ranges, (label, buf[3 * k + 1], buf[3 * k + 2]))
    finally:
        PyMem_Free(buf)
    return ranges, total


# changed_ranges_into's parameters, int64 fields of its ``params`` array
cdef enum:
    P_ROWS_THEN = 0
    P_NUM_ROWS = 1
    P_ROW_BYTES = 2
    P_MAX_RANGES = 3
    P_MAX_BYTES = 4
    P_TAG = 5
    P_START = 6
    P_TOTAL = 7  # written: the ranges' bytes
    P_SIZE = 8


def changed_ranges_into(now, then, params, keys_out, out, /):
    """changed_ranges_into(now, then, params, keys_out, out) -> count, -1 or -2

    :func:`changed_byte_ranges` for a caller that keeps its ranges in an array and makes
    no object per step: ``params`` is an int64[8] array (rows_then, num_rows, row_bytes,
    max_ranges, max_bytes, tag >= 0, start, and the total it writes); the ranges are
    written as (tag, start, nbytes) rows ``[start, start + count)`` of ``out`` (a
    C-contiguous int64[k, 3] array, which keeps the row after them free: its caller's end
    marker) and their bytes into ``params[7]``. Returns the count; -1, writing no range,
    when more than max_ranges ranges or max_bytes bytes would travel or ``out`` has too
    few rows; -2 (NotImplemented) when the keys, keys_out or out are not
    arrays this reads. keys_out receives now[0, num_rows) whenever the result is not -2."""
    cdef const int64_t *w
    cdef const int64_t *t
    cdef int64_t *p
    cdef Py_ssize_t ns, ts, rows
    cdef int64_t limit, count, total, start
    cdef PyArrayObject *a
    if get_keys(params, <const int64_t **>&p, P_SIZE, &ns) or ns != 1:
        return -2
    if not PyArray_Check(<PyObject *>out):
        return -2
    a = <PyArrayObject *><PyObject *>out
    if (PyArray_NDIM(a) != 2 or PyArray_TYPE(a) != NPY_INT64 or PyArray_DIM(a, 1) != 3
            or not PyArray_ISALIGNED(a) or not PyArray_ISNOTSWAPPED(a)
            or not PyArray_ISWRITEABLE(a) or PyArray_STRIDE(a, 1) != 8
            or PyArray_STRIDE(a, 0) != 24 or p[P_TAG] < 0 or p[P_START] < 0):
        return -2
    rows = PyArray_DIM(a, 0)
    limit = p[P_NUM_ROWS] if p[P_NUM_ROWS] < p[P_ROWS_THEN] else p[P_ROWS_THEN]
    if get_keys(now, &w, limit, &ns) or get_keys(then, &t, limit, &ts):
        return -2
    if copy_keys(now, keys_out, p[P_NUM_ROWS]):
        return -2
    byte_ranges(w, ns, t, ts, limit, p[P_ROWS_THEN], p[P_NUM_ROWS], p[P_ROW_BYTES],
                p[P_TAG], NULL, &count, &total)
    start = p[P_START]
    if count > p[P_MAX_RANGES] or total > p[P_MAX_BYTES] or start + count >= rows:
        return -1
    byte_ranges(w, ns, t, ts, limit, p[P_ROWS_THEN], p[P_NUM_ROWS], p[P_ROW_BYTES],
                p[P_TAG], <int64_t *>PyArray_DATA(a) + 3 * start, &count, &total)
    p[P_TOTAL] = total
    return count
