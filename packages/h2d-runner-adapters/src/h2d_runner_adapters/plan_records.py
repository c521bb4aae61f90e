"""Plans as named records that a steady step refreshes in place, never rebuilds.

A producer's plan tells its first consumers what the step published (request and token
counts, the table's stage, the sampler's filters). A bound step builds one plan per slot
at its first call and returns that slot's plan every step after: its fields read the
step's :class:`h2d_core.StepCounts` record (C integers the compiled step refreshes) and
the slot's own pinned sources, so producing a plan creates no Python object.

**A plan stays valid until the same slot's next step.** Read (or copy with
:meth:`StepPlan.astuple`) what you keep longer. Plans built by hand (warm-up, tests)
hold their own values.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, ClassVar

from h2d_core import StepCounts


class StepPlan:
    """A named record: ``FIELDS`` name its fields, in the order its constructor takes
    them; equal when of the same class with equal fields."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def astuple(self) -> tuple[Any, ...]:
        """The fields' current values, in ``FIELDS`` order (a copy that outlives the
        slot's next step)."""
        return tuple(getattr(self, f) for f in self.FIELDS)

    def replace(self, **changes: Any) -> Any:
        """A hand-built plan of the same class with ``changes`` over the current fields
        (it holds its own values: the slot's next step leaves it as it is)."""
        unknown = set(changes) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)}; "
                            f"its fields are {', '.join(self.FIELDS)}")
        values = [changes.get(f, getattr(self, f)) for f in self.FIELDS]
        return type(self)(*values)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.astuple() == other.astuple()

    __hash__ = None  # type: ignore[assignment]  # mutable: refreshed each step

    def __repr__(self) -> str:
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.FIELDS)
        return f"{type(self).__name__}({shown})"


class CountsPlan(StepPlan):
    """A plan whose fields are a :class:`h2d_core.StepCounts` record's: each name in
    ``FIELDS`` that the class does not define itself reads the record's field of that
    name, or the one ``COUNTS`` pairs with it (``(plan field, record field)``) where the
    plan names it otherwise. Subclasses annotate those fields (their types) and define
    the others (properties)."""

    __slots__ = ("_counts",)
    _counts: StepCounts
    COUNTS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        renamed = dict(cls.COUNTS)
        for name in cls.FIELDS:
            if name not in cls.__dict__:
                field = renamed.get(name, name)
                if not hasattr(StepCounts, field):
                    raise TypeError(f"{cls.__name__}.{name}: StepCounts has no field "
                                    f"{field!r}; define the field or name it in COUNTS")
                setattr(cls, name, property(attrgetter(f"_counts.{field}")))

    @classmethod
    def over(cls, counts: StepCounts) -> Any:
        """The plan that reads ``counts`` (a bound step's per-slot record) in place."""
        plan = cls.__new__(cls)
        plan._counts = counts
        return plan


class CompositePlan(StepPlan):
    """A step's plan made of its adapters' plans (fields set once, at construction)."""

    __slots__ = ()

    def __init__(self, *plans: Any) -> None:
        if len(plans) != len(self.FIELDS):
            raise TypeError(f"{type(self).__name__} takes {len(self.FIELDS)} plans "
                            f"({', '.join(self.FIELDS)}), got {len(plans)}")
        for name, plan in zip(self.FIELDS, plans, strict=True):
            object.__setattr__(self, name, plan)


def slot_plans(state: Any, step: Any, make: Any) -> tuple[Any, ...]:
    """One plan per slot of ``state``: ``make(step.counts(slot), slot)`` (a bound
    :class:`h2d_core.LayoutStep`'s records), built once; the producer returns
    ``plans[state.current_slot]`` every step."""
    return tuple(make(step.counts(slot), slot) for slot in range(state.num_slots))
