"""Copies and kernels per step, counted from a ``torch.profiler`` trace (not our counters).

Copies are classified by what the runtime reports, not by the label the profiler shows:
the classifier is ``h2d_kernels.copy_kinds`` (the HIP runtime's ``kind`` first, then the
memory kinds of the copy's ends, then the label), shared with the GPU tests' counts; its
names are re-exported here for the benchmarks that import them from this module.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Callable

import torch

from h2d_kernels.copy_kinds import (
    HIP_MEMCPY_KINDS,
    TraceLike,
    classify_trace,
    copy_kind,
    hip_copy_kind,
)

__all__ = ["HIP_MEMCPY_KINDS", "TraceLike", "classify_trace", "copy_kind", "count_per_step",
           "hip_copy_kind", "per_step"]


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
