# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# cython: binding=False
"""The compiled publication of a packed group (``h2d_kernels._packed_native``).

:meth:`h2d_kernels.PackedGroup.publish` runs once per step and per slot on the engine's
hot path, so its header writes, packing and graph launch live here, as one call that
creates no Python object on its common path (the int it returns is cached):

* ``bind_publish``: once per slot's arena: host base, header, staging, staged members,
  every member's unit bytes and in-place offset, the captured graphs by size bucket and
  the driver's graph launch and capture query (as addresses; 0 when not launching).
* ``publish_packed``: write every member's header byte count from its count, copy staged
  members' used bytes and the pending ranges into staging (their header rows too), zero
  the range rows it does not use, then launch the graph that covers the DMA end through a
  function pointer. ``publish_packed_step`` is the state's call: the arena's own launch
  when no graph could run, and the DMA size signed by whether the graphs recorded the
  slot's completion (``set_records``), as the same int object while it repeats.
* ``bind_scatter`` / ``publish_cpu``: a CPU arena's publication (the host-to-"device"
  copy of the DMA bytes, then one ``memcpy`` per header descriptor with bytes), the
  ``scatter="reference"`` path; ``h2d_kernels.reference.scatter_reference`` is the plain
  Python statement of the same rule and the tests' oracle.

There is no Python version of these rules in the package (tests/oracle_packed.py holds a
plain one for the tests only). No CUDA or HIP header is needed: entry points arrive as
addresses and handles as integers; their status codes are reported, never interpreted
beyond success.

``binding=False`` makes the functions builtins, as the C extension's were: the
interpreter's specialized call of a builtin reaches them directly (a Cython function
object takes the generic call). ``publish_packed``'s parameters are positional-only, as
they were in C, so no keyword parsing sits on its path.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int64_t, intptr_t
from libc.string cimport memcpy, memmove

from h2d_kernels.errors import DescriptorError, PackBoundsError


# Borrowed-pointer forms of the C API: the hot loop reads list and tuple items without
# taking references, as the C extension this module replaced did (a cast to ``object``
# would add an incref/decref pair per item).
cdef extern from "Python.h":
    bint PyList_CheckExact(PyObject *o)
    bint PyLong_CheckExact(PyObject *o)
    bint PyTuple_CheckExact(PyObject *o)
    Py_ssize_t PyList_GET_SIZE(PyObject *o)
    Py_ssize_t PyTuple_GET_SIZE(PyObject *o)
    PyObject *PyList_GET_ITEM(PyObject *o, Py_ssize_t i)
    PyObject *PyTuple_GET_ITEM(PyObject *o, Py_ssize_t i)
    # an int's value, with CPython's own errors (TypeError, OverflowError)
    long long as_i64 "PyLong_AsLongLong"(PyObject *o) except? -1

# Counts, offsets and sizes are almost always exact ints of one digit (< 2**30): read those
# in line (as Cython's own conversions do), saving the call into PyLong_AsLongLong, which
# takes every other object, so values and errors stay CPython's.
cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030B0000
    #include "longintrepr.h"  /* ob_digit; Python.h includes it from 3.11 on */
    #endif
    static inline int h2d_compact_int(PyObject *o, long long *out) {
        if (!PyLong_CheckExact(o))
            return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (!PyUnstable_Long_IsCompact((PyLongObject *)o))
            return 0;
        *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
    #else
        Py_ssize_t size = Py_SIZE(o);
        if (size < -1 || size > 1)
            return 0;
        *out = size * (long long)((PyLongObject *)o)->ob_digit[0];
    #endif
        return 1;
    }
    """
    bint compact_int "h2d_compact_int"(PyObject *o, long long *out) noexcept

cdef extern from *:
    # gcc and clang (the C extension used it too); never called with 0
    int clzll "__builtin_clzll"(unsigned long long x) noexcept nogil

