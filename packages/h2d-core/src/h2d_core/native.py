"""h2d_core's compiled driver-event helper (``h2d_core._events_native``, built from
``_events.pyx``), required at import: the slots' driver events (:mod:`~h2d_core.launch`).
The record rules are ``records.py`` and the step ``step.py``, compiled by Cython as
``h2d_core._records_native`` and ``h2d_core._step_native``."""

from __future__ import annotations

from block_tables.native import require_extension

native = require_extension("h2d_core._events_native")
