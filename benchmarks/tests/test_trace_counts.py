"""Copy counting from profiler traces (``h2d_kernels.copy_kinds``, through
``benchmarks/trace_counts.py``'s per-step counts): on ROCm the HIP
runtime's ``kind`` argument decides, through the runtime call's correlation id, whatever
the GPU memcpy's displayed name says; CUDA-shaped traces are classified by memory kinds
as before.

The synthetic traces are shaped like ``torch.profiler``'s ``export_chrome_trace`` output:
kineto's ChromeTraceLogger writes each activity as ``{"ph": "X", "cat": ..., "name": ...,
"pid": ..., "tid": ..., "ts": ..., "dur": ..., "args": {...}}`` and links a runtime call
to its GPU activity with an ``ac2g`` flow pair whose id is the correlation id. The
``args`` below are those of kineto's activity ``metadataJson`` (rocprofiler-sdk:
``RocprofActivity_inl.h``; roctracer: ``RoctracerActivity_inl.h``; CUDA: CUPTI's).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from trace_counts import count_per_step, per_step

from h2d_kernels import classify_trace, copy_kind, hip_copy_kind

Event = dict[str, Any]


def _x(cat: str, name: str, pid: object, tid: object, ts: float, args: dict[str, Any]) -> Event:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
            "dur": 1.5, "args": args}


def _flow(corr: int, runtime: Event, gpu: Event) -> list[Event]:
    start = {"ph": "s", "id": corr, "pid": runtime["pid"], "tid": runtime["tid"],
             "ts": runtime["ts"], "cat": "ac2g", "name": "ac2g"}
    finish = {"ph": "f", "id": corr, "pid": gpu["pid"], "tid": gpu["tid"], "ts": gpu["ts"],
              "cat": "ac2g", "name": "ac2g", "bp": "e"}
    return [start, finish]


def _rocprof_copy(corr: int, ts: float, hip_kind: str, gpu_name: str,
                  api: str = "hipMemcpyWithStream") -> list[Event]:
    """One copy as kineto over rocprofiler-sdk writes it: the runtime call carries the
    ``hipMemcpyKind`` as a string, the GPU memcpy carries the GPU op's own kind label."""
    runtime = _x("cuda_runtime", api, 4242, 4242, ts, {
        "External id": corr + 1000, "cid": 56, "correlation": corr,
        "src": "0x7f3a40000000", "dst": "0x7f3b00200000", "bytes": "4096",
        "kind": hip_kind})
    label = gpu_name.split()[1]
    gpu = _x("gpu_memcpy", gpu_name, 0, 1, ts + 10.0, {
        "External id": corr + 1000, "device": 0, "stream": 1, "correlation": corr,
        "kind": label, "bytes": 4096, "memory bandwidth (GB/s)": 2.7})
    return [runtime, gpu, *_flow(corr, runtime, gpu)]


def _rocprof_kernel(corr: int, ts: float) -> list[Event]:
    runtime = _x("cuda_runtime", "hipLaunchKernel", 4242, 4242, ts, {
        "cid": 8, "correlation": corr, "grid": [64, 1, 1], "block": [64, 1, 1],
        "shared memory": 0})
    gpu = _x("kernel", "_h2d_scatter_kernel", 0, 1, ts + 10.0, {
        "device": 0, "stream": 1, "correlation": corr, "kind": "Dispatch Kernel",
        "grid": [64, 1, 1], "block": [64, 1, 1]})
    return [runtime, gpu, *_flow(corr, runtime, gpu)]


def _annotations(ts: float) -> list[Event]:
    """What no count may include: the CPU op, our range mirrored on the GPU timeline, a
    memset."""
    return [
        _x("cpu_op", "aten::copy_", 4242, 4242, ts, {"External id": 1}),
        _x("gpu_user_annotation", "h2d.publish/mha_decode", 0, 1, ts, {"External id": 2}),
        _x("gpu_memset", "Memset (Device)", 0, 1, ts + 1.0, {"device": 0, "stream": 1,
                                                            "correlation": 9999}),
    ]


