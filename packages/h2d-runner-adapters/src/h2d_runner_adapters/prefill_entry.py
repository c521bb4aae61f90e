"""A prefill chunk's public entry, written once for the adapter and the fused step.

:class:`~h2d_runner_adapters.PrefillInputs` and the fused
:class:`~h2d_runner_adapters.PrefillStepInputs` take the same chunk and run the same body:
bind the step on first use, hand the chunk to the prefill adapter's
:meth:`~h2d_runner_adapters.PrefillInputs.run_chunk` (with the fused step's sampling and
token columns, if any), return the slot's plan. :func:`chunk_producer` makes that
``prepare(batch, *, publish_tables=True, owns_slot=None, mrope_positions=None,
mrope_deltas=None)`` for each, a producer of its own groups. Its arguments are passed on as
they are: a call packs no tuple or dict (the prefill allocation test's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict

import numpy as np

from h2d_core import H2DRunnerState, LayoutStep, h2d_producer

from .batch import ScheduledBatch

#: ``owns_slot``: the token positions' KV slots (int64) to a bool mask of those this rank
#: writes
OwnsSlot = Callable[[np.ndarray], np.ndarray]


class PrefillOptions(TypedDict, total=False):
    """:class:`~h2d_runner_adapters.PrefillInputs`' declaration options, which
    :class:`~h2d_runner_adapters.PrefillStepInputs` passes on (``**prefill_options``)."""

    mrope: bool
    last_page_lens: bool


class ChunkOwner(Protocol):
    """What :func:`chunk_producer`'s entry reads of its owner (the adapter or the step)."""

    h2d_state: H2DRunnerState
    group: str
    _step: LayoutStep | None
    _plans: tuple[Any, ...]
    #: a fused step's sampling and token column values (None: the adapter alone)
    _fused_values: Any

    def _bind(self) -> LayoutStep: ...

    def _run_chunk(self, step: LayoutStep, batch: ScheduledBatch, values: Sequence[Any],
                   publish_tables: bool, owns_slot: OwnsSlot | None,
                   mrope_positions: Sequence[np.ndarray | None] | None,
                   mrope_deltas: np.ndarray | None, g: str) -> None: ...


def chunk_producer(*groups: str, owner: str, doc: str) -> Callable[..., Any]:
    """The public ``prepare`` of the chunk owner class ``owner`` (a :class:`ChunkOwner`),
    a producer of ``groups`` (``@h2d_producer``) documented by ``doc``."""

    def prepare(
        self: ChunkOwner,
        batch: ScheduledBatch,
        *,
        publish_tables: bool = True,
        owns_slot: OwnsSlot | None = None,
        mrope_positions: Sequence[np.ndarray | None] | None = None,
        mrope_deltas: np.ndarray | None = None,
    ) -> Any:
        step = self._step
        if step is None:
            step = self._bind()
        # a fused step's column values (not a batch: run_chunk refuses it, naming it)
        fused = self._fused_values
        values = (fused.of(batch.columns) if fused is not None
                  and isinstance(batch, ScheduledBatch) else ())
        self._run_chunk(step, batch, values, publish_tables, owns_slot, mrope_positions,
                        mrope_deltas, self.group)
        return self._plans[self.h2d_state.current_slot]

    prepare.__qualname__ = f"{owner}.prepare"
    prepare.__doc__ = doc
    return h2d_producer(*groups)(prepare)
