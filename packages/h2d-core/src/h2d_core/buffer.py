"""Declared metadata buffers: a pinned CPU source per slot and one fixed GPU destination."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .errors import CountError, DeclarationError, EpochError, NotBoundError


class SlotOwner(Protocol):
    """What a buffer needs of its owner: which slot's source is current."""

    current_slot: int

    def copy_member_direct(self, buffer: H2DBuffer, n: int | None) -> torch.Tensor: ...


class CountUnit(str, enum.Enum):
    """What ``set_count(buffer, n)`` counts: rows along dim 0, elements, or bytes."""

    ROWS = "rows"
    ELEMENTS = "elements"
    BYTES = "bytes"


# numpy cannot view these dtypes; their buffers have no ``.np``.
_NO_NUMPY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class BufferSpec:
    """Everything fixed at declaration: name, shape, dtype, producer group and count unit.

    The derived sizes are computed once here: the publication hot path reads them per call.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: str
    unit: CountUnit
    itemsize: int = field(init=False)
    nbytes: int = field(init=False)
    #: bytes per counted unit
    unit_bytes: int = field(init=False)
    #: the largest count, in the buffer's unit
    capacity: int = field(init=False)

    def __post_init__(self) -> None:
        itemsize = self.dtype.itemsize
        numel = math.prod(self.shape)
        if self.unit is CountUnit.ROWS:
            unit_bytes, capacity = math.prod(self.shape[1:]) * itemsize, self.shape[0]
        elif self.unit is CountUnit.ELEMENTS:
            unit_bytes, capacity = itemsize, numel
        else:
            unit_bytes, capacity = 1, numel * itemsize
        object.__setattr__(self, "itemsize", itemsize)
        object.__setattr__(self, "nbytes", numel * itemsize)
        object.__setattr__(self, "unit_bytes", unit_bytes)
        object.__setattr__(self, "capacity", capacity)

    @property
    def has_numpy_view(self) -> bool:
        return self.dtype not in _NO_NUMPY


def make_spec(
    name: str, shape: tuple[int, ...] | int, dtype: torch.dtype, group: str, unit: CountUnit | str
) -> BufferSpec:
    """Validate a declaration and freeze it."""
    if not name or not isinstance(name, str):
        raise DeclarationError(f"buffer name must be a non-empty str, got {name!r}")
    if not group or not isinstance(group, str):
        raise DeclarationError(f"buffer {name!r}: group must be a non-empty str, got {group!r}")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not dims or any((not isinstance(d, int)) or isinstance(d, bool) or d <= 0 for d in dims):
        raise DeclarationError(
            f"buffer {name!r}: shape must be positive ints, got {shape!r}"
        )
    try:
        count_unit = CountUnit(unit)
    except ValueError:
        valid = ", ".join(repr(u.value) for u in CountUnit)
        raise DeclarationError(
            f"buffer {name!r}: unknown count unit {unit!r}; use one of {valid}"
        ) from None
    if not isinstance(dtype, torch.dtype):
        raise DeclarationError(f"buffer {name!r}: dtype must be a torch.dtype, got {dtype!r}")
    return BufferSpec(name, dims, dtype, group, count_unit)


class H2DBuffer:
    """A ``CpuGpuBuffer``-shaped metadata buffer owned by an :class:`H2DRunnerState`.

    ``.cpu`` / ``.np`` are the *current slot's* pinned source (after ``bind()``), ``.gpu``
    the fixed destination. Producers write the source in place, then call
    ``state.set_count(buffer, n)``; the group publication moves the bytes. Keep no
    ``.cpu``/``.np`` reference across steps: each slot has its own source.
    """

    def __init__(
        self, spec: BufferSpec, gpu: torch.Tensor, state: SlotOwner, max_ranges: int = 0
    ) -> None:
        self.spec = spec
        #: how many byte ranges one publication may send (``set_ranges``); 0 = counts only
        self.max_ranges = max_ranges
        # hot-path copies of the spec's sizes; byte counts always take the full check
        self._unit_bytes = spec.unit_bytes
        self._fast_capacity = -1 if spec.unit is CountUnit.BYTES else spec.capacity
        self.gpu = gpu
        self._state = state
        self._sources: list[torch.Tensor] = []
        self._numpy: list[np.ndarray | None] = []
        # Filled by the state at bind time: where this member sits in each publication group
        # that carries it, as (group index, member index); the first is its primary group,
        # whose arena holds its source.
        self.homes: list[tuple[int, int]] = []
        # views whose dim 0 indexes the count unit (and raw bytes, for ranged buffers)
        self._dst_units: torch.Tensor = gpu
        self._src_units: list[torch.Tensor] = []
        self._dst_bytes: torch.Tensor = gpu
        self._src_bytes: list[torch.Tensor] = []
        self.publication_group = ""
        self.member_index = -1

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def group(self) -> str:
        return self.spec.group

    def _attach_sources(self, sources: list[torch.Tensor]) -> None:
        self._sources = sources
        self._numpy = [s.numpy() if self.spec.has_numpy_view else None for s in sources]

    def source(self, slot: int) -> torch.Tensor:
        """The pinned CPU source of ``slot``."""
        if not self._sources:
            raise NotBoundError(f"buffer {self.name!r}: call state.bind() before using sources")
        return self._sources[slot]

    @property
    def cpu(self) -> torch.Tensor:
        """The current slot's pinned CPU source."""
        return self.source(self._state.current_slot)

    @property
    def np(self) -> np.ndarray:
        """A numpy view of the current slot's source (not available for bf16/fp8)."""
        if not self._sources:
            raise NotBoundError(f"buffer {self.name!r}: call state.bind() before using sources")
        view = self._numpy[self._state.current_slot]
        if view is None:
            raise DeclarationError(
                f"buffer {self.name!r} has dtype {self.spec.dtype} which numpy cannot view; "
                "write through .cpu instead"
            )
        return view

    def check_count(self, count: object) -> int:
        """Return ``count`` as an int if it is a valid count for this buffer, else raise."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise CountError(
                f"buffer {self.name!r}: count must be an int in {self.spec.unit.value}, "
                f"got {type(count).__name__} {count!r}"
            )
        n = int(count)
        if n < 0 or n > self.spec.capacity:
            raise CountError(
                f"buffer {self.name!r}: count {n} {self.spec.unit.value} is outside "
                f"[0, {self.spec.capacity}] (capacity of shape {self.spec.shape})"
            )
        if self.spec.unit is CountUnit.BYTES and n % self.spec.itemsize:
            raise CountError(
                f"buffer {self.name!r}: byte count {n} is not a multiple of its element size "
                f"{self.spec.itemsize}; publish whole elements"
            )
        return n

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Checked direct copy of the first ``n`` units (all when None) for standalone callers.

        Returns the destination view. It counts as the publication of this buffer's group
        in the current epoch: owner thread, a valid owner, an open epoch (the source is only
        protected inside one), a valid count, and the group not yet published.
        """
        return self._state.copy_member_direct(self, n)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"H2DBuffer({s.name!r}, shape={s.shape}, dtype={s.dtype}, group={s.group!r}, "
            f"unit={s.unit.value!r})"
        )


