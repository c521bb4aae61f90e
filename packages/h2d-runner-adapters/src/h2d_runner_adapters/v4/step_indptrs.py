"""The later first consumers of ``v41_metadata``, in one index: prefill indptrs and
indices, the indexer rectangle, and the decode step's own (step indptrs, the per-token
expansion, the window tails).

Each kernel sits in its own module of this room beside its launcher and a plain-Python
oracle written from the context document (:mod:`.decode_steps`, :mod:`.window_rows`,
:mod:`.prefill_indptrs`, :mod:`.prefill_indices`, :mod:`.indexer`); host-side counts are
Python ints, and the blocks are powers of two, so a kernel compiles once per size bucket,
not per batch.
"""

from __future__ import annotations

from h2d_runner_adapters.v4.decode_steps import (
    BLOCK_COLUMNS,
    StepIndptrs,
    _step_indptrs_kernel,
    _token_tables_kernel,
    expand_v4_token_tables,
    expand_v4_token_tables_reference,
    generate_v4_step_indptrs,
    generate_v4_step_indptrs_reference,
    launch_v4_decode_steps_from_counts,
)
from h2d_runner_adapters.v4.indexer import (
    write_v4_indexer_rectangle,
    write_v4_indexer_rectangle_reference,
)
from h2d_runner_adapters.v4.prefill_indices import (
    PrefillIndices,
    write_v4_prefill_indices,
    write_v4_prefill_indices_reference,
)
from h2d_runner_adapters.v4.prefill_indptrs import (
    PrefillIndptrs,
    generate_v4_prefill_indptrs,
    generate_v4_prefill_indptrs_reference,
)
from h2d_runner_adapters.v4.window_rows import (
    DecodeWindowIndices,
    WindowGeometry,
    write_v4_decode_window_indices,
    write_v4_decode_window_indices_reference,
)

__all__ = [
    "BLOCK_COLUMNS",
    "DecodeWindowIndices",
    "PrefillIndices",
    "PrefillIndptrs",
    "StepIndptrs",
    "WindowGeometry",
    "_step_indptrs_kernel",
    "_token_tables_kernel",
    "expand_v4_token_tables",
    "expand_v4_token_tables_reference",
    "generate_v4_prefill_indptrs",
    "generate_v4_prefill_indptrs_reference",
    "generate_v4_step_indptrs",
    "generate_v4_step_indptrs_reference",
    "launch_v4_decode_steps_from_counts",
    "write_v4_decode_window_indices",
    "write_v4_decode_window_indices_reference",
    "write_v4_indexer_rectangle",
    "write_v4_indexer_rectangle_reference",
    "write_v4_prefill_indices",
    "write_v4_prefill_indices_reference",
]
