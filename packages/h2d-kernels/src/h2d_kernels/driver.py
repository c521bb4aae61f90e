"""CUDA driver calls through ctypes: the publication's DMA, a capture query, graph launch.

``Tensor.copy_`` costs ~4-6 µs of host time per H2D enqueue (dispatcher,
argument checks, stream lookups); ``cuMemcpyHtoDAsync`` on prebuilt integer
addresses costs a fraction of that. Both are ordinary stream work: a copy
enqueued while the stream is being captured becomes a graph node.

Compiled callers (h2d_core's launcher) take the driver's entry points as addresses
(:meth:`CudaDriver.address`) and call them without ctypes in between.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

from h2d_kernels.errors import ScatterBackendError

_NOT_CURRENT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread
_EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING

#: entry points :meth:`CudaDriver.address` hands out (exported, unversioned symbols)
ADDRESSABLE = frozenset({
    "cuGraphLaunch", "cuStreamIsCapturing", "cuEventRecord", "cuEventQuery",
    "cuEventSynchronize",
})


class CudaDriver:
    """ctypes bindings to ``libcuda`` for the calls the publication path needs."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._memcpy = lib.cuMemcpyHtoDAsync_v2
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._is_capturing = lib.cuStreamIsCapturing
        self._is_capturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._is_capturing.restype = ctypes.c_int
        self._graph_launch = lib.cuGraphLaunch
        self._graph_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._graph_launch.restype = ctypes.c_int
        self._status = ctypes.c_int(0)
        self._status_ref = ctypes.byref(self._status)
        self._event_create = lib.cuEventCreate
        self._event_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._event_create.restype = ctypes.c_int
        self._event_destroy = lib.cuEventDestroy_v2
        self._event_destroy.argtypes = [ctypes.c_void_p]
        self._event_destroy.restype = ctypes.c_int
        for name in ADDRESSABLE:
            getattr(lib, name)  # missing symbols fail here, at load, not mid-run

    def address(self, name: str) -> int:
        """Address of driver entry point ``name`` (one of :data:`ADDRESSABLE`), for
        compiled callers."""
        if name not in ADDRESSABLE:
            raise ScatterBackendError(
                f"{name!r} is not an entry point this binding hands out; use one of "
                f"{sorted(ADDRESSABLE)}"
            )
        return int(ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value or 0)

    def event_create(self) -> int:
        """A new event without timing (``CUevent`` handle) in the current context."""
        handle = ctypes.c_void_p(0)
        rc = self._event_create(ctypes.byref(handle), _EVENT_DISABLE_TIMING)
        if rc:
            raise ScatterBackendError(f"cuEventCreate failed with CUDA error {rc}")
        return int(handle.value or 0)

    def event_destroy(self, event: int) -> int:
        """Destroy an event from :meth:`event_create`; return the CUresult. Work already
        recorded on it completes normally."""
        return int(self._event_destroy(event))

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """Enqueue ``nbytes`` from host ``src`` to device ``dst``; return the CUresult."""
        return int(self._memcpy(dst, src, nbytes, stream))

    def graph_launch(self, graph_exec: int, stream: int) -> int:
        """Launch an instantiated graph (``CUgraphExec``) on ``stream``; return the CUresult."""
        return int(self._graph_launch(graph_exec, stream))

    def stream_is_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph right now."""
        rc = self._is_capturing(stream, self._status_ref)
        if rc:
            raise ScatterBackendError(f"cuStreamIsCapturing failed with CUDA error {rc}")
        return self._status.value != 0


@lru_cache(maxsize=1)
def cuda_driver() -> CudaDriver | None:
    """The process's driver bindings, or None when ``libcuda`` cannot be loaded."""
    try:
        return CudaDriver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def context_not_current(rc: int) -> bool:
    """Whether a driver error means only that this thread has no current context yet."""
    return rc == _NOT_CURRENT