def rocm_trace(steps: int = 2) -> dict[str, Any]:
    """``steps`` publications on ROCm: the DMA (a pinned upload the GPU side names
    ``DtoD``), the scatter kernel; plus, once, a real device-to-device copy, a readback,
    and a copy whose runtime kind is ``hipMemcpyDefault``."""
    events: list[Event] = []
    for i in range(steps):
        base = 100.0 * i
        events += _rocprof_copy(10 * i + 1, base, "1", "Memcpy DtoD (Device -> Device)")
        events += _rocprof_kernel(10 * i + 2, base + 30.0)
        events += _annotations(base)
    events += _rocprof_copy(901, 900.0, "3", "Memcpy DtoD (Device -> Device)",
                            api="hipMemcpyAsync")
    events += _rocprof_copy(902, 950.0, "2", "Memcpy DtoH (Device -> Host)")
    # hipMemcpyDefault says nothing about direction: the name decides
    events += _rocprof_copy(903, 990.0, "4", "Memcpy HtoD (Host -> Device)")
    return {"schemaVersion": 1, "deviceProperties": [], "traceEvents": events}


def test_a_rocm_upload_named_dtod_counts_as_h2d_by_its_runtime_kind() -> None:
    kinds, kernels = classify_trace(rocm_trace(steps=2))
    assert kinds == Counter({"H2D": 3, "D2D": 1, "D2H": 1})
    assert kernels == 2
    assert per_step(kinds, kernels, 2)["h2d_per_step"] == 1.5


def test_without_the_runtime_events_the_name_would_say_d2d() -> None:
    """The trace's GPU side alone calls the uploads device to device: the runtime kind is
    what makes them H2D (so the test above cannot pass by the name)."""
    trace = rocm_trace(steps=2)
    gpu_only = [e for e in trace["traceEvents"] if e.get("cat") != "cuda_runtime"]
    kinds, _ = classify_trace(gpu_only)
    assert kinds == Counter({"D2D": 3, "D2H": 1, "H2D": 1})


def test_roctracer_traces_link_by_the_flow_when_gpu_args_carry_no_correlation() -> None:
    """Kineto over roctracer writes no args on the GPU memcpy and names it from empty
    metadata (``Memcpy  ( -> )``); its runtime call has ``size``, ``stream`` and ``kind``.
    The ``ac2g`` flow's id is the correlation id."""
    events: list[Event] = []
    for corr, hip_kind in ((7, "1"), (8, "2"), (9, "1")):
        runtime = _x("cuda_runtime", "hipMemcpyAsync", 3131, 3131, 10.0 * corr, {
            "stream": "0x55d0c0a0", "cid": 52, "correlation": corr,
            "src": "0x7f0000000000", "dst": "0x7f1000000000", "size": "256",
            "kind": hip_kind})
        gpu = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy  ( -> )", "pid": 2,
               "tid": 0, "ts": 10.0 * corr + 3.0, "dur": 0.8}
        events += [runtime, gpu, *_flow(corr, runtime, gpu)]
    kinds, kernels = classify_trace(events)
    assert kinds == Counter({"H2D": 2, "D2H": 1})
    assert kernels == 0


def test_a_gpu_memcpy_with_no_label_and_no_runtime_kind_is_counted_apart() -> None:
    gpu = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy  ( -> )", "pid": 2, "tid": 0,
           "ts": 1.0, "dur": 0.8}
    assert classify_trace([gpu]) == (Counter({"other:unlabelled": 1}), 0)