# The driver entry points (cuGraphLaunch / hipGraphLaunch, cuStreamIsCapturing /
# hipStreamIsCapturing), called through the addresses h2d_kernels.driver hands out.
ctypedef int (*graph_launch_fn)(void *graph_exec, void *stream) noexcept nogil
ctypedef int (*is_capturing_fn)(void *stream, int *status) noexcept nogil

cdef enum:
    ALIGN = 16  # staged payloads and ranges start on 16-byte boundaries (PAYLOAD_ALIGN)


cdef inline int64_t align_up(int64_t n) noexcept nogil:
    return (n + ALIGN - 1) & ~(<int64_t>(ALIGN - 1))


cdef inline Py_ssize_t bucket_of(int64_t nbytes) noexcept nogil:
    """The graph bucket whose DMA size 2**index is the smallest covering ``nbytes``
    (h2d_kernels.graphs.bucket_index)."""
    if nbytes <= 1:
        return 0
    return 64 - clzll(<unsigned long long>(nbytes - 1))


ctypedef struct Staged:
    int64_t index, src, unit_bytes


# ---- the CPU publication (scatter="reference") ------------------------------------------

ctypedef struct Scatter:
    char *host
    char *device
    const int64_t *header     # the device arena's header: its rows after the copy
    int64_t header_bytes, total_bytes, num_rows
    Py_ssize_t num_dests
    int64_t *dest_addr        # per member: its destination's first byte
    int64_t *dest_nbytes      # per member: its destination's size
    PyObject *owner           # keeps the arena (host, device arena, destinations) alive


cdef void scatter_free(object capsule) noexcept:
    cdef Scatter *s = <Scatter *>PyCapsule_GetPointer(capsule, "h2d_scatter")
    if s != NULL:
        Py_XDECREF(s.owner)
        PyMem_Free(s.dest_addr)
        PyMem_Free(s.dest_nbytes)
        PyMem_Free(s)


def bind_scatter(host_addr, device_addr, header_bytes, total_bytes, num_rows, dest_addrs,
                 dest_nbytes, owner, /):
    """bind_scatter(host_addr, device_addr, header_bytes, total_bytes, num_rows,
    dest_addrs, dest_nbytes, owner) -> capsule

    A CPU arena's publication, bound once: ``host_addr`` and ``device_addr`` the two
    arenas' first bytes (``total_bytes`` each, the header's ``num_rows`` int64
    ``(src, nbytes, member, dst)`` rows first), ``dest_addrs`` and ``dest_nbytes`` one int
    per member (tuples); ``owner`` is kept alive as long as the binding.
    """
    cdef Scatter *s = <Scatter *>PyMem_Calloc(1, sizeof(Scatter))
    cdef Py_ssize_t n = 0, k
    if s == NULL:
        raise MemoryError()
    try:
        if not PyTuple_CheckExact(<PyObject *>dest_addrs) or not PyTuple_CheckExact(
                <PyObject *>dest_nbytes):
            raise TypeError("bind_scatter: dest_addrs and dest_nbytes must be tuples")
        s.host = <char *><intptr_t>i64(host_addr)
        s.device = <char *><intptr_t>i64(device_addr)
        s.header = <const int64_t *>s.device
        s.header_bytes = i64(header_bytes)
        s.total_bytes = i64(total_bytes)
        s.num_rows = i64(num_rows)
        if s.num_rows * 32 > s.header_bytes or s.header_bytes > s.total_bytes:
            raise ValueError("bind_scatter: the header's rows do not fit the arena")
        s.dest_addr = i64_array(dest_addrs, "dest_addrs", &s.num_dests)
        s.dest_nbytes = i64_array(dest_nbytes, "dest_nbytes", &n)
        if n != s.num_dests:
            raise ValueError("bind_scatter: dest_addrs and dest_nbytes differ in length")
        for k in range(n):
            if s.dest_nbytes[k] < 0:
                raise ValueError(f"bind_scatter: destination {k} has a negative size")
        Py_INCREF(owner)
        s.owner = <PyObject *>owner
        return PyCapsule_New(s, "h2d_scatter", scatter_free)
    except BaseException:
        Py_XDECREF(s.owner)
        PyMem_Free(s.dest_addr)
        PyMem_Free(s.dest_nbytes)
        PyMem_Free(s)
        raise


