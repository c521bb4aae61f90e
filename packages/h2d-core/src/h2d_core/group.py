"""Publication groups: which buffers travel together, and how, decided once at bind time."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .buffer import CountUnit, H2DBuffer


@dataclass
class GroupCounters:
    """Per-group observability counters (cumulative since the state was created)."""

    publications: int = 0
    #: payload bytes published (sum of the members' counted bytes)
    bytes: int = 0
    #: packed DMAs issued (each followed by exactly one scatter)
    dmas: int = 0
    scatters: int = 0
    #: direct member copies issued (direct backend, single-member groups, covered groups)
    direct_copies: int = 0
    #: publications of a packed-eligible group that used direct copies instead
    direct_fallbacks: int = 0
    #: deliberate second publications (a reason was given)
    second_publications: int = 0


@dataclass(frozen=True)
class GroupPlan:
    """A bound publication group.

    ``members`` are in arena order (ascending capacity, so the DMA of a small publication
    covers little unused capacity). ``packed`` is decided once; ``why_direct`` says why a
    group is not packed. ``producer_groups`` are the declared groups it publishes.
    """

    name: str
    index: int
    members: tuple[H2DBuffer, ...]
    producer_groups: tuple[str, ...]
    packed: bool
    why_direct: str
    #: members whose sources live in another publication group's arena (staged here)
    borrowed: frozenset[str] = frozenset()

    @cached_property
    def names(self) -> frozenset[str]:
        """This group and the producer groups it publishes."""
        return frozenset((self.name, *self.producer_groups))


def unit_view(tensor: torch.Tensor, unit: CountUnit) -> torch.Tensor:
    """A view of ``tensor`` whose dim 0 indexes the buffer's count unit.

    Always a view of the same storage (never a copy): raises RuntimeError when the layout
    does not allow one, which the binding turns into a BindingError naming the buffer.
    """
    if unit is CountUnit.ROWS:
        return tensor
    flat = tensor.view(-1)
    if unit is CountUnit.ELEMENTS:
        return flat
    return flat.view(torch.uint8)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor's storage region covers."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * t.element_size()


def find_overlap(spans: list[tuple[int, int, str]]) -> tuple[str, str] | None:
    """The first pair of names whose byte spans overlap, if any."""
    ordered = sorted(s for s in spans if s[1] > s[0])
    reach, reach_name = -1, ""
    for start, end, name in ordered:
        if start < reach:
            return reach_name, name
        if end > reach:
            reach, reach_name = end, name
    return None
