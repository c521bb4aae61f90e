"""Publication captured as CUDA graphs, one per DMA-size bucket.

Each graph holds one H2D copy of ``host[:bucket]`` and one scatter launch (then the fused
first consumers, and the slot's completion event record when one is given).
Buckets are powers of two (the last one is the whole arena), so a
publication copies at most twice its bytes; extra arena bytes are harmless
because only the descriptors decide what is written. All graphs are captured
at construction: capturing later would synchronize the device mid-run.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2d_kernels.driver import DeviceDriver
from h2d_kernels.errors import PublishError, ScatterBackendError


def bucket_index(nbytes: int) -> int:
    """Index of the smallest power of two >= ``nbytes`` (0 for 1 byte)."""
    return (nbytes - 1).bit_length()


def bucket_sizes(min_bytes: int, total_bytes: int) -> dict[int, int]:
    """Bucket index -> bytes copied, for every DMA size in ``[min_bytes, total_bytes]``."""
    sizes: dict[int, int] = {}
    for index in range(bucket_index(max(min_bytes, 1)), bucket_index(total_bytes) + 1):
        sizes[index] = min(1 << index, total_bytes)
    return sizes


@dataclass(frozen=True)
class GraphLaunchTable:
    """What a compiled caller needs to launch an arena's publication graphs itself.

    ``execs[i]`` is the ``CUgraphExec`` handle of the graph that copies ``2**i`` bytes (the
    last bucket: the whole arena), 0 where no graph covers that size. The function
    fields are driver entry-point addresses. Handles stay valid while the arena lives.
    """

    execs: tuple[int, ...]
    graph_launch: int
    stream_is_capturing: int


class GraphPublisher:
    """Replays the captured (DMA + scatter) graph of a publication's bucket.

    Replay goes straight to ``cuGraphLaunch`` on the instantiated graph when
    torch exposes it (``CUDAGraph.raw_cuda_graph_exec``) and a driver binding
    is given, skipping ``CUDAGraph.replay``'s own overhead; otherwise it uses
    ``replay()`` on the requested stream. :attr:`launcher` says which.

    ``completion_event`` (a raw ``CUevent`` handle; 0: none): each graph ends with an
    event record node of it (``cuEventRecordWithFlags(..., CU_EVENT_RECORD_EXTERNAL)``
    under capture), so a launch also records the owner's completion and the owner need
    not enqueue a record of its own after it. The event must outlive the graphs.
    :attr:`completion` says whether the graphs carry it, and why not.
    """

    def __init__(
        self,
        device: torch.device,
        sizes: dict[int, int],
        enqueue: Callable[[int, int], None],
        driver: DeviceDriver | None = None,
        completion_event: int = 0,
    ) -> None:
        """Capture ``enqueue(bucket_bytes, raw_stream)`` once per bucket on a side stream."""
        self._device = device
        self._driver = driver
        self._event = 0
        #: how the graphs carry the completion event: the record's entry point (e.g.
        #: "cuEventRecordWithFlags"), None when no event was given, or "not recorded: ..."
        #: saying why the owner must record it after each launch itself
        self.completion: str | None = None
        if completion_event:
            missing = ("no driver binding" if driver is None
                       else driver.record_external_missing)
            if missing is None:
                assert driver is not None
                self._event = completion_event
                self.completion = driver.symbols.event_record_with_flags
            else:
                self.completion = f"not recorded: {missing}"
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        side = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        # A garbage-collected CUDAGraph destroys its exec; doing that in the middle of
        # a capture invalidates the capture (seen on the H200 test run), so collect
        # first and keep the collector off while capturing.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture(device, sizes, enqueue, side)
        finally:
            if was_enabled:
                gc.enable()
        current.wait_stream(side)
        # The graphs stay referenced in self._graphs, so their exec handles stay valid.
        self._execs: dict[int, int] = {}
        if driver is not None:
            try:
                self._execs = {i: int(g.raw_cuda_graph_exec()) for i, g in self._graphs.items()}
            except (AttributeError, RuntimeError):
                self._execs = {}  # older torch: replay() below
        self.launcher = (driver.symbols.graph_launch if self._execs and driver is not None
                         else "CUDAGraph.replay")

    def _capture(
        self,
        device: torch.device,
        sizes: dict[int, int],
        enqueue: Callable[[int, int], None],
        side: torch.cuda.Stream,
    ) -> None:
        with torch.cuda.device(device), torch.cuda.stream(side):
            # One eager run first: module loads and lazy init must not happen under capture.
            enqueue(min(sizes.values()), side.cuda_stream)
            for index, nbytes in sizes.items():
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    enqueue(nbytes, side.cuda_stream)
                    if self._event:
                        self._record_completion(side.cuda_stream)
                finally:
                    graph.capture_end()
                self._graphs[index] = graph

    @property
    def records_completion(self) -> bool:
        """Whether every graph ends with the completion event's record node."""
        return self._event != 0

    def _record_completion(self, stream: int) -> None:
        # last in the graph: it follows the DMA (the host arena's only reader), the
        # scatter and the fused consumers
        assert self._driver is not None
        rc = self._driver.event_record_external(self._event, stream)
        if rc:
            raise ScatterBackendError(
                f"{self._driver.symbols.event_record_with_flags} under capture failed with "
                f"{self._driver.symbols.runtime} error {rc}: bind without a completion event")

    def launch_table(self) -> GraphLaunchTable | None:
        """The raw handles for compiled launches, or None when graphs replay through torch."""
        if not self._execs or self._driver is None:
            return None
        execs = [0] * (max(self._execs) + 1)
        for index, handle in self._execs.items():
            execs[index] = handle
        return GraphLaunchTable(tuple(execs), self._driver.address("graph_launch"),
                                self._driver.address("stream_is_capturing"))

    def replay(self, dma_bytes: int, stream: int) -> None:
        """Launch the bucket graph for ``dma_bytes`` on the raw stream handle ``stream``."""
        index = bucket_index(dma_bytes)
        if index not in self._graphs:
            raise PublishError(
                f"no captured graph covers dma_bytes={dma_bytes}: pass a size between the "
                "header and the arena's total_bytes"
            )
        if self._execs and self._driver is not None:
            rc = self._driver.graph_launch(self._execs[index], stream)
            if rc:
                raise ScatterBackendError(
                    f"{self._driver.symbols.graph_launch} failed with "
                    f"{self._driver.symbols.runtime} error {rc}")
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self._device)):
            self._graphs[index].replay()
