"""Copies and kernels per step, counted from a ``torch.profiler`` trace (not our counters)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def count_per_step(step: Callable[[], object], n: int) -> dict[str, float]:
    """Run ``step`` ``n`` times under the profiler; H2D memcpys and kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    h2d = kernels = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name.lower()
        if name.startswith("h2d."):
            continue  # the profiler mirrors our record_function ranges on the GPU timeline
        if "memcpy" in name:
            h2d += "htod" in name
        elif "memset" not in name:
            kernels += 1
    return {"h2d_per_step": h2d / n, "kernels_per_step": kernels / n}
