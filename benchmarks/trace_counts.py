"""Copies and kernels per step, counted from a ``torch.profiler`` trace (not our counters).

Copies are classified by the memory kinds the runtime reports for their two ends, not by the
label in front of them: the profiler names a CUDA memcpy ``Memcpy <label> (<source kind> ->
<destination kind>)``, and the label can mislabel (the spec warns that ROCm reports pinned
host to device copies as DtoD). A copy from ``Pinned`` or ``Pageable`` host memory to
``Device`` memory is a host-to-device copy whatever its label; one without memory kinds
falls back to the label.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import torch

_MEMCPY = re.compile(r"memcpy\s+(\w+)\s*(?:\((\w+)\s*->\s*(\w+)\))?", re.IGNORECASE)
_HOST = {"pinned", "pageable", "host"}


def copy_kind(name: str) -> str | None:
    """``"H2D"``, ``"D2H"``, ``"D2D"`` or ``"other:<label>"`` for a memcpy event name,
    from its memory kinds when the name carries them; None when ``name`` is no memcpy."""
    m = _MEMCPY.search(name)
    if m is None:
        return None
    label, src, dst = m.group(1).lower(), m.group(2), m.group(3)
    if src and dst:
        s, d = src.lower() in _HOST, dst.lower() in _HOST
        if s != d:
            return "H2D" if s else "D2H"
        if not s:
            return "D2D"
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
