"""Copies counted by kind from ``torch.profiler`` output, as the runtime reports them.

The one classifier of the tests' and benchmarks' copy counts. A copy's direction comes
from what the runtime says, not from the label the profiler displays:

1. **The runtime's ``kind`` argument** (``hipMemcpyKind``; CUDA's ``cudaMemcpyKind`` has
   the same numbers), where the profile carries it. On ROCm the profiler (kineto over
   roctracer or rocprofiler-sdk) writes each copy call as a ``cuda_runtime`` event
   (``hipMemcpyAsync``, ``hipMemcpyWithStream``, ...) whose args hold ``"kind": "1"`` and
   a ``"correlation"`` id; the GPU side is a ``gpu_memcpy`` event with the same
   correlation id (in its args, or through the ``ac2g`` flow pair linking the two). Its
   displayed name can call a pinned host-to-device copy ``DtoD`` (the spec warns about
   it), so the runtime's kind wins. ``hipMemcpyDefault`` (4) names no direction and falls
   through.
2. **The memory kinds of the copy's two ends**, from the name ``Memcpy <label> (<source
   kind> -> <destination kind>)`` (CUDA's, e.g. ``Memcpy HtoD (Pinned -> Device)``): from
   ``Pinned`` or ``Pageable`` host memory to ``Device`` (or ``Array``) memory is host to
   device whatever the label.
3. **The label**, for a copy with no memory kinds, or with an ``Unknown`` or ``Managed``
   end.

The runtime's args reach the exported chrome trace (``export_chrome_trace``) on every
torch; ``prof.events()`` carries them in ``metadata_json`` only where the torch build
fills it (torch 2.11 on CUDA leaves it empty). So :func:`copy_counts` given the profiler
itself reads its chrome trace, and given events reads what they carry.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

_MEMCPY = re.compile(r"memcpy\s+(\w+)\s*(?:\((\w+)\s*->\s*(\w+)\))?", re.IGNORECASE)
# a device event that is a copy: CUDA's and rocprofiler's "Memcpy <label> (...)", and
# roctracer's "Memcpy  ( -> )" (named from empty metadata); not "cudaMemcpyAsync" (the call)
_COPY_EVENT = re.compile(r"\s*memcpy\b", re.IGNORECASE)
_HOST = {"pinned", "pageable", "host"}
_DEVICE = {"device", "array"}
_META_FIELD = re.compile(r'"(kind|correlation)"\s*:\s*"?([\w]+)"?')
#: a chrome trace: its path, the parsed JSON object, or its ``traceEvents`` list
TraceLike = str | os.PathLike[str] | Mapping[str, Any] | Iterable[Mapping[str, Any]]

#: HIP's ``hipMemcpyKind`` (hip_runtime_api.h; CUDA's ``cudaMemcpyKind`` numbers them
#: alike): the direction the caller asked for. ``hipMemcpyDefault`` (4, inferred from
#: the pointers) is absent on purpose.
HIP_MEMCPY_KINDS = {0: "other:host-to-host", 1: "H2D", 2: "D2H", 3: "D2D",
                    1024: "D2D"}  # 1024: hipMemcpyDeviceToDeviceNoCU
_HIP_KIND_NAMES = {"hipmemcpyhosttohost": 0, "hipmemcpyhosttodevice": 1,
                   "hipmemcpydevicetohost": 2, "hipmemcpydevicetodevice": 3,
                   "hipmemcpydefault": 4, "hipmemcpydevicetodevicenocu": 1024}


def copy_kind(name: str, runtime_kind: object = None) -> str | None:
    """``"H2D"``, ``"D2H"``, ``"D2D"`` or ``"other:<label>"`` for a memcpy event name;
    None when ``name`` is no memcpy. ``runtime_kind`` is the runtime's copy kind for this
    copy (an int, or the string a trace writes); when it gives a direction it decides,
    otherwise the memory kinds in the name do, then the label."""
    by_runtime = hip_copy_kind(runtime_kind)
    if by_runtime is not None:
        return by_runtime
    m = _MEMCPY.search(name)
    if m is None:
        return None
    label, src, dst = m.group(1).lower(), m.group(2), m.group(3)
    if src and dst:
        s, d = ("host" if k.lower() in _HOST else "device" if k.lower() in _DEVICE
                else "unknown" for k in (src, dst))
        ends = (s, d)
        if "unknown" not in ends:  # both ends known (not Unknown or Managed)
            return {("host", "device"): "H2D", ("device", "host"): "D2H",
                    ("device", "device"): "D2D"}.get(ends, "other:host-to-host")
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


# ------------------------------------------------------------------- chrome traces
def _load_events(trace: TraceLike) -> list[Mapping[str, Any]]:
    loaded: Any = trace
    if isinstance(trace, (str, os.PathLike)):
        with open(trace) as f:
            loaded = json.load(f)
    if isinstance(loaded, Mapping):
        loaded = loaded.get("traceEvents", [])
    return [e for e in loaded if isinstance(e, Mapping)]


def _is_runtime_copy(cat: object, name: object) -> bool:
    return cat in ("cuda_runtime", "cuda_driver") and "memcpy" in str(name).lower()


def classify_trace(trace: TraceLike) -> tuple[Counter[str], int]:
    """Copies by kind and the kernel count of a chrome trace (a path, the parsed JSON
    object, or its ``traceEvents`` list), as ``torch.profiler``'s ``export_chrome_trace``
    writes it on CUDA or ROCm."""
    events = _load_events(trace)
    runtime: dict[object, object] = {}  # correlation id -> the call's kind argument
    for e in events:
        args = e.get("args") or {}
        if (e.get("ph") == "X" and _is_runtime_copy(e.get("cat"), e.get("name"))
                and "kind" in args and "correlation" in args):
            runtime[args["correlation"]] = args["kind"]
    # Kineto writes an ``ac2g`` flow from a runtime call to its GPU activity with the
    # call's correlation id, at the pid, tid and ts of the events it binds: the only link
    # where the GPU event's args carry no correlation (kineto over roctracer writes none).
    flows = {(e.get("ph"), e.get("pid"), e.get("tid"), e.get("ts")): e.get("id")
             for e in events
             if e.get("cat") == "ac2g" and e.get("ph") in ("s", "f") and "id" in e
             } if runtime else {}
    kinds: Counter[str] = Counter()
    kernels = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "kernel":
            kernels += 1
        elif e.get("cat") == "gpu_memcpy":
            corr = (e.get("args") or {}).get("correlation")
            if corr is None:
                corr = flows.get(("f", e.get("pid"), e.get("tid"), e.get("ts")))
            kind = copy_kind(str(e.get("name", "")),
                             runtime.get(corr) if corr is not None else None)
            kinds[kind if kind is not None else "other:unlabelled"] += 1
    return kinds, kernels


# ------------------------------------------------------------ the profiler's events
def _metadata(event: Any) -> dict[str, str]:
    """``kind`` and ``correlation`` from an event's ``metadata_json`` (kineto's args, the
    text inside the braces of the chrome trace's ``"args"``), where it has them."""
    with warnings.catch_warnings():  # torch 2.13 deprecates the attribute, still fills it
        warnings.simplefilter("ignore", FutureWarning)
        text = getattr(event, "metadata_json", None)
    if not isinstance(text, str) or not text:
        return {}
    return {k: v for k, v in _META_FIELD.findall(text)}


