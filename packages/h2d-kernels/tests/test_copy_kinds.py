"""``h2d_kernels.copy_counts`` / ``count_h2d_copies``: the one copy counter of the GPU
tests and the benchmarks, on CPU over fabricated profiler output.

* CUDA: the chrome trace torch 2.11 wrote on an H200 for a pinned upload, a pageable
  upload, a device copy and a readback (events copied from that trace: CUPTI's runtime
  calls carry ``cbid`` and ``correlation``, no kind; the GPU memcpys name their memory
  kinds), and the same four copies as ``prof.events()`` gives them (``FunctionEvent``:
  name, device type, ``id`` = kineto's correlation id, an empty ``metadata_json``).
* ROCm: the pinned upload whose GPU memcpy is named ``DtoD``, with the HIP runtime call
  carrying ``kind=1`` under the same correlation id: as ``FunctionEvent`` objects (their
  ``metadata_json`` is kineto's args text) and as a profile whose exported trace is
  rocprofiler-shaped (the ``export_chrome_trace`` route the GPU tests take).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from h2d_kernels import copy_counts, count_h2d_copies, is_copy

#: the H200's trace (torch 2.11.0+cu130, CUPTI): each copy's runtime call and GPU memcpy
H200_TRACE = [
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0,
     "tid": 7, "ts": 5385145690663.61, "dur": 1.087, "args": {
         "External id": 1, "device": 0, "context": 1, "stream": 7, "correlation": 8,
         "bytes": 4096, "memory bandwidth (GB/s)": 3.768169273229071}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 751, "tid": 751,
     "ts": 5385145690639.238, "dur": 25.019, "args": {
         "External id": 1, "cbid": 41, "correlation": 8}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0,
     "tid": 7, "ts": 5385145690737.433, "dur": 0.896, "args": {
         "External id": 2, "device": 0, "context": 1, "stream": 7, "correlation": 20,
         "bytes": 4096, "memory bandwidth (GB/s)": 4.571428571428571}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 751, "tid": 751,
     "ts": 5385145690727.665, "dur": 8.023, "args": {
         "External id": 2, "cbid": 41, "correlation": 20}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "pid": 0,
     "tid": 7, "ts": 5385145690870.744, "dur": 0.896, "args": {
         "External id": 5, "device": 0, "context": 1, "stream": 7, "correlation": 34,
         "bytes": 4096, "memory bandwidth (GB/s)": 4.571428571428571}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 751, "tid": 751,
     "ts": 5385145690837.876, "dur": 31.968, "args": {
         "External id": 5, "cbid": 41, "correlation": 34}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "pid": 0,
     "tid": 7, "ts": 5385145690940.631, "dur": 1.856, "args": {
         "External id": 9, "device": 0, "context": 1, "stream": 7, "correlation": 44,
         "bytes": 4096, "memory bandwidth (GB/s)": 2.206896551724138}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 751, "tid": 751,
     "ts": 5385145690930.677, "dur": 16.372, "args": {
         "External id": 9, "cbid": 41, "correlation": 44}},
]
H200_KINDS = Counter({"H2D": 2, "D2D": 1, "D2H": 1})


def _event(name: str, device: DeviceType, corr: int, args: dict[str, Any] | None = None,
           ) -> FunctionEvent:
    """A ``prof.events()`` entry: ``metadata_json`` is kineto's args as text (what the
    chrome trace wraps in braces), empty where the build leaves it so."""
    meta = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in (args or {}).items())
    return FunctionEvent(id=corr, name=name, thread=1, start_us=0, end_us=1,
                         device_type=device, metadata_json=meta)


def _function_events(trace: list[dict[str, Any]], with_args: bool) -> list[FunctionEvent]:
    return [_event(e["name"], DeviceType.CPU if e["cat"] == "cuda_runtime" else
                   DeviceType.CUDA, e["args"]["correlation"], e["args"] if with_args else None)
            for e in trace]


def test_cuda_trace_by_memory_kinds() -> None:
    assert copy_counts(H200_TRACE) == H200_KINDS
    assert copy_counts({"traceEvents": H200_TRACE}) == H200_KINDS
    assert count_h2d_copies(H200_TRACE) == 2


def test_cuda_function_events_by_memory_kinds() -> None:
    """torch 2.11 leaves metadata_json empty on CUDA: the names decide."""
    events = _function_events(H200_TRACE, with_args=False)
    assert copy_counts(events) == H200_KINDS
    assert count_h2d_copies(events) == 2


def _rocm_copy(corr: int, hip_kind: str, gpu_name: str) -> list[dict[str, Any]]:
    """One copy as kineto over rocprofiler-sdk writes it: the runtime call holds the
    ``hipMemcpyKind`` as a string, the GPU memcpy its own (misleading) label."""
    return [
        {"ph": "X", "cat": "cuda_runtime", "name": "hipMemcpyWithStream", "pid": 4242,
         "tid": 4242, "ts": 10.0 * corr, "dur": 2.0, "args": {
             "External id": corr + 1000, "cid": 56, "correlation": corr, "bytes": "4096",
             "kind": hip_kind}},
        {"ph": "X", "cat": "gpu_memcpy", "name": gpu_name, "pid": 0, "tid": 1,
         "ts": 10.0 * corr + 5.0, "dur": 1.0, "args": {
             "External id": corr + 1000, "device": 0, "stream": 1, "correlation": corr,
             "kind": gpu_name.split()[1], "bytes": 4096}},
    ]


#: two pinned uploads named DtoD (kind 1), a real device copy (3), a readback (2), and a
#: hipMemcpyDefault copy (4: the name decides)
ROCM_TRACE = [*_rocm_copy(1, "1", "Memcpy DtoD (Device -> Device)"),
              *_rocm_copy(2, "1", "Memcpy DtoD (Device -> Device)"),
              *_rocm_copy(3, "3", "Memcpy DtoD (Device -> Device)"),
              *_rocm_copy(4, "2", "Memcpy DtoH (Device -> Host)"),
              *_rocm_copy(5, "4", "Memcpy HtoD (Host -> Device)")]
ROCM_KINDS = Counter({"H2D": 3, "D2D": 1, "D2H": 1})


def test_rocm_function_events_by_the_hip_kind() -> None:
    events = _function_events(ROCM_TRACE, with_args=True)
    assert copy_counts(events) == ROCM_KINDS
    assert count_h2d_copies(events) == 3
    # without the runtime calls the names alone would call both uploads DtoD
    gpu_only = [e for e in events if e.device_type != DeviceType.CPU]
    assert copy_counts(gpu_only) == Counter({"D2D": 3, "D2H": 1, "H2D": 1})


def test_rocm_function_events_link_by_id_when_the_args_name_no_correlation() -> None:
    """``FunctionEvent.id`` is kineto's correlation id, shared by a call and its copy."""
    events = [_event("hipMemcpyAsync", DeviceType.CPU, 7, {"kind": "1"}),
              _event("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 7),
              _event("hipMemcpyAsync", DeviceType.CPU, 8, {"kind": "3"}),
              _event("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 8)]
    assert copy_counts(events) == Counter({"H2D": 1, "D2D": 1})


def test_rocm_roctracer_copies_named_from_empty_metadata() -> None:
    """Kineto over roctracer names the GPU memcpy ``Memcpy  ( -> )``: the runtime kind
    alone says what it was; without one it is counted apart, never dropped."""
    events = [_event("hipMemcpyAsync", DeviceType.CPU, 7, {"kind": "1"}),
              _event("Memcpy  ( -> )", DeviceType.CUDA, 7),
              _event("Memcpy  ( -> )", DeviceType.CUDA, 9)]
    assert copy_counts(events) == Counter({"H2D": 1, "other:unlabelled": 1})


class _Profile:
    """What the GPU tests hand over: a profile whose chrome trace is exported to a path."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(json.dumps({"schemaVersion": 1, "traceEvents": self.events}))


def test_a_profile_is_read_through_its_chrome_trace() -> None:
    assert copy_counts(_Profile(ROCM_TRACE)) == ROCM_KINDS
    assert count_h2d_copies(_Profile(ROCM_TRACE)) == 3
    assert copy_counts(_Profile(H200_TRACE)) == H200_KINDS


def test_a_real_cpu_profile_has_no_device_copies() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).add_(1)
    assert copy_counts(prof) == Counter()
    assert copy_counts(prof.events()) == Counter()


@pytest.mark.parametrize(("name", "copy"), [
    ("Memcpy HtoD (Pinned -> Device)", True), ("Memcpy DtoD (Device -> Device)", True),
    ("Memcpy  ( -> )", True), ("cudaMemcpyAsync", False), ("hipMemcpyWithStream", False),
    ("Memset (Device)", False), ("void memcpy_kernel<int>()", False),
])
def test_is_copy(name: str, copy: bool) -> None:
    assert is_copy(name) is copy