def cuda_trace() -> dict[str, Any]:
    """One step on CUDA: CUPTI's runtime calls carry no kind (``cbid`` and
    ``correlation``), the GPU memcpys name their memory kinds."""
    names = ["Memcpy HtoD (Pinned -> Device)", "Memcpy DtoD (Pinned -> Device)",
             "Memcpy DtoH (Device -> Pinned)", "Memcpy DtoD (Device -> Device)",
             "Memcpy HtoD (Unknown -> Device)", "Memcpy HtoH (Pinned -> Pageable)"]
    events: list[Event] = []
    for corr, name in enumerate(names, start=1):
        runtime = _x("cuda_runtime", "cudaMemcpyAsync", 777, 777, 5.0 * corr,
                     {"External id": 50 + corr, "cbid": 41, "correlation": corr})
        gpu = _x("gpu_memcpy", name, 0, 7, 5.0 * corr + 2.0, {
            "External id": 50 + corr, "device": 0, "context": 1, "stream": 7,
            "correlation": corr, "bytes": 512, "memory bandwidth (GB/s)": 1.1})
        events += [runtime, gpu, *_flow(corr, runtime, gpu)]
    launch = _x("cuda_runtime", "cudaLaunchKernel", 777, 777, 90.0,
                {"cbid": 211, "correlation": 40})
    kernel = _x("kernel", "void h2d_scatter_kernel<int>(...)", 0, 7, 92.0, {
        "queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": 40,
        "registers per thread": 32, "grid": [4, 1, 1], "block": [128, 1, 1]})
    events += [launch, kernel, *_flow(40, launch, kernel), *_annotations(0.0)]
    return {"schemaVersion": 1, "traceEvents": events}


def test_a_cuda_trace_is_classified_by_memory_kinds_as_before() -> None:
    trace = cuda_trace()
    kinds, kernels = classify_trace(trace)
    names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "gpu_memcpy"]
    assert kinds == Counter(copy_kind(n) for n in names)  # the name-only classification
    assert kinds == Counter({"H2D": 3, "D2H": 1, "D2D": 1, "other:host-to-host": 1})
    assert kernels == 1


def test_a_trace_file_on_disk_is_read(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(rocm_trace(steps=3)))
    kinds, kernels = classify_trace(path)
    assert (kinds["H2D"], kernels) == (4, 3)
    assert classify_trace(str(path)) == (kinds, kernels)


@pytest.mark.parametrize(("value", "kind"), [
    (1, "H2D"), ("1", "H2D"), (" 1 ", "H2D"), ("hipMemcpyHostToDevice", "H2D"),
    (2, "D2H"), ("3", "D2D"), (1024, "D2D"), (0, "other:host-to-host"),
    (4, None), ("4", None), ("hipMemcpyDefault", None), (None, None), (True, None),
    ("DtoD", None), (7, None), (1.0, None),
])
def test_hip_memcpy_kinds(value: object, kind: str | None) -> None:
    assert hip_copy_kind(value) == kind


def test_the_runtime_kind_overrides_the_name_and_default_falls_back() -> None:
    assert copy_kind("Memcpy DtoD (Device -> Device)", "1") == "H2D"
    assert copy_kind("Memcpy DtoD (Device -> Device)", "4") == "D2D"
    assert copy_kind("Memcpy DtoD (Pinned -> Device)", None) == "H2D"
    assert copy_kind("void kernel()", None) is None


@pytest.mark.gpu
def test_count_per_step_on_the_gpu() -> None:
    """A real trace: one pinned upload, one device-to-device copy and one kernel per step,
    inside one of our ranges (mirrored on the GPU timeline, counted as nothing)."""
    src = torch.arange(64, dtype=torch.int32).pin_memory()
    dst = torch.empty(64, dtype=torch.int32, device="cuda")
    other = torch.empty_like(dst)

    def step() -> None:
        with torch.autograd.profiler.record_function("h2d.publish/test"):
            dst.copy_(src, non_blocking=True)
            other.copy_(dst)
            other.add_(1)

    got = count_per_step(step, 3)
    assert got == {"h2d_per_step": 1.0, "kernels_per_step": 1.0,
                   "copies_by_kind": {"D2D": 1.0, "H2D": 1.0}}
    assert torch.equal(other.cpu(), src + 1)
