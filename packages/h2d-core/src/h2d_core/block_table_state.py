"""Page-map state attached to a block-table buffer: CPU preparation and GPU publication.

``block_table_state(buffer)`` gives a block-table buffer (2-D int32, counted in rows) one
:class:`block_tables.PageTableSnapshot` per slot over that slot's pinned source, plus a
record of what its GPU destination holds. Two revisions stay separate:

* the *prepared* revision (per slot's snapshot) changes exactly when CPU bytes change;
* the *published* record says which snapshot, revision and row count the GPU table holds.
  It is written only after the carrying group's publication succeeded, and forgotten when
  the owner is reset after a failure.

Each step the runner prepares rows (``prepare``) and then stages the table for its group
(``stage``): the GPU table is reused (the member omitted) when destination, prepared
revision and row count all match. Otherwise, under the default policy
(``publication="ranges"``), only the changed column spans travel (extra ranges inside the
group's one packed DMA) while they are few (at most 8 ranges, 32 for tables of 4 MiB or
more, at most half the published rows' bytes, within the staging room), else rows
``[0, n)`` in one bulk publication; under ``publication="whole"`` (the spec's literal
rule) always rows ``[0, n)`` in one piece. :mod:`h2d_core.table_policy` has the exact
rules and the knobs' checks.

CUDA-graph capture prepares the table it binds through the same state
(:meth:`BlockTableState.prepare_capture`: empty rows for the captured batch size, staged
like any step), never by filling the GPU table directly. Writing the buffer's CPU or GPU
table outside these entry points breaks this contract; call
:meth:`BlockTableState.invalidate` afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from block_tables import BlockTable, PageTableSnapshot

from .buffer import CountUnit, H2DBuffer
from .config import Backend
from .errors import CountError, DeclarationError, DuplicatePublicationError
from .state import H2DRunnerState
from .table_policy import (
    PARTIAL_MAX_SHARE,
    PublicationArg,
    TablePublication,
    check_max_ranges,
    check_max_share,
    check_publication,
    limit_table,
)
from .table_stage import PARTIAL, REUSED, WHOLE, PublishedTable, TableStager


class StageResult:
    """How ``stage`` published the table this epoch."""

    REUSED = REUSED
    PARTIAL = PARTIAL
    WHOLE = WHOLE


class BlockTableState:
    """Per-slot page-table snapshots of one block-table buffer and its GPU record."""

    def __init__(
        self,
        buffer: H2DBuffer,
        *,
        pool_limit: int | None = None,
        fill_value: int = 0,
        partial_max_share: float = PARTIAL_MAX_SHARE,
        partial_max_ranges: int | None = None,
        publication: PublicationArg = TablePublication.RANGES,
        reserved_page: int | None = None,
    ) -> None:
        spec = buffer.spec
        if spec.dtype != torch.int32 or len(spec.shape) != 2 or spec.unit is not CountUnit.ROWS:
            raise DeclarationError(
                f"buffer {buffer.name!r}: block_table_state needs a 2-D int32 buffer counted "
                f"in rows, got shape {spec.shape} {spec.dtype} unit {spec.unit.value!r}"
            )
        state = buffer._state
        if not isinstance(state, H2DRunnerState):
            raise DeclarationError(f"buffer {buffer.name!r} is not owned by an H2DRunnerState")
        state.require_owner()
        state.require_bound()
        # the policy, checked before anything is made and resolved once, here
        name = buffer.name
        self._publication = check_publication(name, publication)
        self._partial_max_ranges = check_max_ranges(name, partial_max_ranges,
                                                     buffer.max_ranges)
        self._partial_max_share = check_max_share(name, partial_max_share)
        self.buffer = buffer
        self.state = state
        # what a refused call is called, made once (the passing check makes no object)
        self._what_prepare, self._what_capture, self._what_stage = (
            f"{call} of {name!r}" for call in ("prepare", "prepare_capture", "stage"))
        self.snapshots = tuple(
            PageTableSnapshot(buffer.source(slot).numpy(), pool_limit=pool_limit,
                              fill_value=fill_value,
                              reserved_page=reserved_page)
            for slot in range(state.num_slots)
        )
        self._row_bytes = spec.unit_bytes
        ranged = (
            self._publication is TablePublication.RANGES
            and buffer.max_ranges > 0
            and state.backend is Backend.PACKED
            and state.plan(buffer.publication_group).packed
        )
        # the published record, key buffers and limits as compiled state, made once
        self._stager = TableStager(self, self._limit_table(), ranged)
        group = buffer.group
        state.groups.add_stager(group, self._stager)
        # Capture rows: one private empty row (versioned, so a repeated capture
        # preparation is a hit; private, so nothing ever appends to it).
        self._empty_rows = [BlockTable()] * spec.shape[0]
        state.on_reset(self.forget_gpu)

    # -- CPU side ---------------------------------------------------------------------------
    @property
    def snapshot(self) -> PageTableSnapshot:
        """The current slot's snapshot."""
        return self.snapshots[self.state.current_slot]

    @property
    def prepared_revision(self) -> int:
        return self.snapshot.revision

    def prepare(
        self,
        rows: Sequence[object],
        *,
        required_pages: Sequence[int] | np.ndarray | None = None,
        padding: int = 0,
    ) -> int:
        """Bring the current slot's CPU table to ``rows`` (padding rows included: the last
        ``padding`` of them, the only rows that may hold the table's reserved page);
        return the prepared revision. All rows are validated before any write; prefill
        may prepare without publishing."""
        state = self.state
        state.require_ready(self._what_prepare)
        slot = state.current_slot
        if type(padding) is not int or not 0 <= padding <= len(rows):
            raise CountError(
                f"buffer {self.buffer.name!r}: padding={padding!r} must be an int in "
                f"[0, {len(rows)}] (the last rows that are graph padding)")
        self._stager.prepare(slot, rows, required_pages, None, 0, padding)
        return self.snapshots[slot].revision

    def prepare_capture(self, num_rows: int) -> str:
        """Prepare and stage the table a CUDA-graph capture of ``num_rows`` requests binds:
        rows ``[0, num_rows)`` empty (every column the fill value), as padding rows are.

        Call it inside an epoch, before the table's group is published, then publish that
        group before the capture (or its warm-up) reads the table. The rows go through the
        current slot's snapshot (the prepared revision advances when bytes change) and
        :meth:`stage` (the published record moves only when that publication succeeds),
        so the next step publishes exactly what differs from the captured table. (Filling
        the GPU table directly leaves the record naming the earlier revision: a step
        with those rows would then reuse a GPU table that no longer holds them.)
        ``num_rows`` is checked before any write. Returns the :class:`StageResult`.
        """
        state = self.state
        state.require_ready(self._what_capture)
        name = self.buffer.name
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)):
            raise CountError(
                f"buffer {name!r}: prepare_capture num_rows must be an int, got "
                f"{type(num_rows).__name__}")
        num_rows = int(num_rows)
        capacity = len(self._empty_rows)
        if not 0 <= num_rows <= capacity:
            raise CountError(
                f"buffer {name!r}: prepare_capture of {num_rows} rows, but the table holds "
                f"[0, {capacity}] rows; capture a batch size the table was declared for")
        if state.is_published(self.buffer.group):
            raise DuplicatePublicationError(
                f"buffer {name!r}: group {self.buffer.group!r} was already published in "
                "this epoch; prepare the capture table in a new epoch (begin()) before "
                "publishing its group")
        self.snapshots[state.current_slot].prepare(self._empty_rows[:num_rows])
        return self.stage(num_rows)

    # -- GPU side ---------------------------------------------------------------------------
    def stage(self, num_rows: int) -> str:
        """Decide and set what this epoch publishes of the table for rows ``[0, num_rows)``.

        Returns ``StageResult.REUSED`` (member omitted: the GPU already holds these rows at
        this revision), ``PARTIAL`` (changed spans as ranges) or ``WHOLE`` (a row count).
        The record is updated only when the group's publication succeeds.
        """
        state = self.state
        state.require_ready(self._what_stage)
        slot = state.current_slot
        snap = self.snapshots[slot]
        if type(num_rows) is not int:
            if isinstance(num_rows, bool) or not isinstance(num_rows, np.integer):
                raise CountError(f"buffer {self.buffer.name!r}: num_rows must be an int")
            num_rows = int(num_rows)
        if not 0 <= num_rows <= snap.num_rows:
            raise CountError(
                f"buffer {self.buffer.name!r}: {num_rows} rows requested but slot {slot}'s "
                f"snapshot prepared {snap.num_rows}; prepare() the rows (padding included) first"
            )
        return self._stager.stage(slot, num_rows)

    @property
    def published(self) -> PublishedTable | None:
        """What the GPU table holds (slot, revision, rows, row keys), or None when unknown
        (the next stage sends it whole). Moves only when a publication succeeded."""
        return self._stager.published

    @property
    def last_stage(self) -> str:
        """The last stage's :class:`StageResult` ("" before the first)."""
        return self._stager.last_stage

    def _limit_table(self) -> list[tuple[int, int]]:
        return limit_table(self.buffer.spec.shape[0], self._row_bytes, self.buffer.max_ranges,
                           self._partial_max_ranges, self._partial_max_share)

    @property
    def publication(self) -> TablePublication:
        """What a changed table sends (fixed when the state is made)."""
        return self._publication

    @property
    def partial_max_share(self) -> float:
        """Largest share of the published rows' bytes a partial publication carries, in
        [0, 1] (0: none; a changed table travels whole)."""
        return self._partial_max_share

    @partial_max_share.setter
    def partial_max_share(self, value: float) -> None:
        self._partial_max_share = check_max_share(self.buffer.name, value)
        self._stager.set_limits(self._limit_table())

    @property
    def partial_max_ranges(self) -> int | None:
        """Override of the measured range-count policy, in [0, the buffer's
        ``max_ranges``] (None: the measured policy; 0: no ranges, a changed table travels
        whole)."""
        return self._partial_max_ranges

    @partial_max_ranges.setter
    def partial_max_ranges(self, value: int | None) -> None:
        self._partial_max_ranges = check_max_ranges(self.buffer.name, value,
                                                    self.buffer.max_ranges)
        self._stager.set_limits(self._limit_table())

    def forget_gpu(self) -> None:
        """Forget what the GPU table holds (after a failure); the next stage sends it whole."""
        self._stager.forget()

    def invalidate(self) -> None:
        """Recover after something wrote the CPU or GPU table outside this state."""
        for snap in self.snapshots:
            snap.invalidate()
        self._stager.forget()


