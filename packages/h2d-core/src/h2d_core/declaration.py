"""Declaration: what a runner state holds before ``bind()``, each piece checked as it comes.

A :class:`Declaration` collects the buffers (each in its producer group, its GPU destination
allocated or checked now), the combined groups and the fused first consumers. The state
(:class:`~h2d_core.state.H2DRunnerState`) owns one, refuses any declaration after
``bind()`` or from another thread, and hands :meth:`Declaration.frozen` to binding
(:func:`~h2d_core.binding.bind_groups`). Nothing here runs per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .binding import Declared
from .buffer import BufferSpec, GuardedH2DBuffer, H2DBuffer
from .config import Backend
from .errors import BindingError, DeclarationError, UnknownGroupError
from .fused import ConsumerFn, FusedConsumer
from .fused import declare as declare_consumer


class Declaration:
    """The declared buffers, producer groups, combined groups and fused consumers of one
    state on ``device``; ``guarded``: its buffers are the debug mode's
    :class:`~h2d_core.buffer.GuardedH2DBuffer`."""

    def __init__(self, state: Any, device: torch.device, guarded: bool) -> None:
        self._state = state
        self._device = device
        self._kind = GuardedH2DBuffer if guarded else H2DBuffer
        #: name -> buffer, in declaration order
        self.buffers: dict[str, H2DBuffer] = {}
        #: producer group -> its buffers, in declaration order
        self.producer_groups: dict[str, list[H2DBuffer]] = {}
        #: combined group -> the producer groups it publishes
        self.combined: dict[str, tuple[str, ...]] = {}
        self.fused: list[FusedConsumer] = []

    def add_buffer(self, spec: BufferSpec, gpu: torch.Tensor | None,
                   max_ranges: int) -> H2DBuffer:
        """Declare ``spec``'s buffer: its destination ``gpu`` checked (same shape, dtype and
        device; contiguous when ranged), or allocated zeroed."""
        name, group = spec.name, spec.group
        if name in self.buffers:
            raise DeclarationError(f"buffer {name!r} is already declared")
        if group in self.combined:
            raise DeclarationError(
                f"buffer {name!r}: {group!r} is a combined group; declare buffers with their "
                "producer group"
            )
        if gpu is None:
            gpu = torch.zeros(spec.shape, dtype=spec.dtype, device=self._device)
        else:
            self._check_destination(spec, gpu)
            if max_ranges and not gpu.is_contiguous():
                raise BindingError(
                    f"buffer {name!r}: ranged publication (max_ranges={max_ranges}) needs a "
                    "contiguous destination"
                )
        buf = self._kind(spec, gpu, self._state, max_ranges)
        self.buffers[name] = buf
        self.producer_groups.setdefault(group, []).append(buf)
        return buf

    def _check_destination(self, spec: BufferSpec, gpu: torch.Tensor) -> None:
        if tuple(gpu.shape) != spec.shape or gpu.dtype != spec.dtype:
            raise BindingError(
                f"buffer {spec.name!r}: destination has shape {tuple(gpu.shape)} dtype "
                f"{gpu.dtype}, declared {spec.shape} {spec.dtype}"
            )
        if gpu.device != self._device:
            raise BindingError(
                f"buffer {spec.name!r}: destination is on {gpu.device}, the state on "
                f"{self._device}"
            )

    def add_combined(self, name: str, groups: Sequence[str]) -> None:
        """Declare combined group ``name`` over the producer groups ``groups`` (at least
        two, each with a declared buffer, none twice)."""
        if name in self.combined or name in self.producer_groups:
            raise DeclarationError(f"group name {name!r} is already used")
        if len(groups) < 2:
            raise DeclarationError(f"combined group {name!r} needs at least two producer groups")
        for g in groups:
            if g not in self.producer_groups:
                raise UnknownGroupError(
                    f"combined group {name!r}: producer group {g!r} has no declared buffer"
                )
        if len(set(groups)) != len(groups):
            raise DeclarationError(f"combined group {name!r} lists a producer group twice")
        self.combined[name] = tuple(groups)

    def add_consumer(self, name: str, members: Sequence[H2DBuffer],
                     fn: ConsumerFn) -> FusedConsumer:
        """Declare fused first consumer ``name`` of ``members`` (see :mod:`h2d_core.fused`)."""
        consumer = declare_consumer(name, members, fn, self.buffers)
        self.fused.append(consumer)
        return consumer

    def frozen(self, backend: Backend, num_slots: int, scatter: str) -> Declared:
        """What binding reads: the declarations, and how the state binds them."""
        return Declared(self.buffers, self.producer_groups, self.combined, self.fused,
                        backend, num_slots, self._device, scatter,
                        self._device.type == "cuda")
