"""Copies and kernels per step, counted from a ``torch.profiler`` trace (not our counters).

Copies are classified by what the runtime reports, not by the label the profiler shows:

1. **The HIP runtime's ``kind`` argument**, where the trace carries it. On ROCm the
   profiler (kineto over roctracer or rocprofiler-sdk) writes each copy call as a
   ``cuda_runtime`` event (``hipMemcpyAsync``, ``hipMemcpyWithStream``, ...) whose args
   hold the call's ``hipMemcpyKind`` (``"kind": "1"``) and a ``"correlation"`` id; the GPU
   side is a ``gpu_memcpy`` event with the same correlation id (in its args, or through
   the ``ac2g`` flow pair linking the two). The GPU event's displayed name can call a
   pinned host-to-device copy ``DtoD`` (the spec warns about it), so the runtime's kind
   wins. ``hipMemcpyDefault`` (4) says nothing about direction and falls through.
2. **The memory kinds of the copy's two ends**, from the name ``Memcpy <label> (<source
   kind> -> <destination kind>)`` (what CUDA's profiler writes): a copy from ``Pinned`` or
   ``Pageable`` host memory to ``Device`` (or ``Array``) memory is host to device whatever
   its label.
3. **The label**, for a copy with no memory kinds, or with an ``Unknown`` or ``Managed``
   end.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

_MEMCPY = re.compile(r"memcpy\s+(\w+)\s*(?:\((\w+)\s*->\s*(\w+)\))?", re.IGNORECASE)
_HOST = {"pinned", "pageable", "host"}
_DEVICE = {"device", "array"}
#: a chrome trace: its path, the parsed JSON object, or its ``traceEvents`` list
TraceLike = str | os.PathLike[str] | Mapping[str, Any] | Iterable[Mapping[str, Any]]

#: HIP's ``hipMemcpyKind`` (hip_runtime_api.h): the direction the caller asked for.
#: ``hipMemcpyDefault`` (4, inferred from the pointers) is absent on purpose.
HIP_MEMCPY_KINDS = {0: "other:host-to-host", 1: "H2D", 2: "D2H", 3: "D2D",
                    1024: "D2D"}  # 1024: hipMemcpyDeviceToDeviceNoCU
_HIP_KIND_NAMES = {"hipmemcpyhosttohost": 0, "hipmemcpyhosttodevice": 1,
                   "hipmemcpydevicetohost": 2, "hipmemcpydevicetodevice": 3,
                   "hipmemcpydefault": 4, "hipmemcpydevicetodevicenocu": 1024}


def copy_kind(name: str, runtime_kind: object = None) -> str | None:
    """``"H2D"``, ``"D2H"``, ``"D2D"`` or ``"other:<label>"`` for a memcpy event name;
    None when ``name`` is no memcpy. ``runtime_kind`` is the HIP runtime's
    ``hipMemcpyKind`` for this copy (an int, or the string a trace writes); when it gives a
    direction it decides, otherwise the memory kinds in the name do, then the label."""
    by_runtime = hip_copy_kind(runtime_kind)
    if by_runtime is not None:
        return by_runtime
    m = _MEMCPY.search(name)
    if m is None:
        return None
    label, src, dst = m.group(1).lower(), m.group(2), m.group(3)
    if src and dst:
        kinds = {"host" if k.lower() in _HOST else "device" if k.lower() in _DEVICE
                 else None for k in (src, dst)}
        if None not in kinds:  # both ends known (not Unknown or Managed)
            s, d = ("host" if src.lower() in _HOST else "device",
                    "host" if dst.lower() in _HOST else "device")
            return {("host", "device"): "H2D", ("device", "host"): "D2H",
                    ("device", "device"): "D2D"}.get((s, d), "other:host-to-host")
    return {"htod": "H2D", "dtoh": "D2H", "dtod": "D2D"}.get(label, f"other:{label}")


def hip_copy_kind(value: object) -> str | None:
    """The direction a ``hipMemcpyKind`` value names (``1`` or ``"1"`` or
    ``"hipMemcpyHostToDevice"``: ``"H2D"``), or None when it names none (absent,
    ``hipMemcpyDefault``, unknown)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        code = _HIP_KIND_NAMES.get(text.lower())
        if code is None:
            try:
                code = int(text)
            except ValueError:
                return None
        value = code
    if not isinstance(value, int):
        return None
    return HIP_MEMCPY_KINDS.get(value)


def _load_events(trace: TraceLike) -> list[Mapping[str, Any]]:
    loaded: Any = trace
    if isinstance(trace, (str, os.PathLike)):
        with open(trace) as f:
            loaded = json.load(f)
    if isinstance(loaded, Mapping):
        loaded = loaded.get("traceEvents", [])
    return [e for e in loaded if isinstance(e, Mapping)]


def _runtime_copy_kinds(events: list[Mapping[str, Any]]) -> dict[object, object]:
    """Correlation id -> the ``kind`` argument of each runtime memcpy call carrying one."""
    kinds: dict[object, object] = {}
    for e in events:
        args = e.get("args") or {}
        if (e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "memcpy" in str(e.get("name", "")).lower()
                and "kind" in args and "correlation" in args):
            kinds[args["correlation"]] = args["kind"]
    return kinds


def _flow_correlations(events: list[Mapping[str, Any]]) -> dict[tuple[object, ...], object]:
    """(pid, tid, ts) of each flow's start and finish -> its id. Kineto writes an ``ac2g``
    flow from a runtime call to its GPU activity with the call's correlation id, at the
    same pid, tid and ts as the events it binds: the only link where the GPU event's
    args carry no correlation (kineto over roctracer writes none)."""
    return {(e.get("ph"), e.get("pid"), e.get("tid"), e.get("ts")): e.get("id")
            for e in events
            if e.get("cat") == "ac2g" and e.get("ph") in ("s", "f") and "id" in e}


def classify_trace(trace: TraceLike) -> tuple[Counter[str], int]:
    """Copies by kind and the kernel count of a chrome trace (a path, the parsed JSON
    object, or its ``traceEvents`` list), as ``torch.profiler``'s ``export_chrome_trace``
    writes it on CUDA or ROCm."""
    events = _load_events(trace)
    runtime = _runtime_copy_kinds(events)
    flows = _flow_correlations(events) if runtime else {}
    kinds: Counter[str] = Counter()
    kernels = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat == "kernel":
            kernels += 1
        elif cat == "gpu_memcpy":
            args = e.get("args") or {}
            corr = args.get("correlation")
            if corr is None:
                corr = flows.get(("f", e.get("pid"), e.get("tid"), e.get("ts")))
            name = str(e.get("name", ""))
            kind = copy_kind(name, runtime.get(corr) if corr is not None else None)
            kinds[kind if kind is not None else "other:unlabelled"] += 1
    return kinds, kernels


def per_step(kinds: Counter[str], kernels: int, n: int) -> dict[str, object]:
    """The counts of ``n`` steps as per-step figures (what :func:`count_per_step` returns)."""
    return {"h2d_per_step": kinds["H2D"] / n, "kernels_per_step": kernels / n,
            "copies_by_kind": {k: v / n for k, v in sorted(kinds.items())}}


def count_per_step(step: Callable[[], object], n: int) -> dict[str, object]:
    """Run ``step`` ``n`` times under the profiler: H2D copies and kernels per step, and
    every copy per step by kind (``copies_by_kind``), read from the exported chrome trace
    (the only place the HIP runtime's copy kind reaches)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="h2d_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        kinds, kernels = classify_trace(path)
    finally:
        os.unlink(path)
    return per_step(kinds, kernels, n)