class GuardedH2DBuffer(H2DBuffer):
    """An :class:`H2DBuffer` of a state with ``guard_sources=True`` (a debug mode): ``.cpu``
    and ``.np`` refuse outside an epoch and after the buffer's group was published in the
    open one (until a deliberate second publication, ``reopen(group, reason)``), and the
    state keeps every slot's numpy view read-only except the open epoch's unpublished
    groups', so a write before ``begin()``, after ``publish()`` or through a reference kept
    across steps raises instead of landing in a source a DMA may still be reading.
    A normal state's buffers are plain :class:`H2DBuffer` objects: the mode costs nothing
    when off."""

    def _check_epoch(self, what: str) -> None:
        st = self._state
        if not st.epoch_open:  # type: ignore[attr-defined]
            raise EpochError(
                f"buffer {self.name!r}: .{what} outside an epoch (guard_sources): the slot's "
                "source may still be read by its last DMA; write it between begin() and "
                "publish()")
        group = self.spec.group
        if st.is_published(group):  # type: ignore[attr-defined]
            raise EpochError(
                f"buffer {self.name!r}: .{what} after group {group!r} was published in epoch "
                f"{st.epoch} (guard_sources): its DMA may still be reading the "  # type: ignore[attr-defined]
                "source; write it between begin() and publish(), or reopen(group, reason) "
                "for a deliberate second publication (which acquires the sources first)")

    @property
    def cpu(self) -> torch.Tensor:
        self._check_epoch("cpu")
        return super().cpu

    @property
    def np(self) -> np.ndarray:
        self._check_epoch("np")
        return super().np

    def _attach_sources(self, sources: list[torch.Tensor]) -> None:
        super()._attach_sources(sources)
        # a view of torch's array: numpy lets its flag go back to writable (the array
        # torch hands out cannot be made writable again once read-only)
        self._numpy = [None if v is None else v.view() for v in self._numpy]

    def _set_writeable(self, slot: int, writeable: bool) -> None:
        view = self._numpy[slot] if self._numpy else None
        if view is not None:
            view.flags.writeable = writeable
