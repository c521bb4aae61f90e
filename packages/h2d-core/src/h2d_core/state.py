"""The runner's publication owner: declarations, binding, slots, epochs, counts, publication.

One :class:`H2DRunnerState` per model runner (per device). Its life:

    state = H2DRunnerState("cuda", num_slots=1)          # reads ATOM_H2D_BACKEND once
    ids = state.buffer("input_ids", (N,), torch.int32, group="token_inputs")
    ...
    state.combine("decode", ["token_inputs", "mha_decode"])   # optional combined group
    state.bind()                                          # storage fixed from here on

    slot = state.begin()          # waits until this slot's previous DMA read its sources
    ids.np[:n] = ...; state.set_count(ids, n)             # producers write in place
    state.publish("decode")       # validate, then 1 DMA + 1 scatter (or direct copies)
    state.finish()                # records completion; never waits for the GPU

Every rejected call raises before anything is enqueued or changed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .binding import Declared, bind_groups
from .buffer import BufferSpec, CountUnit, GuardedH2DBuffer, H2DBuffer, make_spec
from .completions import SlotCompletions
from .config import Backend, resolve_backend
from .epoch_groups import EpochGroups
from .errors import BindingError, DeclarationError, DeviceUnavailableError, UnknownGroupError
from .fused import ConsumerFn, FusedConsumer
from .fused import declare as declare_consumer
from .group import GroupPlan
from .publish import Publication
from .records import GroupCounters
from .slot import SlotLifecycle
from .source_guard import SourceGuard


class H2DRunnerState(SlotLifecycle, Publication):
    """Owner of a runner's metadata buffers, publication groups and slots.

    Args:
        device: where destinations live (``"cuda"``, ``"cuda:1"`` or ``"cpu"``). CPU mode
            keeps the whole contract with plain tensors (no pinning, no streams/events).
        num_slots: runner slots; each owns its pinned sources, packed arenas and
            completion event. Pipeline parallelism rotates them.
        backend: ``"packed"`` or ``"direct"``; None reads ``ATOM_H2D_BACKEND`` now, once.
        scatter: how packed arenas scatter (passed to ``h2d_kernels.PackedArena``).
        guard_sources: a debug mode (None reads ``H2D_GUARD_SOURCES=1``): ``.cpu`` / ``.np``
            refuse outside an epoch and every slot's numpy views are read-only except the
            open epoch's, so a write before ``begin()`` or through a reference kept across
            steps raises (:class:`~h2d_core.buffer.GuardedH2DBuffer`). Off, it costs nothing.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        num_slots: int = 1,
        backend: Backend | str | None = None,
        scatter: str = "auto",
        guard_sources: bool | None = None,
    ) -> None:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
        if dev.type == "cuda" and not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   and torch.version.hip is None else "no CUDA device is visible")
            raise DeviceUnavailableError(
                f"H2DRunnerState({str(device)!r}): {why} (torch {torch.__version__}); "
                "install a CUDA build of torch on a machine with a GPU, or pass "
                "device='cpu' (the whole contract with plain tensors)")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cuda", "cpu"):
            raise DeclarationError(f"device {dev} is not supported; use a CUDA device or cpu")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise DeclarationError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.device = dev
        self.backend = resolve_backend(backend)
        self.num_slots = num_slots
        self._cuda = dev.type == "cuda"
        self._device_index = dev.index if dev.index is not None else -1
        self._scatter = scatter
        if guard_sources is None:
            guard_sources = os.environ.get("H2D_GUARD_SOURCES", "") == "1"
        if not isinstance(guard_sources, bool):
            raise DeclarationError(f"guard_sources must be a bool or None, got {guard_sources!r}")
        self.owner_thread = threading.get_ident()
        self._buffers: dict[str, H2DBuffer] = {}
        self._producer_groups: dict[str, list[H2DBuffer]] = {}
        self._guard = (SourceGuard(self._buffers, self._producer_groups) if guard_sources
                       else None)
        self._combined: dict[str, tuple[str, ...]] = {}
        self._bound = False
        self._plans: dict[str, GroupPlan] = {}
        self._routes = {}
        self._slot_groups = []
        self._counters: dict[str, GroupCounters] = {}
        self.completions = SlotCompletions(num_slots)
        self.groups = EpochGroups(self._producer_groups, self._counters)

        self.current_slot = 0
        self.epoch = 0
        self._epoch_open = False
        self._resumable = False
        self._stream: Any = None
        self._stream_id = 0
        self._invalid: str | None = None
        #: host ns the last begin() blocked on its slot's previous DMA (source reuse); 0 when
        #: that DMA had completed (checking it is then ordinary host work)
        self.last_source_wait_ns = 0
        #: called by reset(): attached state that must forget what the GPU holds
        self._reset_hooks: list[Callable[[], None]] = []
        self._fused: list[FusedConsumer] = []

    # ------------------------------------------------------------------ declaration
    def buffer(
        self,
        name: str,
        shape: tuple[int, ...] | int,
        dtype: torch.dtype,
        *,
        group: str,
        unit: CountUnit | str = CountUnit.ELEMENTS,
        gpu: torch.Tensor | None = None,
        max_ranges: int = 0,
    ) -> H2DBuffer:
        """Declare a buffer of producer ``group`` counted in ``unit``.

        The destination is allocated now (zeroed) unless ``gpu`` supplies an existing one
        (same shape/dtype, on this state's device; a noncontiguous one makes its group
        publish with direct copies). Sources are allocated by :meth:`bind`.
        ``max_ranges`` > 0 lets one publication send up to that many byte ranges of this
        buffer (:meth:`set_ranges`; block tables publish their changed rows this way).
        """
        self.require_owner()
        if self._bound:
            raise DeclarationError(
                f"buffer {name!r}: the state is already bound; declare every buffer before bind()"
            )
        spec = make_spec(name, shape, dtype, group, unit)
        if isinstance(max_ranges, bool) or not isinstance(max_ranges, int) or max_ranges < 0:
            raise DeclarationError(f"buffer {name!r}: max_ranges must be an int >= 0")
        if name in self._buffers:
            raise DeclarationError(f"buffer {name!r} is already declared")
        if group in self._combined:
            raise DeclarationError(
                f"buffer {name!r}: {group!r} is a combined group; declare buffers with their "
                "producer group"
            )
        if gpu is None:
            gpu = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
        else:
            self._check_destination(spec, gpu)
            if max_ranges and not gpu.is_contiguous():
                raise BindingError(
                    f"buffer {name!r}: ranged publication (max_ranges={max_ranges}) needs a "
                    "contiguous destination"
                )
        kind = GuardedH2DBuffer if self._guard is not None else H2DBuffer
        buf = kind(spec, gpu, self, max_ranges)
        self._buffers[name] = buf
        self._producer_groups.setdefault(group, []).append(buf)
        return buf

    def _check_destination(self, spec: BufferSpec, gpu: torch.Tensor) -> None:
        if tuple(gpu.shape) != spec.shape or gpu.dtype != spec.dtype:
            raise BindingError(
                f"buffer {spec.name!r}: destination has shape {tuple(gpu.shape)} dtype "
                f"{gpu.dtype}, declared {spec.shape} {spec.dtype}"
            )
        if gpu.device != self.device:
            raise BindingError(
                f"buffer {spec.name!r}: destination is on {gpu.device}, the state on {self.device}"
            )

    def combine(self, name: str, groups: Sequence[str]) -> None:
        """Declare a combined group publishing several producer groups with one DMA.

        The covered producer groups get no packed arena of their own; publishing one of them
        alone (a standalone caller) uses checked direct copies. A producer group may be
        covered by several combined groups (e.g. token inputs in both a ``decode`` and a
        ``prefill`` group): its sources live in the first such group's arena and the others
        copy its used bytes into their staging region when they publish.
        """
        self.require_owner()
        if self._bound:
            raise DeclarationError(f"combined group {name!r}: declare it before bind()")
        if name in self._combined or name in self._producer_groups:
            raise DeclarationError(f"group name {name!r} is already used")
        if len(groups) < 2:
            raise DeclarationError(f"combined group {name!r} needs at least two producer groups")
        for g in groups:
            if g not in self._producer_groups:
                raise UnknownGroupError(
                    f"combined group {name!r}: producer group {g!r} has no declared buffer"
                )
        if len(set(groups)) != len(groups):
            raise DeclarationError(f"combined group {name!r} lists a producer group twice")
        self._combined[name] = tuple(groups)

    def fuse_consumer(self, name: str, members: Sequence[H2DBuffer],
                      fn: ConsumerFn) -> FusedConsumer:
        """Declare a first consumer the publication of ``members``' group enqueues itself,
        right after its scatter (inside its CUDA graphs): ``fn(header, rows)`` with the
        device arena's header and the members' header rows (see :mod:`h2d_core.fused`).
        After ``bind()``, the returned handle's ``fused`` says whether it was fused (the
        members travel in one packed group); if not, the caller launches the consumer."""
        self.require_owner()
        if self._bound:
            raise DeclarationError(f"fused consumer {name!r}: declare it before bind()")
        consumer = declare_consumer(name, members, fn, self._buffers)
        self._fused.append(consumer)
        return consumer

    # ------------------------------------------------------------------ binding
    def bind(self) -> None:
        """Fix all storage: plan groups, allocate per-slot sources/arenas, check overlaps
        (:func:`~h2d_core.binding.bind_groups`)."""
        self.require_owner()
        if self._bound:
            raise DeclarationError("bind() was already called; bound storage stays fixed")
        bound = bind_groups(Declared(
            self._buffers, self._producer_groups, self._combined, self._fused, self.backend,
            self.num_slots, self.device, self._scatter, self._cuda))
        self._plans = bound.plans
        self._routes = bound.routes
        self._slot_groups = bound.slot_groups
        self._counters.update(bound.counters)  # the epoch's groups hold this dict
        self.groups.bound(bound.all_names)
        if self._guard is not None:  # no epoch open yet: every slot read-only
            self._guard.close_all(self.num_slots)
        if self._cuda:
            events = bound.slot_events
            self.completions.attach(events, [] if events is not None else [
                torch.cuda.Event() for _ in range(self.num_slots)])
            self._acquire_event = torch.cuda.Event()
        self._bound = True

    def buffers(self) -> Mapping[str, H2DBuffer]:
        return dict(self._buffers)

    def plan(self, group: str) -> GroupPlan:
        """The bound plan of a publication group (a combined or uncovered producer group)."""
        self.require_bound()
        if group not in self._plans:
            raise self.unknown_group(group)
        return self._plans[group]

    def counters(self, group: str) -> GroupCounters:
        """Counters of a publication or producer group: the live object, which keeps
        counting (``counters(g).snapshot()`` copies it, for a before/after difference)."""
        self.require_bound()
        if group not in self._counters:
            raise self.unknown_group(group)
        return self._counters[group]

