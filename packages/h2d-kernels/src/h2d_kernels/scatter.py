"""The Triton scatter kernel and its launchers.

The kernel reads the range descriptors from the head of the device arena and
the member addresses from a fixed destination table, then copies each range's
bytes to ``destination[member] + dst_offset``. Nothing else is written.

Work split: a grid of ``P`` programs walks every range. A range is cut into
``CHUNK_BYTES`` chunks and chunk ``c`` of range ``r`` belongs to program
``(r + c) % P``, so many small ranges spread over programs instead of piling
onto program 0, while one large range is shared by all of them.

Width: the kernel picks, per range, the widest unit on which source and
destination agree modulo 16 (16, 4 or 1 bytes). The aligned body moves in
those units; the unaligned head and tail (under 16 bytes each) move as bytes.

Loops are ``while`` loops: Triton 3.6's interpreter turns a runtime ``range``
bound into a Python int through a 1-element array, which numpy >= 2.4 refuses.

Addresses: all pointers are formed from the arena pointer plus a byte offset
(``destination - arena``). The arena pointer is 16-byte aligned, so the
compiler can prove 16-byte alignment of the body and emit 128-bit accesses;
a raw int-to-pointer cast would hide that.

Launch paths (see ``CompiledScatter``): the JIT dispatcher
(``kernel[grid](...)``) costs ~10-15 µs of host time per launch. The compiled
kernel's own C launcher, called with prebuilt arguments, skips argument
binding, specialization and cache lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from h2d_kernels.errors import ScatterBackendError

RANGE_BLOCK = 32
"""Descriptors loaded per header block (one vector load per field)."""

BYTE_TILE: tl.constexpr = tl.constexpr(2048)
"""Bytes per step of the byte-wide path (ranges whose source and destination disagree mod 4)."""

DEFAULT_CHUNK_BYTES = 8192
DEFAULT_NUM_WARPS = 4
DEFAULT_PROGRAMS_PER_SM = 4


def interpreter_enabled() -> bool:
    """Whether this process runs Triton kernels in the CPU interpreter (TRITON_INTERPRET=1)."""
    return isinstance(_scatter_kernel, InterpretedFunction)


# Kernels and their helpers carry no Python type hints: Triton reads parameter
# annotations as its own types (hence the type-ignore comments).


@triton.jit
def _unit_bytes(src, dst):  # type: ignore[no-untyped-def]
    # Widest access unit on which source and destination share alignment.
    phase = src ^ dst
    return tl.where((phase & 15) == 0, 16, tl.where((phase & 3) == 0, 4, 1)).to(tl.int64)


@triton.jit
def _split(src, dst, nbytes, CHUNK_BYTES: tl.constexpr):  # type: ignore[no-untyped-def]
    # (head, body, tail, chunks): head aligns the source to the unit, body is a
    # whole number of units, tail is what is left; a non-empty range has at
    # least one chunk so its head/tail owner exists.
    unit = _unit_bytes(src, dst)
    head = tl.minimum((-src) & (unit - 1), nbytes)
    body = (nbytes - head) // unit * unit
    tail = nbytes - head - body
    chunks = tl.where(nbytes > 0, tl.maximum(tl.cdiv(body, CHUNK_BYTES), 1), 0)
    return unit, head, body, tail, chunks


@triton.jit
def _copy_range(arena_ptr, src, dst, nbytes, first, step, CHUNK_BYTES: tl.constexpr):  # type: ignore[no-untyped-def]
    unit, head, body, tail, chunks = _split(src, dst, nbytes, CHUNK_BYTES)
    if unit == 16:
        # (x // 16) * 4 instead of x // 4: the product tells the compiler the
        # word offsets are multiples of 4, which is what licenses 16-byte accesses.
        src_w = (src + head) // 16 * 4
        dst_w = (dst + head) // 16 * 4
        n_w = body // 16 * 4
        c = first
        while c < chunks:
            w = c * (CHUNK_BYTES // 4) + tl.arange(0, CHUNK_BYTES // 4)
            m = w < n_w
            tl.store(arena_ptr + dst_w + w, tl.load(arena_ptr + src_w + w, mask=m), mask=m)
            c += step
    elif unit == 4:
        src_w = (src + head) // 4
        dst_w = (dst + head) // 4
        n_w = body // 4
        c = first
        while c < chunks:
            w = c * (CHUNK_BYTES // 4) + tl.arange(0, CHUNK_BYTES // 4)
            m = w < n_w
            tl.store(arena_ptr + dst_w + w, tl.load(arena_ptr + src_w + w, mask=m), mask=m)
            c += step
    else:
        arena_b = arena_ptr.to(tl.pointer_type(tl.uint8))
        c = first
        while c < chunks:
            # Byte accesses need one address each: tiles of BYTE_TILE keep the
            # register count (and so the occupancy of every path) where it is.
            t = c * CHUNK_BYTES
            end = tl.minimum(t + CHUNK_BYTES, body)
            while t < end:
                b = t + tl.arange(0, BYTE_TILE)
                m = b < end
                tl.store(arena_b + dst + b, tl.load(arena_b + src + b, mask=m), mask=m)
                t += BYTE_TILE
            c += step
    if (first == 0) & (head + tail > 0):
        # Lanes 0-15 carry the head, lanes 16-31 the tail.
        arena_b = arena_ptr.to(tl.pointer_type(tl.uint8))
        k = tl.arange(0, 32)
        is_head = k < 16
        off = tl.where(is_head, k, nbytes - tail + (k - 16))
        m = tl.where(is_head, k < head, (k - 16) < tail)
        tl.store(arena_b + dst + off, tl.load(arena_b + src + off, mask=m), mask=m)


@triton.jit(do_not_specialize=["num_ranges"])
def _scatter_kernel(  # type: ignore[no-untyped-def]
    arena_ptr,  # *i32: device arena, header at byte 0, 16-byte aligned
    dest_table_ptr,  # *i64: destination address per member
    arena_addr,  # i64: arena_ptr as an integer (destinations become arena-relative)
    num_ranges,  # i32: descriptors in the header
    CHUNK_BYTES: tl.constexpr,
    RANGE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    header = arena_ptr.to(tl.pointer_type(tl.int64))
    lanes = tl.arange(0, RANGE_BLOCK)
    lane_bit = tl.full([RANGE_BLOCK], 1, tl.int64) << lanes.to(tl.int64)
    base = 0
    while base < num_ranges:
        # One vector load per field for a block of descriptors, so the per-range
        # loop below does no dependent header loads.
        r = base + lanes
        valid = r < num_ranges
        row = header + r.to(tl.int64) * 4
        src = tl.load(row, mask=valid, other=0)
        nbytes = tl.load(row + 1, mask=valid, other=0)
        member = tl.load(row + 2, mask=valid, other=0)
        dst_off = tl.load(row + 3, mask=valid, other=0)
        live = valid & (nbytes > 0)
        dst = tl.load(dest_table_ptr + member, mask=live, other=0) + dst_off - arena_addr
        _, _, _, _, chunks = _split(src, dst, nbytes, CHUNK_BYTES)
        first = (pid - r.to(tl.int64) % nprog + nprog) % nprog
        mine = live & (first < chunks)
        bits = tl.sum(tl.where(mine, lane_bit, 0), axis=0)
        count = tl.minimum(num_ranges - base, RANGE_BLOCK)
        j = 0
        while j < count:
            if ((bits >> j) & 1) != 0:
                sel = lanes == j
                s = tl.sum(tl.where(sel, src, 0), axis=0)
                d = tl.sum(tl.where(sel, dst, 0), axis=0)
                n = tl.sum(tl.where(sel, nbytes, 0), axis=0)
                mine_first = (pid - (base + j) % nprog + nprog) % nprog
                _copy_range(arena_ptr, s, d, n, mine_first, nprog, CHUNK_BYTES)
            j += 1
        base += RANGE_BLOCK


@dataclass(frozen=True)
class ScatterConfig:
    """Kernel shape: bytes per chunk, warps per program and the largest grid."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    num_warps: int = DEFAULT_NUM_WARPS
    max_programs: int = 4

    def grid(self, dma_bytes: int, num_ranges: int) -> int:
        """Programs for a publication of ``dma_bytes``: one per range plus one per chunk, capped.

        Small publications get a handful of programs (each range its own),
        large ones the whole grid. Only the launch size changes; the compiled
        kernel does not.
        """
        chunks = -(-dma_bytes // self.chunk_bytes)
        return max(1, min(self.max_programs, num_ranges + chunks))


def default_config(device: torch.device) -> ScatterConfig:
    """The tuned kernel shape for ``device`` (CPU: a small grid the interpreter walks quickly)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return ScatterConfig(max_programs=sms * DEFAULT_PROGRAMS_PER_SM)
    return ScatterConfig(max_programs=4)


def _kernel_args(
    device_arena: torch.Tensor, dest_table: torch.Tensor, num_ranges: int
) -> tuple[Any, ...]:
    return (
        device_arena.view(torch.int32),
        dest_table,
        device_arena.data_ptr(),
        num_ranges,
    )


def launch_jit(
    device_arena: torch.Tensor,
    dest_table: torch.Tensor,
    num_ranges: int,
    grid: int,
    config: ScatterConfig,
) -> None:
    """Launch through Triton's JIT dispatcher on the current stream (also the interpreter)."""
    _scatter_kernel[(grid,)](
        *_kernel_args(device_arena, dest_table, num_ranges),
        CHUNK_BYTES=config.chunk_bytes,
        RANGE_BLOCK=RANGE_BLOCK,
        num_warps=config.num_warps,
    )


class CompiledScatter:
    """The compiled kernel bound to one arena, launched through its own C launcher.

    Compiles (or fetches from Triton's cache) once at construction. A call
    passes the grid and a raw stream handle; every other argument is prebuilt.
    This mirrors what ``JITFunction.run`` does after its cache lookup
    (``CompiledKernel.run(grid..., stream, function, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *all_args)``, constexprs included)
    and skips the binder and specialization work before it. Launch hooks
    in ``triton.knobs`` are honoured. Pointers go in as plain ints, so the
    launcher neither calls ``data_ptr()`` nor queries pointer attributes.
    """

    def __init__(
        self,
        device_arena: torch.Tensor,
        dest_table: torch.Tensor,
        num_ranges: int,
        config: ScatterConfig,
    ) -> None:
        if interpreter_enabled():
            raise ScatterBackendError(
                "the compiled launch path needs a real GPU build of Triton, but this process "
                "runs Triton in the interpreter (TRITON_INTERPRET=1): use launch='jit'"
            )
        args = _kernel_args(device_arena, dest_table, num_ranges)
        # The destination table always lives on the GPU (the arena itself may be
        # host memory the kernel reads through UVA, as the benchmark's zero-copy probe does).
        with torch.cuda.device(dest_table.device):
            kernel = _scatter_kernel.warmup(
                *args,
                CHUNK_BYTES=config.chunk_bytes,
                RANGE_BLOCK=RANGE_BLOCK,
                num_warps=config.num_warps,
                grid=(1,),
            )
            kernel._init_handles()
        self.kernel = kernel
        self._args = (
            device_arena.data_ptr(),
            dest_table.data_ptr(),
            device_arena.data_ptr(),
            num_ranges,
            config.chunk_bytes,
            RANGE_BLOCK,
        )
        from triton import knobs

        # triton 3.6 keeps the launch hooks as HookChain objects (empty unless a
        # profiler adds hooks); holding the chains keeps later additions honoured.
        enter = knobs.runtime.launch_enter_hook
        exit_ = knobs.runtime.launch_exit_hook
        launcher = kernel.run
        meta = kernel.packed_metadata
        function = kernel.function
        args = self._args

        def launch(grid: int, stream: int) -> None:
            launch_meta = kernel.launch_metadata((grid, 1, 1), stream, *args)
            launcher(grid, 1, 1, stream, function, meta, launch_meta, enter, exit_, *args)

        self.launch: Callable[[int, int], None] = launch
        """``launch(grid, raw_stream)``: enqueue the scatter with ``grid`` programs."""

    def __call__(self, grid: int, stream: int) -> None:
        """Enqueue the scatter with ``grid`` programs on the raw CUDA stream handle ``stream``."""
        self.launch(grid, stream)