cdef int scatter_rows(const Scatter *s, int64_t dma_bytes) except -1:
    """Every header row with bytes: its arena bytes to its member's destination (the rule
    of ``reference.scatter_bytes``). A row reaching past the DMA or its destination
    raises DescriptorError naming it; rows before it were written (the caller validated
    the header: this only keeps a corrupt one from writing out of bounds)."""
    cdef const int64_t *h
    cdef int64_t k, src, nbytes, member, dst
    for k in range(s.num_rows):
        h = s.header + 4 * k
        nbytes = h[1]
        if nbytes <= 0:
            continue
        src = h[0]
        member = h[2]
        dst = h[3]
        if (src < 0 or src + nbytes > dma_bytes or member < 0 or member >= s.num_dests
                or dst < 0 or dst + nbytes > s.dest_nbytes[member]):
            raise DescriptorError(
                f"descriptor {k} (src {src}, {nbytes} bytes, member {member}, dst {dst}) "
                f"lies outside the {dma_bytes}-byte DMA or its destination: validate the "
                "header (PackedArena.validate) before publishing")
        memcpy(<char *><intptr_t>(s.dest_addr[member] + dst), s.device + src, <size_t>nbytes)
    return 0


cdef int publish_cpu_into(const Scatter *s, int64_t dma_bytes) except -1:
    if dma_bytes < s.header_bytes or dma_bytes > s.total_bytes:
        raise ValueError(f"publish_cpu: dma_bytes={dma_bytes} outside [{s.header_bytes}, "
                         f"{s.total_bytes}]")
    memcpy(s.device, s.host, <size_t>dma_bytes)
    scatter_rows(s, dma_bytes)
    return 0


def publish_cpu(capsule, dma_bytes, /):
    """publish_cpu(capsule, dma_bytes) -> None

    Copy the host arena's first ``dma_bytes`` to the device arena, then scatter every
    header descriptor with bytes to its destination: one ``memcpy`` each, no Python
    object made. The caller checked ``dma_bytes`` (PublishError); outside the arena this
    raises ValueError."""
    cdef Scatter *s = <Scatter *>PyCapsule_GetPointer(capsule, "h2d_scatter")
    publish_cpu_into(s, i64(dma_bytes))


ctypedef struct Publish:
    char *host
    int64_t *header
    int64_t staging_offset, first_extra, header_bytes, total_bytes
    int64_t header_rows      # rows of the header: members, then range rows
    int64_t staging_end      # where packing must stop: the first tail region, or the end
    Py_ssize_t num_staged, num_src, num_execs, num_members
    Staged *staged
    int64_t *src_base
    int64_t *unit_bytes      # per member: bytes per counted unit
    int64_t *inplace         # per member: fixed arena offset, or -1 for a staged member
    int64_t *execs           # by bucket index: the graph of DMA size 2**index (0: none)
    int64_t *staged_bytes    # per staged member: its bytes this publication (checked)
    int64_t *range_fields    # per range row: member, destination offset, bytes (checked)
    graph_launch_fn launch
    is_capturing_fn is_capturing
    PyObject *owner          # keeps the arena (host memory, graphs) alive
    # a CPU arena without first consumers (attach_cpu): publish_packed copies and scatters
    # itself, and hands back the DMA size as the same int object while it does not change
    void *cpu                # its Scatter (the capsule below keeps it alive), or NULL
    PyObject *cpu_capsule
    PyObject *last_end
    int64_t last_dma_end     # the last publish_packed_step's DMA size
    int records              # the graphs record the slot's completion event (set_records)


