"""GPU driver calls through ctypes: the publication's DMA, a capture query, graph launch,
events; one interface over the CUDA driver and the HIP runtime.

``Tensor.copy_`` costs ~4-6 µs of host time per H2D enqueue (dispatcher,
argument checks, stream lookups); ``cuMemcpyHtoDAsync`` on prebuilt integer
addresses costs a fraction of that. Both are ordinary stream work: a copy
enqueued while the stream is being captured becomes a graph node.

The entry points this library needs exist with the same signatures, argument order and
status codes (0 success, 600 not ready, 201 invalid context) in CUDA's driver
(``libcuda``) and in HIP's runtime (``libamdhip64``): :data:`CUDA` and :data:`HIP` name
them, and :func:`device_driver` binds the one matching torch's build. Tested on CUDA
(H200); the HIP table is untested here (no ROCm machine), and where it cannot load, the
arenas fall back to torch's copy and graph replay, which still give one DMA + one
scatter per publication.

Compiled callers (h2d_core's launcher) take the entry points as addresses
(:meth:`DeviceDriver.address`) and call them without ctypes in between.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

from h2d_kernels.errors import ScatterBackendError

_NOT_CURRENT = 201  # CUDA_ERROR_INVALID_CONTEXT / hipErrorInvalidContext
_EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING / hipEventDisableTiming
#: CU_EVENT_RECORD_EXTERNAL / hipEventRecordExternal: recorded into a stream being captured,
#: the event record becomes a node of the graph (each launch of the graph records it)
EVENT_RECORD_EXTERNAL = 0x1


@dataclass(frozen=True)
class DriverSymbols:
    """One runtime's library and the names of the entry points this library calls."""

    runtime: str
    library: str
    memcpy_htod_async: str
    stream_is_capturing: str
    graph_launch: str
    event_create: str
    event_destroy: str
    event_record: str
    event_query: str
    event_synchronize: str
    #: optional (an older driver may lack it): graphs then carry no completion record
    event_record_with_flags: str = ""


CUDA = DriverSymbols(
    "cuda", "libcuda.so.1", "cuMemcpyHtoDAsync_v2", "cuStreamIsCapturing", "cuGraphLaunch",
    "cuEventCreate", "cuEventDestroy_v2", "cuEventRecord", "cuEventQuery",
    "cuEventSynchronize", "cuEventRecordWithFlags")
HIP = DriverSymbols(
    "hip", "libamdhip64.so", "hipMemcpyHtoDAsync", "hipStreamIsCapturing", "hipGraphLaunch",
    "hipEventCreateWithFlags", "hipEventDestroy", "hipEventRecord", "hipEventQuery",
    "hipEventSynchronize", "hipEventRecordWithFlags")

#: entry points :meth:`DeviceDriver.address` hands out, by their runtime-neutral names
ADDRESSABLE = frozenset({
    "graph_launch", "stream_is_capturing", "event_record", "event_query", "event_synchronize",
})


class DeviceDriver:
    """ctypes bindings to the GPU runtime's calls the publication path needs."""

    def __init__(self, lib: ctypes.CDLL, symbols: DriverSymbols = CUDA) -> None:
        self._lib = lib
        self.symbols = symbols
        self._memcpy = getattr(lib, symbols.memcpy_htod_async)
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._is_capturing = getattr(lib, symbols.stream_is_capturing)
        self._is_capturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._is_capturing.restype = ctypes.c_int
        self._graph_launch = getattr(lib, symbols.graph_launch)
        self._graph_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._graph_launch.restype = ctypes.c_int
        self._status = ctypes.c_int(0)
        self._status_ref = ctypes.byref(self._status)
        self._event_create = getattr(lib, symbols.event_create)
        self._event_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._event_create.restype = ctypes.c_int
        self._event_destroy = getattr(lib, symbols.event_destroy)
        self._event_destroy.argtypes = [ctypes.c_void_p]
        self._event_destroy.restype = ctypes.c_int
        for name in ADDRESSABLE:
            getattr(lib, getattr(symbols, name))  # missing symbols fail here, at load
        # Optional: without it publication graphs carry no completion record and finish()
        # records the slot's event itself (record_external_missing says why).
        self._record_flags = None
        if symbols.event_record_with_flags:
            try:
                fn = getattr(lib, symbols.event_record_with_flags)
            except AttributeError:
                fn = None
            if fn is not None:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                self._record_flags = fn

    @property
    def record_external_missing(self) -> str | None:
        """Why graphs cannot carry an event record node (None: they can)."""
        if self._record_flags is not None:
            return None
        name = self.symbols.event_record_with_flags or "an event record with flags"
        return f"{name} is missing from {self.symbols.library}"

    def address(self, name: str) -> int:
        """Address of entry point ``name`` (a runtime-neutral name of :data:`ADDRESSABLE`,
        e.g. ``"graph_launch"``), for compiled callers."""
        if name not in ADDRESSABLE:
            raise ScatterBackendError(
                f"{name!r} is not an entry point this binding hands out; use one of "
                f"{sorted(ADDRESSABLE)}"
            )
        fn = getattr(self._lib, getattr(self.symbols, name))
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)

    def event_create(self) -> int:
        """A new event without timing (``CUevent`` handle) in the current context."""
        handle = ctypes.c_void_p(0)
        rc = self._event_create(ctypes.byref(handle), _EVENT_DISABLE_TIMING)
        if rc:
            raise ScatterBackendError(
                f"{self.symbols.event_create} failed with {self.symbols.runtime} error {rc}")
        return int(handle.value or 0)

    def event_destroy(self, event: int) -> int:
        """Destroy an event from :meth:`event_create`; return the CUresult. Work already
        recorded on it completes normally."""
        return int(self._event_destroy(event))

    def event_record_external(self, event: int, stream: int) -> int:
        """Record ``event`` on ``stream`` with the external flag; return the CUresult.
        Only valid while ``stream`` is being captured: the record becomes a graph node.
        ScatterBackendError when the driver lacks the entry point (see
        :attr:`record_external_missing`)."""
        if self._record_flags is None:
            raise ScatterBackendError(
                f"{self.record_external_missing}: bind graphs without a completion event")
        return int(self._record_flags(event, stream, EVENT_RECORD_EXTERNAL))

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
            raise ScatterBackendError(
                f"{self.symbols.stream_is_capturing} failed with {self.symbols.runtime} "
                f"error {rc}")
        return self._status.value != 0


@lru_cache(maxsize=1)
def device_driver() -> DeviceDriver | None:
    """The process's bindings for torch's GPU runtime (:data:`HIP` on a ROCm build of
    torch, else :data:`CUDA`), or None when its library cannot be loaded."""
    import torch

    symbols = HIP if getattr(torch.version, "hip", None) else CUDA
    try:
        return DeviceDriver(ctypes.CDLL(symbols.library), symbols)
    except (OSError, AttributeError):
        return None


def context_not_current(rc: int) -> bool:
    """Whether a driver error means only that this thread has no current context yet."""
    return rc == _NOT_CURRENT
