"""h2d_core's C helper (``_core_native.c``, built into the wheel by hatch_build.py): the
slots' driver events (:mod:`~h2d_core.launch`). None when it is not installed or
``H2D_NATIVE=0`` (:mod:`block_tables.native` says which; torch events then run). The
record rules are ``records.py``, compiled by Cython as ``h2d_core._records_native``."""

from __future__ import annotations

from block_tables.native import load_extension

native = load_extension("h2d_core._h2d_core_native")
