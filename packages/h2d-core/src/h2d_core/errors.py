"""Exceptions raised by h2d-core. Every message names the buffer/group and the rule broken."""

from __future__ import annotations

from typing import Any

import numpy as np


def describe_value(value: Any) -> str:
    """What a caller passed, as a refusal names it: ``"an int64 array of shape (2,)"`` for
    a numpy array, else its type's name (``"list"``, ``"Tensor"``)."""
    if not isinstance(value, np.ndarray):
        return type(value).__name__
    kind = value.dtype.name
    article = "an" if kind.startswith(("int", "object")) else "a"  # "a uint8", "an int64"
    return f"{article} {kind} array of shape {value.shape}"


class H2DError(RuntimeError):
    """Base class of every h2d-core error."""


class DeclarationError(H2DError):
    """A buffer or group declaration is invalid (duplicate name, bad unit, overlap...)."""


class TablePolicyError(DeclarationError, ValueError):
    """A block-table publication knob (``publication``, ``partial_max_ranges``,
    ``partial_max_share``) has the wrong type or is out of its range."""


class BindingError(H2DError):
    """Storage cannot be bound: overlapping CPU/GPU bytes, bad destination, wrong device."""


class NotBoundError(H2DError):
    """The state was used before ``bind()`` fixed its storage."""


class CountError(H2DError, ValueError):
    """A count is not an int, is negative, or exceeds the buffer's capacity."""


class UnknownGroupError(H2DError, KeyError):
    """A group name that no buffer declared."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class MembershipError(H2DError):
    """A buffer was used with a group it does not belong to."""


class DeviceUnavailableError(DeclarationError):
    """A CUDA state asked of a torch build (or machine) without CUDA."""


class EpochError(H2DError):
    """begin/finish/resume out of order, or work outside an open epoch."""


class OwnerThreadError(H2DError):
    """A call from a thread other than the one that owns the runner state."""


class DeviceMismatchError(H2DError):
    """The current device is not the runner state's device."""


class ProducerOwnerError(H2DError, TypeError):
    """An ``@h2d_producer`` was called without its owner (the runner state or an adapter
    holding it as ``.h2d_state``) as the first argument."""


class DeviceContextError(H2DError):
    """A default-device mode (``DeviceContext``) is active where the runner needs the
    implicit CPU default."""


class StreamMismatchError(H2DError):
    """Publication on a stream other than the epoch's consumer stream."""


class DuplicatePublicationError(H2DError):
    """A group was published (or produced) twice in one epoch without a reason."""


class ReentryError(DuplicatePublicationError):
    """A producer was entered again in the same epoch without a reason."""


class OwnerInvalidatedError(H2DError):
    """An earlier enqueue failed; the owner refuses work until ``reset()``."""


class PublicationEnqueueError(H2DError):
    """Enqueueing a copy or the scatter failed; the owner is now invalidated until reset()."""


class BackendError(H2DError, ValueError):
    """An unknown ``ATOM_H2D_BACKEND`` value or backend argument."""


class RequestLayoutError(H2DError, ValueError):
    """A batch's query or context lengths break a :class:`~h2d_core.RequestLayout` rule
    (lengths, padding, capacity, a context shorter than its query, a column's bound), or a
    bound array is unusable."""