cdef void publish_release(Publish *p) noexcept:
    """Everything a binding holds (a partly built one too: its unset pointers are NULL)."""
    Py_XDECREF(p.owner)
    Py_XDECREF(p.cpu_capsule)
    Py_XDECREF(p.last_end)
    PyMem_Free(p.staged)
    PyMem_Free(p.src_base)
    PyMem_Free(p.unit_bytes)
    PyMem_Free(p.inplace)
    PyMem_Free(p.execs)
    PyMem_Free(p.staged_bytes)
    PyMem_Free(p.range_fields)
    PyMem_Free(p)


cdef void publish_free(object capsule) noexcept:
    cdef Publish *p = <Publish *>PyCapsule_GetPointer(capsule, "h2d_publish")
    if p != NULL:
        publish_release(p)


cdef inline int64_t i64(object o) except? -1:
    return as_i64(<PyObject *>o)


cdef inline int64_t int_of(PyObject *o) except? -1:
    """``o``'s value as PyLong_AsLongLong gives it (an exact one-digit int read in line)."""
    cdef long long v = 0
    if compact_int(o, &v):
        return v
    return as_i64(o)


cdef int64_t *i64_array(object t, str what, Py_ssize_t *size) except NULL:
    """The int items of a tuple in a new array (freed by publish_release)."""
    if not PyTuple_CheckExact(<PyObject *>t):
        raise TypeError(f"bind_publish: {what} must be a tuple")
    cdef Py_ssize_t n = PyTuple_GET_SIZE(<PyObject *>t), k
    cdef int64_t *a = <int64_t *>PyMem_Calloc(<size_t>(n if n else 1), sizeof(int64_t))
    if a == NULL:
        raise MemoryError()
    try:
        for k in range(n):
            a[k] = as_i64(PyTuple_GET_ITEM(<PyObject *>t, k))
    except BaseException:
        PyMem_Free(a)
        raise
    size[0] = n
    return a


cdef int bind_into(Publish *p, tuple args) except -1:
    """Fill ``p`` from bind_publish's arguments; on an error the caller releases ``p``."""
    cdef int64_t host = i64(args[0])
    cdef int64_t header = i64(args[1])
    p.staging_offset = i64(args[2])
    p.first_extra = i64(args[3])
    p.header_bytes = i64(args[6])
    p.total_bytes = i64(args[7])
    cdef int64_t launch = i64(args[9])
    cdef int64_t capturing = i64(args[10])
    if (launch == 0) != (capturing == 0):  # one without the other cannot launch
        raise ValueError("bind_publish: null driver function address")
    p.host = <char *><intptr_t>host
    p.header = <int64_t *><intptr_t>header
    p.launch = <graph_launch_fn><intptr_t>launch
    p.is_capturing = <is_capturing_fn><intptr_t>capturing

    cdef object staged = args[4]
    cdef PyObject *e
    cdef Staged *d
    cdef Py_ssize_t k
    if not PyTuple_CheckExact(<PyObject *>staged):
        raise TypeError("bind_publish: staged must be a tuple")
    p.num_staged = PyTuple_GET_SIZE(<PyObject *>staged)
    p.staged = <Staged *>PyMem_Calloc(<size_t>(p.num_staged if p.num_staged else 1),
                                      sizeof(Staged))
    if p.staged == NULL:
        raise MemoryError()
    for k in range(p.num_staged):
        e = PyTuple_GET_ITEM(<PyObject *>staged, k)
        d = &p.staged[k]
        if not PyTuple_CheckExact(e) or PyTuple_GET_SIZE(e) != 3:
            raise ValueError("bind_publish: malformed staged entry")
        d.index = as_i64(PyTuple_GET_ITEM(e, 0))
        d.src = as_i64(PyTuple_GET_ITEM(e, 1))
        d.unit_bytes = as_i64(PyTuple_GET_ITEM(e, 2))

    p.src_base = i64_array(args[5], "src_base", &p.num_src)
    p.execs = i64_array(args[8], "execs", &p.num_execs)
    p.unit_bytes = i64_array(args[12], "unit_bytes", &p.num_members)
    cdef Py_ssize_t num_inplace = 0
    p.inplace = i64_array(args[13], "inplace", &num_inplace)
    p.header_rows = i64(args[14])
    if p.header_rows < p.first_extra or p.first_extra != p.num_members:
        raise ValueError("bind_publish: header rows do not fit the members")
    if num_inplace != p.num_members:
        raise ValueError("bind_publish: unit_bytes and inplace differ in length")
    # Staging sits before the tail regions (header | in place | staging | tails): packing
    # ends at the first region placed at or past staging_offset, else at the arena's end.
    p.staging_end = p.total_bytes
    for k in range(p.num_members):
        if p.staging_offset <= p.inplace[k] < p.staging_end:
            p.staging_end = p.inplace[k]
    p.staged_bytes = <int64_t *>PyMem_Calloc(<size_t>(p.num_staged if p.num_staged else 1),
                                             sizeof(int64_t))
    cdef Py_ssize_t range_rows = p.header_rows - p.first_extra
    p.range_fields = <int64_t *>PyMem_Calloc(<size_t>(3 * range_rows if range_rows else 1),
                                             sizeof(int64_t))
    if p.staged_bytes == NULL or p.range_fields == NULL:
        raise MemoryError()
    cdef object owner = args[11]
    Py_INCREF(owner)
    p.owner = <PyObject *>owner
    return 0


