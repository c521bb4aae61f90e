"""Publication groups: which buffers travel together, and how, decided once at bind time."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from .buffer import CountUnit, H2DBuffer


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


def _element_intervals(t: torch.Tensor) -> np.ndarray:
    """Sorted [start, end) byte intervals of every element of ``t``."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
    starts = np.sort(t.data_ptr() + offsets * t.element_size())
    return np.stack((starts, starts + t.element_size()), axis=1)


def tensors_share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any element of ``a`` overlaps any element of ``b`` (not just their spans:
    interleaved column views of one tensor share none)."""
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    if a1 <= b0 or b1 <= a0 or a.numel() == 0 or b.numel() == 0:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    ia, ib = _element_intervals(a), _element_intervals(b)
    # each interval of b against the a-interval starting at or before it, and the next one
    k = np.searchsorted(ia[:, 0], ib[:, 0], side="right") - 1
    before = k >= 0
    if (ia[k[before], 1] > ib[before, 0]).any():
        return True
    nxt = k + 1
    after = nxt < len(ia)
    return bool((ia[nxt[after], 0] < ib[after, 1]).any())


def find_shared_bytes(tensors: list[tuple[torch.Tensor, str]]) -> tuple[str, str] | None:
    """The first pair of named tensors that share an element's bytes, if any."""
    ordered = sorted(((*byte_span(t), name, t) for t, name in tensors if t.numel()),
                     key=lambda x: (x[0], x[1]))
    for i, (_s0, e0, n0, t0) in enumerate(ordered):
        for s1, _e1, n1, t1 in ordered[i + 1:]:
            if s1 >= e0:
                break
            if tensors_share_bytes(t0, t1):
                return n0, n1
    return None