def block_table_state(
    buffer: H2DBuffer,
    *,
    pool_limit: int | None = None,
    fill_value: int = 0,
    partial_max_share: float = PARTIAL_MAX_SHARE,
    partial_max_ranges: int | None = None,
    publication: PublicationArg = TablePublication.RANGES,
    reserved_page: int | None = None,
) -> BlockTableState:
    """Attach page-map state to a bound block-table buffer (one per buffer: each PP slot
    has its own snapshot inside, each TBO buffer gets its own state).

    ``publication`` is what a table the GPU does not hold sends:
    ``TablePublication.RANGES`` (``"ranges"``, the default) its changed byte ranges inside
    the group's one packed DMA while they are few (``partial_max_ranges``: None for the
    measured 8, or 32 for tables of 4 MiB or more, else an int in [0, the buffer's
    ``max_ranges``]; ``partial_max_share``: in [0, 1], default 0.5, of the published rows'
    bytes), else the published rows whole; ``TablePublication.WHOLE`` (``"whole"``) the
    published rows whole, in one piece, whenever the table changed (the spec's literal
    bulk rule; the partial knobs then have no effect). A knob of 0 allows no range. A bad
    knob raises :class:`~h2d_core.TablePolicyError` and attaches nothing.

    ``reserved_page`` (an engine's dummy block) is a page only the graph padding rows a
    step appends may hold: a real row bringing it is refused
    (:class:`block_tables.ReservedPageError`) before anything is written."""
    existing = getattr(buffer, "_page_map", None)
    if existing is not None:
        raise DeclarationError(
            f"buffer {buffer.name!r} already has block-table state; share that object"
        )
    state = BlockTableState(buffer, pool_limit=pool_limit, fill_value=fill_value,
                            partial_max_share=partial_max_share,
                            partial_max_ranges=partial_max_ranges,
                            publication=publication, reserved_page=reserved_page)
    buffer._page_map = state  # type: ignore[attr-defined]
    return state
