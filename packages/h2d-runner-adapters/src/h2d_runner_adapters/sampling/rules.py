"""The sampling columns' bounds, once: every path that takes sampling values checks these.

Three paths take them: a fused step checks them in the compiled layout pass
(:func:`layout_column`), ``SamplingInputs.prepare`` with a few numpy reductions
(:func:`check_columns`), and ``ScheduledBatch.from_requests`` one request at a time
(:meth:`SamplingRule.accepts_value`). Each reads its rule from :data:`SAMPLING_RULES`, so
a changed bound changes all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from h2d_core import LayoutColumn

from ..checks import refuse_column

_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingRule:
    """One sampling column's bound: ``column`` names the
    :class:`~h2d_runner_adapters.batch.BatchColumns` field (and the layout column),
    ``field`` the :class:`~h2d_runner_adapters.batch.SamplingParams` one; ``text`` is the
    rule as a refusal states it and ``note`` what the special values mean."""

    column: str
    field: str
    text: str
    note: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    finite: bool = False

    def accepts(self, lowest: Any, highest: Any) -> bool:
        """Whether values spanning ``[lowest, highest]`` pass (NaN never does)."""
        if self.finite and not (math.isfinite(lowest) and math.isfinite(highest)):
            return False
        if self.low is not None and not (lowest > self.low if self.low_open
                                         else lowest >= self.low):
            return False
        return self.high is None or bool(highest <= self.high)

    def accepts_value(self, value: float) -> bool:
        """Whether one Python value passes, both as given and as the float32 the column
        stores (a tiny positive top_p rounds to 0; 1e39 to an infinite temperature)."""
        if not self.accepts(value, value):
            return False
        if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
            stored = math.copysign(math.inf, value)
        else:
            stored = float(np.float32(value))
        return self.accepts(stored, stored)

    def refused(self, values: np.ndarray) -> np.ndarray:
        """The entries of ``values`` this rule refuses, as a boolean mask."""
        ok = np.isfinite(values) if self.finite else np.ones(values.shape, dtype=bool)
        if self.low is not None:
            ok &= values > self.low if self.low_open else values >= self.low
        if self.high is not None:
            ok &= values <= self.high
        return ~ok


TEMPERATURE = SamplingRule("temperatures", "temperature", "finite", "<= 0 means greedy",
                           finite=True)
TOP_K = SamplingRule("top_k", "top_k", ">= -1", "-1 or 0 turns top-k off", low=-1)
TOP_P = SamplingRule("top_p", "top_p", "in (0, 1]", "1.0 turns top-p off", low=0,
                     low_open=True, high=1)
#: the columns of a step's sampling values, in their order
SAMPLING_RULES = (TEMPERATURE, TOP_K, TOP_P)


def layout_column(rule: SamplingRule, out: np.ndarray, **options: Any) -> LayoutColumn:
    """``rule`` as a fused step's layout column over ``out`` (no graph padding: the
    sampler runs eagerly on real rows); ``options`` adds e.g. the temperature clamp."""
    return LayoutColumn(rule.column, out, pad=None, low=rule.low, high=rule.high,
                        low_open=rule.low_open, finite=rule.finite, **options)


def check_columns(group: str, columns: Any) -> None:
    """The sampling columns of ``columns`` (a ``BatchColumns``): a min and a max per column
    (they propagate NaN); the search for the refused request only on a refusal."""
    for rule in SAMPLING_RULES:
        values = getattr(columns, rule.column)
        if values.size and not rule.accepts(values.min(), values.max()):
            refuse_column(group, rule.column, values, rule.refused(values), rule.text)
