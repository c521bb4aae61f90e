"""How a :class:`~h2d_core.LayoutStep` counts each member of its group: the rules an
adapter declares once, at bind (read by the step's compiled count program, never per
step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .count_program import STEP_COUNTS
from .errors import DeclarationError


class CountRule(NamedTuple):
    """How a :class:`LayoutStep` counts one member: ``what`` (``REQS``, ``PADDED_REQS``,
    ``TOKENS``, ``PADDED_TOKENS``, ``PLAN_ROWS``: the published rows of the layout's
    plan ``plan``, or ``STEP_COUNTS``: an int32 member of at least 4 elements into which
    the step writes its counts ``(num_reqs, padded_reqs, num_tokens, padded_tokens)``, for
    first consumers that read them on the device; or ``DRAFTS``: the sum of the layout's
    summed column, the step's draft tokens) plus ``plus``; omitted (None) when
    ``what`` is ``OMITTED`` (a member of the group this step leaves out) or the layout's
    ``uniform_mask`` has a bit of
    ``omit_if_uniform`` set (a per-request filter whose values are all equal travels as a
    scalar instead)."""

    buffer: Any
    what: int
    plus: int = 0
    omit_if_uniform: int = 0
    plan: int = 0
    #: the count is ``times * what + plus`` (e.g. 3 planes of the padded tokens)
    times: int = 1


def count_addresses(name: str, state: Any, rules: Sequence[CountRule]) -> Any:
    """Per slot, the pinned source address of the one ``STEP_COUNTS`` member (an int32
    buffer of at least 4 elements), or an empty array without one."""
    members = [r.buffer for r in rules if r.what == STEP_COUNTS]
    if not members:
        return np.zeros(0, dtype=np.intp)
    buffer = members[0]
    if (len(members) > 1 or buffer.spec.dtype != torch.int32 or buffer.spec.capacity < 4
            or not buffer.source(0).is_contiguous()):
        raise DeclarationError(
            f"LayoutStep {name!r}: STEP_COUNTS names {[b.name for b in members]}; name one "
            "contiguous int32 buffer of at least 4 elements")
    return np.array([buffer.source(slot).data_ptr() for slot in range(state.num_slots)],
                    dtype=np.intp)
