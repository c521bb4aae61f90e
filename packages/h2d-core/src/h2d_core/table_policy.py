"""The block-table publication policy: what a changed table sends, and its knobs' rules.

``block_table_state(buffer, publication=..., partial_max_ranges=..., partial_max_share=...)``
takes these; each is checked here, once, when the state is made (or a knob is set), and
resolved into the per-row-count limits the compiled stager reads, so no step reads or
checks a knob.

* ``publication=TablePublication.RANGES`` (the default, ``"ranges"``): a changed table
  sends only its changed byte ranges, inside the group's one packed DMA, while they are
  few: at most ``partial_max_ranges`` ranges (default 8, or 32 for tables of
  ``LARGE_TABLE_BYTES`` or more when the rows requested are counted; never more than the
  buffer's ``max_ranges``), at most ``partial_max_share`` of the published rows' bytes
  (default 0.5), and within the group's staging room for ranges (each range costs
  ``RANGE_OVERHEAD`` bytes beyond its payload). Otherwise, or when the group is not
  packed, the published rows travel whole.
* ``publication=TablePublication.WHOLE`` (``"whole"``): the spec's literal rule ("changed
  tables still use one bulk publication"): a table the GPU does not hold at this revision
  and row count sends rows ``[0, n)`` as one piece (one count, no ranges), whenever its
  bytes or its row count changed. The partial knobs are still checked but have no effect.

``partial_max_ranges=0`` or ``partial_max_share=0`` allow no range: a table whose bytes
changed travels whole (one whose bytes did not, e.g. fewer rows at the same revision,
still sends nothing). A bad value raises :class:`~h2d_core.TablePolicyError` naming the
buffer, the knob and its rule, and changes nothing.
"""

from __future__ import annotations

import enum
import math
from typing import Literal

import numpy as np

from .errors import TablePolicyError

# When changed spans travel as ranges instead of the whole table (measured on the H200,
# docs/benchmarks.md "block-table crossover"): each range costs a few µs of host time
# (staging copy, descriptor) and the scatter slows down with many descriptors, while a
# whole table costs no host copy but moves every row. Up to 8 ranges, partial publication
# costs the host about the same as a whole table and moves far fewer bytes; beyond that
# the whole table wins on the host, unless it is large enough (>= 4 MiB: long contexts at
# large batch) that its DMA dominates the GPU span, where up to 32 ranges still pay off.
#: most ranges of an ordinary partial publication
PARTIAL_MAX_RANGES = 8
#: tables of at least this many bytes (rows requested) may use up to ``LARGE_TABLE_RANGES``
LARGE_TABLE_BYTES = 4 << 20
LARGE_TABLE_RANGES = 32
#: and a partial publication never carries more than this share of the table's bytes
PARTIAL_MAX_SHARE = 0.5


class TablePublication(str, enum.Enum):
    """What a block table the GPU does not hold sends (see the module docstring)."""

    #: changed byte ranges inside the group's DMA while few, else the published rows whole
    RANGES = "ranges"
    #: the published rows whole, in one piece, whenever the table changed
    WHOLE = "whole"


PublicationArg = TablePublication | Literal["ranges", "whole"]


def check_publication(name: str, value: object) -> TablePublication:
    """``value`` as a :class:`TablePublication` (the enum or its exact value)."""
    if isinstance(value, TablePublication):
        return value
    if isinstance(value, str):
        for p in TablePublication:
            if value == p.value:
                return p
    valid = ", ".join(repr(p.value) for p in TablePublication)
    raise TablePolicyError(
        f"buffer {name!r}: publication={value!r} is not a known block-table publication "
        f"policy; use a TablePublication or one of {valid}")


def check_max_ranges(name: str, value: object, buffer_max: int) -> int | None:
    """``partial_max_ranges``: None (the measured policy) or an int in [0, the buffer's
    ``max_ranges``]; 0 allows no range."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TablePolicyError(
            f"buffer {name!r}: partial_max_ranges={value!r}: must be None or an int (most "
            "ranges of a partial publication; 0: none, changed tables travel whole)")
    if not 0 <= value <= buffer_max:
        raise TablePolicyError(
            f"buffer {name!r}: partial_max_ranges={value!r}: must be in [0, {buffer_max}] "
            f"(buffer {name!r} max_ranges={buffer_max}; 0: no ranges, changed tables travel "
            "whole)")
    return int(value)


def check_max_share(name: str, value: object) -> float:
    """``partial_max_share``: a real number in [0, 1]; 0 allows no range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TablePolicyError(
            f"buffer {name!r}: partial_max_share={value!r}: must be a real number in [0, 1] "
            "(largest share of the published rows' bytes a partial publication carries)")
    share = float(value)
    if not (math.isfinite(share) and 0.0 <= share <= 1.0):
        raise TablePolicyError(
            f"buffer {name!r}: partial_max_share={value!r}: must be in [0, 1] (largest "
            "share of the published rows' bytes a partial publication carries; 0: none, "
            "changed tables travel whole)")
    return share


def limit_table(rows: int, row_bytes: int, buffer_max: int, max_ranges: int | None,
                share: float) -> list[tuple[int, int]]:
    """``(most ranges, most bytes)`` of a partial publication of ``n`` rows, for every
    ``n`` in ``[0, rows]``: what the compiled stager reads per step."""
    out = []
    for n in range(rows + 1):
        whole = n * row_bytes
        if max_ranges is None:
            most = LARGE_TABLE_RANGES if whole >= LARGE_TABLE_BYTES else PARTIAL_MAX_RANGES
        else:
            most = max_ranges
        out.append((min(most, buffer_max), int(share * whole)))
    return out
