"""What each producer contributes to a compiled :class:`~h2d_core.LayoutStep`, declared once.

An adapter states its part of a step as one :class:`StepSpec`: the count rule of every
member it publishes, the block table its layouts read (and the empty rows padded requests
take), and the checks that need the planned batch. A fused step joins its adapters' specs
with ``+`` and binds the result over its layouts::

    spec = token_spec + decode.step_spec()      # counts in order, the one table
    step = spec.bind(group, state, layouts, sum_column=5, error=AdapterInputError)

so a fused step reads its adapters' public specs, never their private members. Specs are
made at bind; a step's hot path only runs the compiled :class:`LayoutStep`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .count_rules import CountRule
from .errors import CountError, DeclarationError
from .step import LayoutStep


@dataclass(frozen=True)
class StepSpec:
    """One producer's part of a :class:`LayoutStep`.

    ``counts``: one :class:`CountRule` per member the producer publishes, in the order the
    step stores them; ``table``: the :class:`~h2d_core.BlockTableState` its layouts read
    (None: no table); ``pad_rows``: the rows padded requests take (empty: the step pads
    no rows, e.g. an eager prefill); ``check``: called with the planned layout before
    anything is written (an adapter's checks that need the planned batch; they raise and
    change nothing). :meth:`__add__` joins two producers' parts of one step."""

    counts: Sequence[CountRule] = ()
    table: Any = None
    pad_rows: Sequence[Any] = ()
    check: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        # a list given is kept as a tuple: a spec is a value, joined and bound, never edited
        object.__setattr__(self, "counts", tuple(self.counts))
        object.__setattr__(self, "pad_rows", tuple(self.pad_rows))
        if not all(isinstance(r, CountRule) for r in self.counts):
            raise DeclarationError(
                f"StepSpec: counts must be CountRule records, got "
                f"{[type(r).__name__ for r in self.counts]}")
        if self.pad_rows and self.table is None:
            raise DeclarationError(
                "StepSpec: pad_rows given without a table; padded rows are the table's")

    def __add__(self, other: StepSpec) -> StepSpec:
        """The two parts as one step's: counts in order; at most one table (with its
        padding rows) and at most one check, each taken from the part that has it."""
        if not isinstance(other, StepSpec):
            return NotImplemented
        if self.table is not None and other.table is not None:
            raise DeclarationError(
                "StepSpec: both parts read a block table; a step stages one table (declare "
                "the other producer's table in its own group)")
        if self.check is not None and other.check is not None:
            raise DeclarationError(
                "StepSpec: both parts check the planned batch; join the checks in one "
                "function")
        mine = self.table is not None
        return StepSpec(
            counts=(*self.counts, *other.counts),
            table=self.table if mine else other.table,
            pad_rows=self.pad_rows if mine else other.pad_rows,
            check=self.check if self.check is not None else other.check,
        )

    def bind(self, name: str, state: Any, layouts: Sequence[Any], *, sum_column: int = -1,
             error: type[CountError] = CountError, plan_group: int = 1) -> LayoutStep:
        """The compiled :class:`LayoutStep` ``name`` of this spec over ``layouts`` (one
        :class:`~h2d_core.RequestLayout` per slot of ``state``); ``sum_column``,
        ``error`` and ``plan_group`` are :class:`LayoutStep`'s."""
        return LayoutStep(name, state, layouts, self.table, self.pad_rows, self.counts,
                          sum_column=sum_column, error=error, plan_group=plan_group,
                          check=self.check)