def bind_publish(*args):
    """bind_publish(host_base, header_addr, staging_offset, first_extra, staged, src_base,
    header_bytes, total_bytes, execs, launch_fn, is_capturing_fn, owner, unit_bytes,
    inplace, header_rows) -> capsule

    ``staged``: tuple of (member, source address, unit bytes); ``execs``: tuple of graph
    exec handles by bucket index (0 where no graph covers that size); ``unit_bytes`` and
    ``inplace``: one int per member (inplace: fixed arena offset, -1 for staged members);
    ``header_rows``: the header's rows (members first, then the rows ranges may use);
    ``owner`` is kept alive as long as the binding. ``launch_fn`` and ``is_capturing_fn``
    both 0 (and no execs): a binding that only packs.
    """
    if len(args) != 15:
        raise TypeError("bind_publish takes 15 arguments")
    cdef Publish *p = <Publish *>PyMem_Calloc(1, sizeof(Publish))
    if p == NULL:
        raise MemoryError()
    try:
        bind_into(p, args)
        return PyCapsule_New(p, "h2d_publish", publish_free)
    except BaseException:
        publish_release(p)
        raise


cdef str member_name(Publish *p, int64_t i):
    """Member ``i``'s name, for an error message (the arena the binding keeps alive)."""
    try:
        return repr((<object>p.owner).layout.members[i].name)
    except Exception:
        return f"#{i}"


