"""h2d_core's compiled helper (``_core_native.c``, built into the wheel by hatch_build.py):
the fused count store of :class:`~h2d_core.count_batch.CountBatch` and the slots' driver
events (:mod:`~h2d_core.launch`). None when it is not installed or ``H2D_NATIVE=0``
(:mod:`block_tables.native` says which; the Python paths then run)."""

from __future__ import annotations

from block_tables.native import load_extension

native = load_extension("h2d_core._h2d_core_native")
