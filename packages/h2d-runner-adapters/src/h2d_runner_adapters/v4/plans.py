"""A V4.1 step's plan: what one step of the ``v41_metadata`` group published, as a named
record (counts, each ratio's plan rows, the block table's stage, the prefill window rows).

A decode step's plan reads its slot's record and the bound step's plan rows in place
(:meth:`V41Plan.over_step`): valid until the same slot's next step (see
:mod:`~h2d_runner_adapters.plan_records`).
"""

from __future__ import annotations

from h2d_core import LayoutStep, StepCounts

from ..plan_records import CountsPlan


class V41Plan(CountsPlan):
    """What a V4.1 step published: requests and tokens (real, padded), the widest query,
    per ratio (in ``ratios`` order) its plans' rows ``(real compress rows, published
    compress rows, real write rows, published write rows)``, the block table's stage, and
    (prefill) the ``v41_window_write_plan`` rows ``(real, published)`` ((0, 0) for
    decode). A decode step's plan reads its slot's record in place: valid until the same
    slot's next step (see :mod:`~h2d_runner_adapters.plan_records`)."""

    __slots__ = ("_rows", "_slot", "_step", "window_rows")
    FIELDS = ("num_reqs", "padded_reqs", "num_tokens", "padded_tokens", "max_query_len",
              "plan_rows", "table_stage", "window_rows")
    num_reqs: int
    padded_reqs: int
    num_tokens: int
    padded_tokens: int
    max_query_len: int
    table_stage: str
    window_rows: tuple[int, int]
    _rows: tuple[tuple[int, int, int, int], ...]
    _step: LayoutStep | None
    _slot: int

    def __init__(self, num_reqs: int, padded_reqs: int, num_tokens: int,
                 padded_tokens: int, max_query_len: int,
                 plan_rows: tuple[tuple[int, int, int, int], ...], table_stage: str,
                 window_rows: tuple[int, int]) -> None:
        self._counts = StepCounts(num_reqs, padded_reqs, max_query_len, num_tokens,
                                  padded_tokens, 0, table_stage)
        self._rows = tuple(plan_rows)
        self._step = None
        self._slot = 0
        self.window_rows = tuple(window_rows)  # type: ignore[assignment]

    @property
    def plan_rows(self) -> tuple[tuple[int, int, int, int], ...]:
        """Per ratio: (real compress rows, published, real write rows, published)."""
        step = self._step
        return self._rows if step is None else step.plan_rows_of(self._slot)

    @classmethod
    def over_step(cls, counts: StepCounts, step: LayoutStep, slot: int) -> V41Plan:
        """A decode plan reading a bound step's ``slot`` in place (its counts record and
        plan rows)."""
        plan: V41Plan = cls.over(counts)
        plan._rows = ()
        plan._step = step
        plan._slot = slot
        plan.window_rows = _NO_WINDOW_ROWS
        return plan


_NO_WINDOW_ROWS = (0, 0)  # decode publishes no window-write plan