cdef Py_ssize_t check_packing(Publish *p, PyObject *counts, PyObject *ranges) except -1:
    """Where every staged member's used bytes and every range will land, checked before
    pack_into writes any byte: inside the staging region (from ``staging_offset`` to the
    first tail region, which is a pinned source, or the arena's end), with the ranges in
    the header's range rows. The caller validated counts (capacity) and ranges (the
    staging room, RANGE_OVERHEAD each); this is the packing's own end check: one compare
    per copy. Stores the checked sizes and fields for pack_into (it reads neither list
    again) and returns the number of ranges."""
    cdef Py_ssize_t num_members = p.num_members
    cdef int64_t limit = p.staging_end
    cdef int64_t off = p.staging_offset
    cdef int64_t n, nbytes, member, dst_off
    cdef const Staged *d
    cdef PyObject *c
    cdef PyObject *r
    cdef Py_ssize_t k
    for k in range(p.num_staged):
        d = &p.staged[k]
        if d.index < 0 or d.index >= num_members:
            raise ValueError("publish: malformed count or range")
        c = PyList_GET_ITEM(counts, d.index)
        n = 0 if c == <PyObject *>None else int_of(c)
        if n < 0:
            raise ValueError("publish: malformed count or range")
        # (n <= limit first: n * unit_bytes cannot overflow then)
        if n > limit or n * d.unit_bytes > limit - off:
            nbytes_obj = <object>n * <object>d.unit_bytes
            raise PackBoundsError(
                f"publish: staged member {member_name(p, d.index)} ({n} units, {nbytes_obj} "
                f"bytes) would be packed at arena bytes [{off}, {off + nbytes_obj}), past the "
                f"staging region's end at byte {limit}: a count must not exceed its "
                "member's capacity; nothing was written")
        nbytes = n * d.unit_bytes
        p.staged_bytes[k] = nbytes
        if nbytes:
            off = align_up(off + nbytes)
    cdef Py_ssize_t range_rows = p.header_rows - p.first_extra
    cdef Py_ssize_t num_ranges
    # a list of triples, or a table's address: int64 triples up to a member of -1
    cdef const int64_t *table = NULL
    if PyList_CheckExact(ranges):
        num_ranges = PyList_GET_SIZE(ranges)
    else:
        table = <const int64_t *><intptr_t>int_of(ranges)
        num_ranges = 0
        while num_ranges <= range_rows and table[3 * num_ranges] >= 0:
            num_ranges += 1
    if num_ranges > range_rows:
        raise PackBoundsError(
            f"publish: {num_ranges} ranges, but the header has {range_rows} range rows (the "
            "members' max_ranges); nothing was written")
    cdef int64_t *fields = p.range_fields
    for k in range(num_ranges):
        if table != NULL:
            member = table[3 * k]
            dst_off = table[3 * k + 1]
            nbytes = table[3 * k + 2]
        else:
            r = PyList_GET_ITEM(ranges, k)
            if not PyTuple_CheckExact(r) or PyTuple_GET_SIZE(r) != 3:
                raise ValueError("publish: malformed count or range")
            member = int_of(PyTuple_GET_ITEM(r, 0))
            dst_off = int_of(PyTuple_GET_ITEM(r, 1))
            nbytes = int_of(PyTuple_GET_ITEM(r, 2))
        if member < 0 or member >= p.num_src or dst_off < 0 or nbytes < 0:
            raise ValueError("publish: malformed count or range")
        if nbytes > limit - off:
            raise PackBoundsError(
                f"publish: range {k} of member {member_name(p, member)} ({nbytes} bytes "
                f"from destination offset {dst_off}) would be packed at arena bytes "
                f"[{off}, {off + nbytes}), past the staging region's end at byte {limit}: "
                "ranges must fit the group's range_capacity with RANGE_OVERHEAD bytes "
                "each; nothing was written")
        fields[3 * k] = member
        fields[3 * k + 1] = dst_off
        fields[3 * k + 2] = nbytes
        off = align_up(off + nbytes)
    return num_ranges


