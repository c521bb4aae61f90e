"""Copies and kernels per step, counted from a ``torch.profiler`` trace (not our counters).

Copies are classified by the memory kinds the runtime reports for their two ends, not by the
label in front of them: the profiler names a CUDA memcpy ``Memcpy <label> (<source kind> ->
<destination kind>)``, and the label can mislabel (the spec warns that ROCm reports pinned
host to device copies as DtoD). A copy from ``Pinned`` or ``Pageable`` host memory to
``Device`` (or ``Array``) memory is a host-to-device copy whatever its label; a copy with
no memory kinds, or with an ``Unknown`` or ``Managed`` end, falls back to the label.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import torch

_MEMCPY = re.compile(r"memcpy\s+(\w+)\s*(?:\((\w+)\s*->\s*(\w+)\))?", re.IGNORECASE)
_HOST = {"pinned", "pageable", "host"}
_DEVICE = {"device", "array"}


def copy_kind(name: str) -> str | None:
    """``"H2D"``, ``"D2H"``, ``"D2D"`` or ``"other:<label>"`` for a memcpy event name,
    from its memory kinds when the name carries them; None when ``name`` is no memcpy."""
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


def count_per_step(step: Callable[[], object], n: int) -> dict[str, object]:
    """Run ``step`` ``n`` times under the profiler: H2D copies and kernels per step, and
    every copy per step by kind (``copies_by_kind``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kinds: Counter[str] = Counter()
    kernels = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        if e.name.lower().startswith("h2d."):
            continue  # the profiler mirrors our record_function ranges on the GPU timeline
        kind = copy_kind(e.name)
        if kind is not None:
            kinds[kind] += 1
        elif "memset" not in e.name.lower():
            kernels += 1
    return {"h2d_per_step": kinds["H2D"] / n, "kernels_per_step": kernels / n,
            "copies_by_kind": {k: v / n for k, v in sorted(kinds.items())}}
