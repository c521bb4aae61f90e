"""GPU half of test_completion_launch.py: the publication graph's event record node.

Run with ``RUN_H2D_GPU_TESTS=1`` on a CUDA machine (marked ``gpu``: no CPU half; the CPU
rules run against the simulation in test_completion_launch.py).

1. A state's packed groups bind graphs that record their slot's event
   (``records_completion``); the event is pending while the graph waits behind a busy
   stream, and the next ``begin()`` on the slot blocks for it.
2. One steady step in a profiler trace: its DMA and scatter enqueued by one call (one
   correlation id: the graph launch), and on the host no kernel launch, event
   record/query or memcpy call.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from h2d_kernels import copy_counts, device_driver, is_copy

pytestmark = pytest.mark.gpu

HOLD_CYCLES = 100_000_000  # torch.cuda._sleep ahead of the publication: tens of ms
NOT_READY = 600  # CUDA_ERROR_NOT_READY

#: host-side API calls that must not appear in a steady step (runtime and driver names)
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                   "cuLaunchKernelEx")
EVENT_CALLS = ("cudaEventRecord", "cuEventRecord", "cudaEventQuery", "cuEventQuery",
               "cudaEventSynchronize", "cuEventSynchronize", "cudaEventRecordWithFlags",
               "cuEventRecordWithFlags")
COPY_CALLS = ("cudaMemcpyAsync", "cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", "cudaMemcpy",
              "cuMemcpyAsync")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def _event_query(handle: int) -> int:
    driver = device_driver()
    assert driver is not None
    fn = getattr(driver._lib, driver.symbols.event_query)
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return int(fn(handle))


def _steady(h: Any, num_slots: int = 1) -> Any:
    setup = h.build_state("cuda", num_slots=num_slots)
    st = setup.state
    rec = st._slot_groups[0][0]
    assert rec.packed is not None and rec.packed.launches_graphs, "graph launch expected"
    assert rec.packed.records_completion, (
        f"graphs carry no completion record: {rec.packed.arena.completion}")
    assert rec.packed.arena.completion == "cuEventRecordWithFlags"
    return setup


def _produce(setup: Any, base: int) -> None:
    st = setup.state
    for b in setup.buffers.values():
        b.np.reshape(-1)[:] = (base + np.arange(b.np.size)) % 120
        st.set_count(b, b.spec.capacity)


def test_the_graph_records_the_slot_event_and_begin_waits_for_it(h: Any) -> None:
    setup = _steady(h)
    st = setup.state
    ids = setup.buffers["input_ids"]
    for base in (1, 2):  # the second round runs on warm graphs
        st.begin()
        _produce(setup, base)
        torch.cuda._sleep(HOLD_CYCLES)  # the graph waits behind this
        st.publish("decode")
        assert st.completions.graph_recorded
        st.finish()  # records nothing: the graph's node does
        assert st.completions.driver_events is not None
        assert _event_query(st.completions.driver_events.handles[0]) == NOT_READY, (
            "the slot's event is complete while its graph still waits: the graph did not "
            "record it")
        st.begin()  # must block until the graph's record
        assert st.last_source_wait_ns > 1_000_000, "begin() did not wait for the graph"
        ids.np[:] = -1  # safe: the DMA ran
        st.finish()
        torch.cuda.synchronize()
        assert ids.gpu.tolist() == ((base + np.arange(ids.np.size)) % 120).tolist()


def test_one_steady_step_is_one_graph_launch(h: Any) -> None:
    from torch.profiler import ProfilerActivity, profile

    setup = _steady(h)
    st = setup.state
    for base in range(3):  # warm up
        st.begin()
        _produce(setup, base)
        st.publish("decode")
        st.finish()
    torch.cuda.synchronize()
    st.mark_synchronized()  # the host synchronized: begin() needs no query
    skipped = st.source_checks_skipped
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        st.begin()
        _produce(setup, 7)
        st.publish("decode")
        st.finish()
        torch.cuda.synchronize()
    assert st.source_checks_skipped == skipped + 1
    # the graph recorded the slot's event, so finish() recorded none: the trace cannot show
    # that (the compiled event calls go to the driver's entry points, which it does not
    # list), the state's flag does
    assert all(rec.packed.records_completion for recs in st._slot_groups for rec in recs
               if rec.packed is not None)
    assert st.completions.graph_recorded
    events = list(prof.events())
    host = Counter(e.name for e in events if e.device_type.name == "CPU")
    calls = {n: c for n, c in host.items()
             if n in KERNEL_LAUNCHES + EVENT_CALLS + COPY_CALLS + GRAPH_LAUNCHES}
    assert not any(host[n] for n in KERNEL_LAUNCHES), calls
    assert not any(host[n] for n in EVENT_CALLS), calls
    assert not any(host[n] for n in COPY_CALLS), calls
    # The compiled launch calls the driver's cuGraphLaunch through its address, which the
    # trace does not list (seen on the H200): at most the one launch shows on the host.
    assert sum(host[n] for n in GRAPH_LAUNCHES) <= 1, calls
    # on the device: the graph's one H2D DMA and one scatter kernel
    names = [e.name for e in events
             if e.device_type.name == "CUDA" and not e.name.startswith("h2d.")]
    trace = _chrome_trace(prof)  # a profile exports its trace once
    assert copy_counts(trace) == Counter({"H2D": 1}), names
    kernels = [n for n in names if not is_copy(n) and "Memset" not in n]
    assert len(kernels) == 1, names
    # ... enqueued by one API call: every device activity carries the correlation id of
    # the call that launched it, and a graph launch is the one call that enqueues both
    device_work = [e for e in trace["traceEvents"]
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"].get("correlation") for e in device_work}
    assert len(device_work) >= 2 and len(launches) == 1 and None not in launches, device_work


def _chrome_trace(prof: Any) -> dict[str, Any]:
    """The profile's chrome trace, parsed."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json", prefix="h2d_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace: dict[str, Any] = json.load(f)
    finally:
        os.unlink(path)
    return trace