cdef int pack_into(Publish *p, PyObject *counts, PyObject *ranges,
                   int64_t *end_out) except -1:
    """Write every member's header byte count, copy staged members' used bytes, then the
    ranges, into the staging region (their header rows too), and zero every range row this
    publication does not use: the header is a function of the counts and ranges alone.

    ``*end_out``: where the DMA must end (the header at least). ``counts``: one int or
    None per member, validated against capacity by the caller; ``ranges``: (member index,
    byte offset in the destination, byte count), validated against capacity and the
    staging room by the caller. Before any byte is written, :func:`check_packing` checks
    that the packing stays inside the staging region and the header's range rows
    (PackBoundsError otherwise) and that no size or offset is negative (ValueError).
    """
    # the binding's fields in locals: the header stores below could alias the struct, so
    # the compiler would otherwise reload every field after each of them
    cdef int64_t *header = p.header
    cdef char *host = p.host
    cdef const int64_t *unit_bytes = p.unit_bytes
    cdef const int64_t *inplace = p.inplace
    cdef Py_ssize_t num_members = p.num_members
    if (not PyList_CheckExact(counts) or PyList_GET_SIZE(counts) != num_members
            or not (PyList_CheckExact(ranges) or PyLong_CheckExact(ranges))):
        raise TypeError("publish: counts (one per member), and ranges as a list or a "
                        "range table's address")
    cdef Py_ssize_t num_ranges = check_packing(p, counts, ranges)
    cdef PyObject *c
    cdef const Staged *d
    cdef int64_t *h
    cdef Py_ssize_t i, k
    cdef int64_t n, nbytes, member, dst_off, row
    cdef int64_t end = p.header_bytes

    # in-place and tail members: their bytes are already where the DMA reads them
    for i in range(num_members):
        c = PyList_GET_ITEM(counts, i)
        n = 0 if c == <PyObject *>None else int_of(c)
        nbytes = n * unit_bytes[i]
        header[4 * i + 1] = nbytes
        if nbytes and inplace[i] >= 0 and inplace[i] + nbytes > end:
            end = inplace[i] + nbytes

    # staged members: their used bytes only (as checked), packed back to back from
    # staging_offset on
    cdef int64_t off = p.staging_offset
    cdef const Staged *staged = p.staged
    cdef const int64_t *staged_bytes = p.staged_bytes
    for k in range(p.num_staged):
        nbytes = staged_bytes[k]
        if nbytes == 0:
            continue
        d = &staged[k]
        memmove(host + off, <const char *><intptr_t>d.src, <size_t>nbytes)
        header[4 * d.index] = off
        header[4 * d.index + 1] = nbytes
        off = align_up(off + nbytes)
    if off > p.staging_offset and off > end:  # something was staged
        end = off

    # ranges right after them (as checked), each in its own header row past the members'
    cdef const int64_t *src_base = p.src_base
    cdef const int64_t *fields = p.range_fields
    row = p.first_extra
    for k in range(num_ranges):
        member = fields[3 * k]
        dst_off = fields[3 * k + 1]
        nbytes = fields[3 * k + 2]
        memmove(host + off, <const char *><intptr_t>(src_base[member] + dst_off),
                <size_t>nbytes)
        h = header + 4 * row
        h[0] = off
        h[1] = nbytes
        h[2] = member
        h[3] = dst_off
        row += 1
        off = align_up(off + nbytes)
    if num_ranges and off > end:  # (an empty range still reaches staging)
        end = off
    cdef int64_t header_rows = p.header_rows
    while row < header_rows:
        header[4 * row + 1] = 0  # an unused range row scatters nothing
        row += 1
    end_out[0] = end
    return 0


cdef object cached_end(Publish *p, int64_t end):
    """``end`` as an int: the one handed back last time when it is the same (a steady
    publication makes no int object)."""
    cdef object value
    if p.last_end != NULL and as_i64(p.last_end) == end:
        return <object>p.last_end
    value = end
    Py_XDECREF(p.last_end)
    Py_INCREF(value)
    p.last_end = <PyObject *>value
    return value


def attach_cpu(capsule, scatter, /):
    """attach_cpu(capsule, scatter) -> None

    Make the publish binding ``capsule`` publish on the CPU itself through ``scatter``
    (a :func:`bind_scatter` capsule of the same arena, which must have no first
    consumers): :func:`publish_packed` then copies and scatters, and returns the DMA
    size."""
    cdef Publish *p = <Publish *>PyCapsule_GetPointer(capsule, "h2d_publish")
    cdef Scatter *s = <Scatter *>PyCapsule_GetPointer(scatter, "h2d_scatter")
    if s.host != p.host or s.header_bytes != p.header_bytes or s.total_bytes != p.total_bytes:
        raise ValueError("attach_cpu: the scatter binding is of another arena")
    Py_INCREF(scatter)
    Py_XDECREF(p.cpu_capsule)
    p.cpu_capsule = <PyObject *>scatter
    p.cpu = <void *>s