def _on_device(event: Any) -> bool:
    device = getattr(event, "device_type", None)
    return getattr(device, "name", str(device)) != "CPU"


def _event_copy_kinds(events: Iterable[Any]) -> Counter[str]:
    events = list(events)
    runtime: dict[str, str] = {}  # correlation id -> the runtime call's kind argument
    for e in events:
        meta = _metadata(e)
        if not _on_device(e) and "memcpy" in str(e.name).lower() and "kind" in meta:
            runtime[meta.get("correlation", str(getattr(e, "id", "")))] = meta["kind"]
    kinds: Counter[str] = Counter()
    for e in events:
        if not _on_device(e) or not is_copy(str(e.name)):
            continue
        # FunctionEvent.id is kineto's correlation id: the runtime call's and its copy's
        corr = _metadata(e).get("correlation", str(getattr(e, "id", "")))
        kind = copy_kind(str(e.name), runtime.get(corr))
        kinds[kind if kind is not None else "other:unlabelled"] += 1
    return kinds


def copy_counts(profile_or_events: Any) -> Counter[str]:
    """Device copies by kind (``"H2D"``, ``"D2H"``, ``"D2D"``, ``"other:..."``) of a
    ``torch.profiler.profile`` (its exported chrome trace: every torch writes the
    runtime's copy kind there), of a chrome trace (path, object or event list), or of
    profiler events (``prof.events()``: name, device type, correlation id and, where the
    build fills it, ``metadata_json``)."""
    if hasattr(profile_or_events, "export_chrome_trace"):
        fd, path = tempfile.mkstemp(suffix=".json", prefix="h2d_trace_")
        os.close(fd)
        try:
            profile_or_events.export_chrome_trace(path)
            return classify_trace(path)[0]
        finally:
            os.unlink(path)
    if isinstance(profile_or_events, (str, os.PathLike, Mapping)):
        return classify_trace(profile_or_events)[0]
    events = list(profile_or_events)
    if events and all(isinstance(e, Mapping) for e in events):
        return classify_trace(events)[0]
    return _event_copy_kinds(events)


def count_h2d_copies(profile_or_events: Any) -> int:
    """Host-to-device copies of a profile, a chrome trace or profiler events (see
    :func:`copy_counts`): by the runtime's copy kind where it is known (ROCm's HIP
    ``kind=1`` even when the copy's name says DtoD), else by the copy's memory kinds."""
    return copy_counts(profile_or_events)["H2D"]


def is_copy(name: str) -> bool:
    """Whether a device event's name is a copy's (of any kind, labelled or not)."""
    return _COPY_EVENT.match(name) is not None
