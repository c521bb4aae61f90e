"""``StepSpec``: a producer's part of a compiled step, and how two parts join.

The rules (``h2d_core.step_spec``): counts keep their order across a join; a step stages
at most one block table (its padding rows come with it) and runs at most one planned-batch
check, each taken from the part that declares it; padding rows without a table, and
anything but ``CountRule`` records as counts, are refused when the spec is made. That a
joined spec binds the same step as the direct constructor is
``test_layout_step.py``'s exact-bytes test, run both ways.
"""

from __future__ import annotations

from typing import Any

import pytest

from h2d_core import PADDED_REQS, PADDED_TOKENS, REQS, CountRule, DeclarationError, StepSpec

A, B, C = (CountRule(f"buffer_{i}", what) for i, what in
           enumerate((REQS, PADDED_TOKENS, PADDED_REQS)))
TABLE, ROWS = object(), (object(),) * 2


def check(layout: Any) -> None:
    """A planned-batch check (never called here)."""


def test_join_keeps_order_and_takes_the_one_table_and_check() -> None:
    tokens = StepSpec([A, B])
    decode = StepSpec([C], TABLE, ROWS, check)
    joined = tokens + decode
    assert joined.counts == (A, B, C)
    assert joined.table is TABLE and joined.pad_rows == ROWS and joined.check is check
    # the other order: the table, its rows and the check stay the part's own
    other = decode + tokens
    assert other.counts == (C, A, B)
    assert (other.table, other.pad_rows, other.check) == (TABLE, ROWS, check)
    # a spec is a value: joining changed neither part
    assert tokens.counts == (A, B) and tokens.table is None and decode.counts == (C,)


def test_a_list_given_is_kept_as_a_tuple() -> None:
    spec = StepSpec([A], TABLE, list(ROWS))
    assert spec.counts == (A,) and spec.pad_rows == ROWS


@pytest.mark.parametrize(("left", "right", "match"), [
    (StepSpec([A], TABLE), StepSpec([B], object()), "both parts read a block table"),
    (StepSpec([A], check=check), StepSpec([B], check=check), "both parts check"),
])
def test_a_second_table_or_check_is_refused(left: StepSpec, right: StepSpec,
                                            match: str) -> None:
    with pytest.raises(DeclarationError, match=match):
        left + right


def test_bad_parts_are_refused_when_made() -> None:
    with pytest.raises(DeclarationError, match="pad_rows given without a table"):
        StepSpec([A], None, ROWS)
    with pytest.raises(DeclarationError, match="counts must be CountRule records"):
        StepSpec([("buffer", REQS)])  # type: ignore[list-item]
    assert StepSpec().__add__(object()) is NotImplemented  # type: ignore[operator]