cdef int publish_into(Publish *p, object counts, object ranges, object stream,
                      int64_t *end) except -1:
    """Pack, then publish on the CPU or launch the bucket's graph. Returns 1 for a
    launched graph, 2 for a CPU publication, 0 when nothing was enqueued (the caller's
    arena launches or raises); ``end``: the DMA size."""
    cdef void *handle = <void *><intptr_t>int_of(<PyObject *>stream)
    pack_into(p, <PyObject *>counts, <PyObject *>ranges, end)
    if p.cpu != NULL and p.launch == NULL and p.header_bytes <= end[0] <= p.total_bytes:
        publish_cpu_into(<const Scatter *>p.cpu, end[0])
        return 2
    if p.launch == NULL or end[0] < p.header_bytes or end[0] > p.total_bytes:
        return 0
    cdef Py_ssize_t b = bucket_of(end[0])
    cdef void *graph_exec = <void *><intptr_t>p.execs[b] if b < p.num_execs else NULL
    if graph_exec == NULL:
        return 0
    cdef int capturing = 0
    cdef int rc = p.is_capturing(handle, &capturing)
    if rc:
        raise RuntimeError(f"stream capture query failed with driver error {rc}")
    if capturing:  # a graph cannot be launched into a capture: the plain launch can
        return 0
    rc = p.launch(graph_exec, handle)
    if rc:
        raise RuntimeError(f"graph launch failed with driver error {rc}")
    return 1


def publish_packed(capsule, counts, ranges, stream, /):
    """publish_packed(capsule, counts, ranges, stream) -> int

    Writes the header and packs, then launches the graph of the bucket covering the DMA
    end on the raw ``stream`` handle (a CPU binding, :func:`attach_cpu`, copies and
    scatters instead). Returns that DMA size when published, or its negation when nothing
    was enqueued because the binding only packs, the stream is being captured, no graph
    covers the size or the size lies outside the arena: the caller then enqueues (or
    raises) through ``PackedArena.publish``. The same int object while the value repeats.
    A driver error raises RuntimeError naming the call and the status.
    """
    cdef Publish *p = <Publish *>PyCapsule_GetPointer(capsule, "h2d_publish")
    cdef int64_t end = 0
    cdef int how = publish_into(p, counts, ranges, stream, &end)
    return cached_end(p, end if how else -end)


def publish_packed_step(capsule, counts, ranges, stream, arena_stream, /):
    """publish_packed_step(capsule, counts, ranges, stream, arena_stream) -> bool

    :func:`publish_packed`, then the arena's own ``publish(end, arena_stream)`` when the
    binding enqueued nothing. Returns whether the publication recorded the slot's
    completion: True only for a launched graph whose graphs carry the record
    (:func:`set_records`; the caller records otherwise). The DMA size is
    :func:`last_dma_end`'s (a bool and a C field: a step makes no int object).
    ``ranges``: a list of ``(member, offset, bytes)`` triples, or the address of an int64
    table of such triples ended by a member of -1 (a record's, bound once).
    """
    cdef Publish *p = <Publish *>PyCapsule_GetPointer(capsule, "h2d_publish")
    cdef int64_t end = 0
    cdef int how = publish_into(p, counts, ranges, stream, &end)
    p.last_dma_end = end
    if how == 0:
        (<object>p.owner).publish(end, arena_stream)
    return how == 1 and p.records != 0


def last_dma_end(capsule, /):
    """last_dma_end(capsule) -> int: the DMA size of the binding's last
    :func:`publish_packed_step`."""
    cdef Publish *p = <Publish *>PyCapsule_GetPointer(capsule, "h2d_publish")
    return p.last_dma_end


def set_records(capsule, records, /):
    """set_records(capsule, records) -> None

    Whether the graphs this binding launches record the slot's completion event (what
    :func:`publish_packed_step`'s sign reports).
    """
    cdef Publish *p = <Publish *>PyCapsule_GetPointer(capsule, "h2d_publish")
    p.records = 1 if records else 0


