"""The sleep a GPU-span measurement queues each step behind (every benchmark's spans).

A span is timed by CUDA events around one step's work. If the GPU reaches the first event
before the host has enqueued the rest, the span holds host gaps, not GPU work; a
``torch.cuda._sleep`` in front that outlasts the way's own host enqueue keeps the whole
step queued before the GPU starts it.
"""

from __future__ import annotations

#: ``torch.cuda._sleep`` cycles per µs at the ~2 GHz SM clock of the lent GPUs
CYCLES_PER_US = 2000


def sleep_cycles(host_us: float) -> int:
    """Cycles that outlast a host enqueue of ``host_us`` (a high percentile of the way's
    host time) three times over, and at least 1 ms."""
    return int(max(1000.0, 3 * host_us + 300) * CYCLES_PER_US)
