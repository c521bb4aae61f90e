"""The specific refusals of the epoch's entry points (:class:`~h2d_core.epoch.EpochCore`).

The compiled entry points test their conditions inline; these build the errors, saying
which rule was broken and what to do. Only a refused call reaches them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from .errors import (
    DeviceMismatchError,
    EpochError,
    MembershipError,
    NotBoundError,
    OwnerInvalidatedError,
    OwnerThreadError,
    StreamMismatchError,
    UnknownGroupError,
)


def other_thread() -> OwnerThreadError:
    return OwnerThreadError(
        "this H2DRunnerState belongs to another thread; call it from the thread that "
        "created it")


def not_bound() -> NotBoundError:
    return NotBoundError("call bind() after declaring buffers and before using the state")


def invalidated(why: str) -> OwnerInvalidatedError:
    return OwnerInvalidatedError(
        f"the H2D owner was invalidated by an earlier enqueue failure ({why}); call reset() "
        "before further work")


def outside_epoch(what: str) -> EpochError:
    return EpochError(f"{what} outside an epoch: call begin() (or resume()) first")


def bad_slot(slot: object, num_slots: int) -> EpochError:
    if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
        return EpochError(f"slot must be an int in [0, {num_slots}) or None, got "
                          f"{type(slot).__name__} {slot!r}")
    return EpochError(f"slot {int(slot)} is not in [0, {num_slots})")


def wrong_device(device: torch.device) -> DeviceMismatchError:
    return DeviceMismatchError(
        f"current device is cuda:{torch.cuda.current_device()} but this state owns {device}; "
        f"switch with torch.cuda.device({device.index})")


def wrong_stream(raw: int, epoch_stream: int) -> StreamMismatchError:
    return StreamMismatchError(
        f"publication on stream {raw:#x} but the epoch's consumer stream is "
        f"{epoch_stream:#x}; publish on the stream current at begin()")


def unknown_group(group: str, known: Iterable[str]) -> UnknownGroupError:
    return UnknownGroupError(f"unknown group {group!r}; declared groups are {sorted(known)}")


def covered_alone(group: str, combined: dict[str, tuple[str, ...]], produced: set[str],
                  published: set[str], epoch: int) -> MembershipError | None:
    """Producer group ``group``, covered by a combined group, published alone while another
    producer group of that combined group was produced in this epoch and is not published:
    the step's producers wrote the combined group, so ``group`` alone would send part of
    the step and silently leave the rest behind (None: it may go alone)."""
    for name, groups in combined.items():
        others = sorted(g for g in groups
                        if g != group and g in produced and g not in published)
        if group in groups and others:
            return MembershipError(
                f"group {group!r} is covered by the combined group {name!r}, whose producer "
                f"groups {others} were produced in epoch {epoch} and are not published: "
                f"publishing {group!r} alone sends only its own members and leaves them "
                f"behind; publish {name!r} (one DMA of the whole step), or produce "
                f"{group!r} on its own to publish it alone")
    return None
