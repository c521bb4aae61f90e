"""The packed arena: fixed host and device storage, bound destinations, one publish call.

Everything that can be done once happens in the constructor: destination
checks, allocation of the pinned host arena, the device arena and the
destination table, numpy views, kernel compilation and (for the graph path)
capture. ``publish`` then enqueues one H2D copy and one scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from h2d_kernels.destinations import bind_destinations, resolve_device
from h2d_kernels.driver import DeviceDriver, context_not_current, device_driver
from h2d_kernels.errors import (
    PublishError,
    ScatterBackendError,
)
from h2d_kernels.graphs import GraphLaunchTable, GraphPublisher, bucket_index, bucket_sizes
from h2d_kernels.launch_paths import (
    DEFAULT_LAUNCH,
    Consumer,
    DmaChoice,
    LaunchChoice,
    ScatterChoice,
    choose_paths,
)
from h2d_kernels.layout import ArenaLayout
from h2d_kernels.native import helper as _native
from h2d_kernels.reference import byte_view, validate_descriptors
from h2d_kernels.scatter import (
    CompiledScatter,
    ScatterConfig,
    default_config,
    launch_jit,
)

__all__ = ["DEFAULT_LAUNCH", "Consumer", "PackedArena", "bind_destinations"]


class PackedArena:
    """One pinned host arena, one device arena and a fixed destination table.

    The caller writes descriptors into :attr:`header_np` (zeroing unused
    ones) and payload bytes into :meth:`payload_np` / :meth:`payload_host`,
    then calls :meth:`publish`. The host arena may be rewritten only after an
    event recorded after ``publish`` has completed.

    ``scatter``: ``"auto"`` (Triton on CUDA, the reference on CPU),
    ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``) or
    ``"reference"`` (CPU only). ``launch`` (CUDA): ``"compiled"`` (the
    compiled kernel's own launcher), ``"graph"`` (DMA + scatter replayed
    from a CUDA graph per size bucket), ``"jit"`` (Triton's dispatcher) or
    ``"auto"``. ``dma`` (CUDA): ``"driver"`` (``cuMemcpyHtoDAsync``) or
    ``"torch"`` (``Tensor.copy_``).

    ``consumers`` are a publication's first consumers: each is called as
    ``consumer(device_header)`` right after the scatter is enqueued, on the publication's
    stream (the current stream while it runs), on every path. Under ``launch="graph"``
    they are captured into each bucket's graph, so one graph launch does the DMA, the
    scatter and the consumers; their kernels must then read the step's counts from
    ``device_header`` (row ``i``, column 1: member ``i``'s published bytes), never take
    them as launch arguments.

    ``completion_event`` (a raw ``CUevent`` handle, 0: none; it must outlive the arena):
    under ``launch="graph"`` every bucket's graph ends with a record of it, so a graph
    launch also records the owner's completion (see :class:`GraphPublisher`). Other paths
    never record it: :attr:`records_completion` says whether the graphs do.
    """

    def __init__(
        self,
        layout: ArenaLayout,
        destinations: Sequence[torch.Tensor],
        *,
        device: torch.device | str | None = None,
        scatter: ScatterChoice = "auto",
        launch: LaunchChoice = "auto",
        dma: DmaChoice = "auto",
        config: ScatterConfig | None = None,
        consumers: Sequence[Consumer] = (),
        completion_event: int = 0,
    ) -> None:
        dev = resolve_device(destinations, device)
        scatter_kind, launch_kind, dma_kind = choose_paths(dev, scatter, launch, dma)
        spans = bind_destinations(layout, destinations, dev)

        self.layout = layout
        self.device = dev
        self.scatter = scatter_kind
        self.launch = launch_kind
        self.dma = dma_kind
        self.config = config if config is not None else default_config(dev)
        self.destinations = tuple(destinations)
        self.num_ranges = layout.num_ranges
        self.header_bytes = layout.header_bytes
        self.total_bytes = layout.total_bytes

        cuda = dev.type == "cuda"
        # Zeroed so every descriptor starts as a no-op and no stale byte is ever published.
        # device="cpu": an engine may still hold a CUDA default device while it binds.
        self.host = torch.zeros(layout.total_bytes, dtype=torch.uint8, device="cpu",
                                pin_memory=cuda)
        self.host_np: np.ndarray = self.host.numpy()
        self.device_arena = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=dev)
        self.dest_table = torch.tensor([a for a, _ in spans], dtype=torch.int64, device=dev)
        self.header_np: np.ndarray = (
            self.host_np[: layout.header_bytes].view(np.int64).reshape(layout.num_ranges, 4)
        )
        #: the device arena's header rows, as the scatter reads them (int64 [num_ranges, 4])
        self.device_header = (
            self.device_arena[: layout.header_bytes].view(torch.int64).view(layout.num_ranges, 4))
        self.consumers: tuple[Consumer, ...] = tuple(consumers)
        self._payload_np = tuple(self.host_np[r.offset : r.end] for r in layout.regions)
        self._payload_host = tuple(self.host[r.offset : r.end] for r in layout.regions)
        self._dest_nbytes = tuple(n for _, n in spans)
        self._grid = {
            index: self.config.grid(nbytes, layout.num_ranges)
            for index, nbytes in bucket_sizes(layout.header_bytes, layout.total_bytes).items()
        }
        self._publish: Callable[[int, torch.cuda.Stream | None], None]
        self._completion_event = completion_event
        #: how the completion event is recorded by this arena's graphs (see
        #: GraphPublisher.completion; None: no event given, or no graphs to carry it)
        self.completion: str | None = None
        if cuda:
            self._init_cuda()
        else:
            self._init_cpu()
        if completion_event and self.completion is None:
            self.completion = f"not recorded: launch={self.launch!r} captures no graph"

    # -- views -------------------------------------------------------------------------------

    def payload_np(self, index: int) -> np.ndarray:
        """Member ``index``'s payload region of the host arena (fixed uint8 numpy view)."""
        return self._payload_np[index]

    def payload_host(self, index: int) -> torch.Tensor:
        """Member ``index``'s payload region of the host arena (fixed uint8 pinned tensor view)."""
        return self._payload_host[index]

    # -- publication -------------------------------------------------------------------------

    def publish(self, dma_bytes: int, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue one H2D copy of ``host[:dma_bytes]`` and one scatter on ``stream``.

        ``stream`` defaults to the current stream. ``dma_bytes`` must cover the
        header and every active descriptor's source bytes. No synchronization,
        allocation or compilation happens here; works while the stream is
        being captured into a CUDA graph.
        """
        if not self.header_bytes <= dma_bytes <= self.total_bytes:
            raise PublishError(
                f"dma_bytes={dma_bytes}: a publication moves at least the {self.header_bytes}-byte "
                f"header and at most the arena's {self.total_bytes} bytes"
            )
        self._publish(dma_bytes, stream)

    @property
    def records_completion(self) -> bool:
        """Whether every captured graph ends with the completion event's record (only
        graph launches record it: a caller of an eager or captured publish records it)."""
        return self.launch == "graph" and self._graphs.records_completion

    def graph_launch_table(self) -> GraphLaunchTable | None:
        """Raw graph handles and driver entry points for a compiled launcher that replaces
        :meth:`publish` on its common path (h2d_core's). None unless this arena publishes
        through captured graphs launched with ``cuGraphLaunch``.

        The caller owns the rest of the contract :meth:`publish` keeps: the size must lie
        between the header and the arena, the current device must be the arena's, and a
        stream under capture (or a size without a graph) goes through :meth:`publish`.
        """
        if self.launch != "graph" or self.graph_launcher in (None, "CUDAGraph.replay"):
            return None
        return self._graphs.launch_table()

    def validate(self, dma_bytes: int | None = None) -> int:
        """Debug check of the current host header (see ``validate_descriptors``)."""
        return validate_descriptors(
            self.header_np,
            arena_nbytes=self.total_bytes,
            destination_nbytes=self._dest_nbytes,
            member_names=[m.name for m in self.layout.members],
            header_bytes=self.header_bytes,
            dma_bytes=dma_bytes,
        )

    # -- CPU ---------------------------------------------------------------------------------

    def _init_cpu(self) -> None:
        self._device_np: np.ndarray = self.device_arena.numpy()
        self._device_header_np = (
            self._device_np[: self.header_bytes].view(np.int64).reshape(self.num_ranges, 4)
        )
        self._dest_views = tuple(
            byte_view(d, f"member {m.name!r}")
            for m, d in zip(self.layout.members, self.destinations, strict=True)
        )
        # The reference scatter's loop, compiled (reference.scatter_bytes states the same
        # rule in Python and is the tests' oracle): one memcpy per descriptor, no Python
        # object per publication. The binding keeps the arrays it points into alive.
        self._cpu_scatter = _native.bind_scatter(
            self.host_np.ctypes.data, self._device_np.ctypes.data, self.header_bytes,
            self.total_bytes, self.num_ranges, tuple(v.ctypes.data for v in self._dest_views),
            tuple(v.size for v in self._dest_views),
            (self.host_np, self._device_np, self._dest_views))
        self._publish = (
            self._publish_cpu_reference if self.scatter == "reference" else self._publish_cpu_triton
        )

    @property
    def cpu_publish_binding(self) -> object | None:
        """The compiled CPU publication (``bind_scatter``) a packed group's compiled
        publish may run itself (``attach_cpu``), or None where a publication needs more
        than the copy and the scatter: a CUDA arena, the Triton scatter, first consumers."""
        if self.device_arena.device.type != "cpu" or self.scatter != "reference" or self.consumers:
            return None
        return self._cpu_scatter

    def _publish_cpu_reference(self, dma_bytes: int, stream: torch.cuda.Stream | None) -> None:
        _native.publish_cpu(self._cpu_scatter, dma_bytes)
        for consumer in self.consumers:
            consumer(self.device_header)

    def _publish_cpu_triton(self, dma_bytes: int, stream: torch.cuda.Stream | None) -> None:
        self._device_np[:dma_bytes] = self.host_np[:dma_bytes]
        grid = self._grid[bucket_index(dma_bytes)]
        launch_jit(self.device_arena, self.dest_table, self.num_ranges, grid, self.config)
        for consumer in self.consumers:
            consumer(self.device_header)

    # -- CUDA --------------------------------------------------------------------------------

    def _init_cuda(self) -> None:
        self._index = self.device.index if self.device.index is not None else 0
        self._host_addr = self.host.data_ptr()
        self._device_addr = self.device_arena.data_ptr()
        driver = device_driver()
        if self.dma == "driver" and driver is None:
            raise ScatterBackendError(
                "dma='driver' needs libcuda.so.1, which could not be loaded: use dma='torch'"
            )
        self._driver: DeviceDriver | None = driver
        self.graph_launcher: str | None = None
        """How graph publications are launched (the runtime's graph launch, e.g.
        "cuGraphLaunch", or "CUDAGraph.replay")."""
        # torch DMA path: one prebuilt (device, host) view pair per size bucket.
        self._dma_views = {
            index: (self.device_arena[:nbytes], self.host[:nbytes])
            for index, nbytes in bucket_sizes(self.header_bytes, self.total_bytes).items()
        }
        if self.launch in ("compiled", "graph"):
            compiled = CompiledScatter(
                self.device_arena, self.dest_table, self.num_ranges, self.config
            )
            self._launch_scatter = compiled.launch
        if self.launch == "graph":
            self._graphs = GraphPublisher(
                self.device,
                bucket_sizes(self.header_bytes, self.total_bytes),
                self._enqueue_compiled,
                self._driver,
                self._completion_event,
            )
            self.graph_launcher = self._graphs.launcher
            self.completion = self._graphs.completion
            self._publish = self._publish_graph
        elif self.launch == "compiled":
            self._publish = self._publish_compiled
        else:
            self._publish = self._publish_jit

    def _raw_stream(self, stream: torch.cuda.Stream | None) -> int:
        if torch._C._cuda_getDevice() != self._index:
            raise PublishError(
                f"publish on {self.device} while cuda:{torch.cuda.current_device()} is current: "
                f"make {self.device} current (torch.cuda.device) before publishing"
            )
        if stream is None:
            return int(torch._C._cuda_getCurrentRawStream(self._index))
        if stream.device != self.device:
            raise PublishError(
                f"stream on {stream.device} for an arena on {self.device}: publish on a stream "
                "of the arena's device"
            )
        return int(stream.cuda_stream)

    def _enqueue_dma(self, nbytes: int, stream: int) -> None:
        driver = self._driver
        if self.dma == "driver" and driver is not None:
            rc = driver.memcpy_htod_async(self._device_addr, self._host_addr, nbytes, stream)
            if rc and context_not_current(rc):
                # A thread that has not touched CUDA yet has no current context.
                torch.cuda.set_device(self.device)
                rc = driver.memcpy_htod_async(self._device_addr, self._host_addr, nbytes, stream)
            if rc:
                sym = driver.symbols
                raise ScatterBackendError(
                    f"{sym.memcpy_htod_async} of {nbytes} bytes failed with {sym.runtime} "
                    f"error {rc}")
            return
        dev_view, host_view = self._dma_views[bucket_index(nbytes)]
        if stream == torch._C._cuda_getCurrentRawStream(self._index):
            dev_view.copy_(host_view, non_blocking=True)
        else:
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
                dev_view.copy_(host_view, non_blocking=True)

    def _enqueue_compiled(self, nbytes: int, stream: int) -> None:
        self._enqueue_dma(nbytes, stream)
        self._launch_scatter(self._grid[bucket_index(nbytes)], stream)
        self._enqueue_consumers(stream)

    def _enqueue_consumers(self, stream: int) -> None:
        if not self.consumers:
            return
        if stream == torch._C._cuda_getCurrentRawStream(self._index):
            for consumer in self.consumers:
                consumer(self.device_header)
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
            for consumer in self.consumers:
                consumer(self.device_header)

    def _publish_compiled(self, dma_bytes: int, stream: torch.cuda.Stream | None) -> None:
        self._enqueue_compiled(dma_bytes, self._raw_stream(stream))

    def _publish_graph(self, dma_bytes: int, stream: torch.cuda.Stream | None) -> None:
        handle = self._raw_stream(stream)
        driver = self._driver
        # the current stream's status through torch's C binding (~0.15 µs) instead of a
        # ctypes call (~0.6 µs on the H200 host); another stream needs the driver query
        if (torch._C._cuda_isCurrentStreamCapturing() if stream is None
                else driver is not None and driver.stream_is_capturing(handle)):
            # A graph cannot be launched into a capture; the plain launch is capturable.
            self._enqueue_compiled(dma_bytes, handle)
        else:
            self._graphs.replay(dma_bytes, handle)

    def _publish_jit(self, dma_bytes: int, stream: torch.cuda.Stream | None) -> None:
        handle = self._raw_stream(stream)
        grid = self._grid[bucket_index(dma_bytes)]
        self._enqueue_dma(dma_bytes, handle)
        if stream is None:
            launch_jit(self.device_arena, self.dest_table, self.num_ranges, grid, self.config)
        else:
            with torch.cuda.stream(stream):
                launch_jit(self.device_arena, self.dest_table, self.num_ranges, grid, self.config)
        self._enqueue_consumers(handle)

