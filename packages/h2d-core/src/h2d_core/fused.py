"""First consumers fused into a group's publication: one launch for DMA, scatter and consumers.

A publication's first consumers (KV-index generation, token assembly, step indptrs) read
what the scatter just wrote. Launched by the caller after ``publish``, each costs its own
kernel launch on the host every step (Triton's Python launcher: several µs). Fused, a
consumer is enqueued by the publication itself, right after the scatter on the same
stream: under ``launch="graph"`` it is captured into every bucket's graph at bind, so one
graph launch does the DMA, the scatter and the consumers, and a step pays for none of
their launches.

A fused consumer's kernel must read the step's counts on the device, from the arena
header the DMA carried (row ``rows[k]`` of member ``members[k]``, column 1: the bytes that
member published this step; 0 when it was omitted): the graph was captured once, with no
count as a launch argument. It runs on every publication path of that group, eager and
captured. Members carried by several combined groups (token inputs shared by a decode and
a prefill step) fuse the consumer into each of them, at that group's header rows: every
publication that can change the members runs it. When a carrier cannot run it (direct
backend, noncontiguous destinations, a group carrying only some of the members), the
consumer is fused nowhere, and :attr:`FusedConsumer.fused` tells the adapter to launch it
itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import DeclarationError

if TYPE_CHECKING:
    from .buffer import H2DBuffer
    from .group import GroupPlan

#: ``consumer(header, rows)``: the device arena's int64 ``[rows, 4]`` header and the header
#: rows of the consumer's members, in declaration order
ConsumerFn = Callable[[torch.Tensor, tuple[int, ...]], None]


@dataclass
class FusedConsumer:
    """A first consumer declared with :meth:`H2DRunnerState.fuse_consumer
    <h2d_core.H2DRunnerState.fuse_consumer>`; after ``bind()``, :attr:`fused` says whether
    the publication runs it (else the caller launches it after ``publish``)."""

    name: str
    members: tuple[H2DBuffer, ...]
    fn: ConsumerFn
    #: set at bind: per publication group that runs it, the members' header rows in that
    #: group's arena (the same in every slot); empty: not fused
    rows_by_group: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def fused(self) -> bool:
        """Whether the publications of the members enqueue this consumer (after bind)."""
        return bool(self.rows_by_group)

    @property
    def groups(self) -> tuple[str, ...]:
        """The publication groups that run it (empty: not fused)."""
        return tuple(self.rows_by_group)

    @property
    def group(self) -> str | None:
        """The one publication group that runs it; None when not fused (or when several
        do: see :attr:`groups`)."""
        return self.groups[0] if len(self.rows_by_group) == 1 else None

    def bound(self, group: str) -> Callable[[torch.Tensor], None]:
        """``consumer(header)``: the form ``group``'s packed arena enqueues after its
        scatter (the arena's callback: ``fn(header, rows)``, that group's rows)."""
        fn, rows = self.fn, self.rows_by_group[group]

        def consume(header: torch.Tensor) -> None:
            fn(header, rows)

        consume.__qualname__ = f"fused consumer {self.name!r}"
        return consume


def declare(name: str, members: Sequence[H2DBuffer], fn: ConsumerFn,
            known: dict[str, H2DBuffer]) -> FusedConsumer:
    """A new :class:`FusedConsumer` over declared ``members`` (checked)."""
    if not isinstance(name, str) or not name:
        raise DeclarationError(f"fused consumer: name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise DeclarationError(f"fused consumer {name!r}: fn must be callable, got {fn!r}")
    members = tuple(members)
    if not members:
        raise DeclarationError(f"fused consumer {name!r}: name at least one member buffer "
                               "whose header row it reads")
    for b in members:
        if known.get(getattr(b, "name", None)) is not b:  # type: ignore[arg-type]
            raise DeclarationError(
                f"fused consumer {name!r}: {b!r} is not a buffer declared on this state")
    return FusedConsumer(name, members, fn)


def place(consumers: Sequence[FusedConsumer],
          plans: dict[str, GroupPlan]) -> dict[str, list[FusedConsumer]]:
    """At bind: publication group -> the consumers its packed arenas run. A consumer is
    fused when every group carrying any of its members carries all of them and is packed:
    each such group runs it at its own header rows."""
    placed: dict[str, list[FusedConsumer]] = {}
    for c in consumers:
        carriers = [p for p in plans.values() if any(_row(p, b) >= 0 for b in c.members)]
        if not carriers or not all(p.packed and all(_row(p, b) >= 0 for b in c.members)
                                   for p in carriers):
            continue  # a carrier that cannot run it: fused nowhere, the caller launches
        for plan in carriers:
            c.rows_by_group[plan.name] = tuple(_row(plan, b) for b in c.members)
            placed.setdefault(plan.name, []).append(c)
    return placed


def _row(plan: GroupPlan, buffer: H2DBuffer) -> int:
    """``buffer``'s member index (its header row) in ``plan``, or -1."""
    for i, m in enumerate(plan.members):
        if m is buffer:
            return i
    return -1
