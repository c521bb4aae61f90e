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
captured; a group published without its arena (direct backend, noncontiguous
destinations, a member carried by several groups) fuses nothing, and
:attr:`FusedConsumer.fused` tells the adapter to launch the consumer itself.
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
    #: set at bind: the publication group that runs it (None: not fused)
    group: str | None = None
    #: the members' header rows in that group's arena (the same in every slot)
    rows: tuple[int, ...] = field(default=())

    @property
    def fused(self) -> bool:
        """Whether the group's publication enqueues this consumer (known after bind)."""
        return self.group is not None

    def bound(self) -> Callable[[torch.Tensor], None]:
        """The arena's callback: ``fn(header, rows)``."""
        fn, rows = self.fn, self.rows

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
    fused only when every member is carried by one and the same packed group."""
    placed: dict[str, list[FusedConsumer]] = {}
    for c in consumers:
        homes = [[p for p in plans.values() if _row(p, b) >= 0] for b in c.members]
        if any(len(h) != 1 for h in homes) or len({h[0].name for h in homes}) != 1:
            continue  # a member carried by several groups (or by none): not fused
        plan = homes[0][0]
        if not plan.packed:
            continue
        c.rows = tuple(_row(plan, b) for b in c.members)
        c.group = plan.name
        placed.setdefault(plan.name, []).append(c)
    return placed


def _row(plan: GroupPlan, buffer: H2DBuffer) -> int:
    """``buffer``'s member index (its header row) in ``plan``, or -1."""
    for i, m in enumerate(plan.members):
        if m is buffer:
            return i
    return -1
