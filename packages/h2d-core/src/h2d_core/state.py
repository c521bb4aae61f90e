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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .binding import bind_groups
from .buffer import CountUnit, H2DBuffer, make_spec
from .completions import SlotCompletions
from .config import Backend, resolve_backend
from .count_batch import CountBatch
from .declaration import Declaration
from .direct_copies import copy_alone
from .epoch import EpochCore
from .epoch_groups import EpochGroups
from .errors import (
    DeclarationError,
    DeviceUnavailableError,
    EpochError,
    MembershipError,
    UnknownGroupError,
)
from .fused import ConsumerFn, FusedConsumer
from .group import GroupPlan
from .member_counts import MemberCounts, OnPublish
from .records import GroupCounters, GroupRecord
from .source_guard import SourceGuard


class H2DRunnerState(EpochCore):
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

    device: torch.device
    backend: Backend
    num_slots: int
    current_slot: int
    epoch: int
    last_source_wait_ns: int
    owner_thread: int
    completions: SlotCompletions
    groups: EpochGroups
    _cuda: bool
    _device_index: int
    _bound: bool
    _invalid: str | None
    _guard: SourceGuard | None
    _buffers: dict[str, H2DBuffer]
    _producer_groups: dict[str, list[H2DBuffer]]
    _combined: dict[str, tuple[str, ...]]
    _plans: dict[str, GroupPlan]
    #: publish(name) -> (record index, names it publishes, members copied directly when it
    #: is a producer group covered by a combined one, counters)
    _routes: dict[str, tuple[int, frozenset[str], tuple[H2DBuffer, ...], GroupCounters,
                             tuple[str, ...]]]
    #: per slot, one record per publication group (``GroupPlan.index``)
    _slot_groups: list[list[GroupRecord]]
    _counters: dict[str, GroupCounters]
    _acquire_event: Any
    _epoch_open: bool
    _resumable: bool
    _stream: Any
    _stream_id: int
    _reset_hooks: list[Callable[[], None]]

    if TYPE_CHECKING:  # compiled in EpochCore (epoch.py)
        def require_ready(self, what: str) -> None: ...
        def require_owner(self) -> None: ...
        def require_bound(self) -> None: ...
        def require_valid(self) -> None: ...
        def require_device(self) -> None: ...
        def require_stream(self, stream: Any) -> None: ...
        def unknown_group(self, group: str) -> UnknownGroupError: ...

    # the counting calls: bound methods of the state's MemberCounts (member_counts.py)
    count: Callable[[H2DBuffer], int | None]
    set_count: Callable[[H2DBuffer, int | None], None]
    set_counts: Callable[
        [Mapping[H2DBuffer, int | None] | Iterable[tuple[H2DBuffer, int | None]]], None]
    count_batch: Callable[[Sequence[H2DBuffer]], CountBatch]
    set_ranges: Callable[[H2DBuffer, Sequence[tuple[int, int]]], None]
    try_trusted_ranges: Callable[[H2DBuffer, list[tuple[int, int]], int], bool]
    range_room: Callable[[H2DBuffer], int]
    on_publish: OnPublish

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
        # what is declared before bind (buffers, combined groups, fused consumers); its
        # calls go through the state's, which refuse them after bind or off the owner thread
        self._declaration = declared = Declaration(self, dev, guard_sources)
        # the same live dicts: the epoch's refusals, membership and the guard read them
        self._buffers = declared.buffers
        self._producer_groups = declared.producer_groups
        self._combined = declared.combined
        self._guard = (SourceGuard(self._buffers, self._producer_groups) if guard_sources
                       else None)
        self._bound = False
        self._plans: dict[str, GroupPlan] = {}
        self._routes = {}
        self._slot_groups = []
        self._counters: dict[str, GroupCounters] = {}
        self.completions = SlotCompletions(num_slots)
        self.groups = EpochGroups(self._producer_groups, self._counters)
        # the epoch's counts and ranges; the state's counting calls are its bound methods
        # (taken once: a call adds no frame)
        self._member_counts = counts = MemberCounts(self, declared.buffers)
        self.count = counts.count
        self.set_count = counts.set_count
        self.set_counts = counts.set_counts
        self.count_batch = counts.count_batch
        self.set_ranges = counts.set_ranges
        self.try_trusted_ranges = counts.try_trusted_ranges
        self.range_room = counts.range_room
        self.on_publish = counts.on_publish

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
        return self._declaration.add_buffer(spec, gpu, max_ranges)

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
        self._declaration.add_combined(name, groups)

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
        return self._declaration.add_consumer(name, members, fn)

    # ------------------------------------------------------------------ binding
    def bind(self) -> None:
        """Fix all storage: plan groups, allocate per-slot sources/arenas, check overlaps
        (:func:`~h2d_core.binding.bind_groups`)."""
        self.require_owner()
        if self._bound:
            raise DeclarationError("bind() was already called; bound storage stays fixed")
        bound = bind_groups(self._declaration.frozen(self.backend, self.num_slots,
                                                    self._scatter))
        self._plans = bound.plans
        self._routes = bound.routes
        self._slot_groups = bound.slot_groups
        self._member_counts.bound(bound.slot_groups)
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

    def copy_member_direct(self, buffer: H2DBuffer, n: int | None) -> torch.Tensor:
        """``buffer.copy_to_gpu(n)``: :func:`~h2d_core.direct_copies.copy_alone`."""
        return copy_alone(self, buffer, n)

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

    def invalidate(self, why: str) -> None:
        """Refuse all work until ``reset()``: an enqueue failed (``why`` says which), so
        destinations may be half written."""
        self._invalid = why

    def require_member(self, buffer: H2DBuffer) -> None:
        """Refuse a buffer that is not one of this state's, or any before ``bind()``."""
        if not isinstance(buffer, H2DBuffer) or self._buffers.get(buffer.name) is not buffer:
            raise MembershipError(f"{buffer!r} is not a buffer of this state")
        self.require_bound()

    # ------------------------------------------------------------------ epochs
    def resume(self) -> int:
        """Reopen the epoch just finished (late two-batch-overlap preparation).

        Groups published earlier in the epoch stay published; ``finish()`` records the
        completion again after the late uploads.
        """
        self.require_owner()
        self.require_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} is open; resume() follows finish()")
        if not self._resumable:
            raise EpochError("nothing to resume: resume() must follow finish() of this epoch")
        self.require_device()
        if self._guard is not None:  # writable again, but for the groups already published
            self._guard.open_slot(self.current_slot)
            self._guard.seal(self.current_slot, self.groups.published)
        self._epoch_open = True
        self._resumable = False
        # finish() records again unless a graph launch does
        self.completions.graph_recorded = False
        return self.current_slot

    # ------------------------------------------------------------------ recovery
    def on_reset(self, hook: Callable[[], None]) -> None:
        """Bind time: ``hook()`` runs on each :meth:`reset`, for attached state that must
        forget what the GPU holds (a failed enqueue may have left destinations half
        written)."""
        self._reset_hooks.append(hook)

    def reset(self) -> None:
        """Recover an invalidated owner: wait for all enqueued work, then accept work again.

        Storage is never freed or rebound; it is reused only after the device drained.
        """
        self.require_owner()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._invalid = None
        self._epoch_open = False
        self._resumable = False
        self.groups.clear()
        self.completions.forget()
        if self._guard is not None:
            self._guard.close_all(self.num_slots)
        # A failed enqueue may have left destinations half written: whatever tracked their
        # contents must forget it, so the next publication sends them whole.
        for hook in self._reset_hooks:
            hook()
