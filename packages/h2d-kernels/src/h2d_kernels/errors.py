"""Exceptions raised by h2d_kernels.

Every message names the member (or descriptor) at fault, the rule it broke and
what to do about it. A rejected input changes nothing: checks run before any
allocation or write.
"""

from __future__ import annotations

from block_tables.native import NativeBuildError


class H2DKernelsError(Exception):
    """Base class of every error raised by h2d_kernels."""


class ArenaLayoutError(H2DKernelsError, ValueError):
    """The members cannot be planned into an arena (bad name, size or itemsize)."""


class DestinationError(H2DKernelsError, ValueError):
    """A destination tensor cannot be bound to its member."""


class DestinationCountError(DestinationError):
    """The number of destinations differs from the number of members."""


class DestinationLayoutError(DestinationError):
    """A destination is not one contiguous tensor."""


class DestinationDeviceError(DestinationError):
    """Destinations are not all on the arena's device."""


class DestinationBoundsError(DestinationError):
    """A member's capacity (or a range) runs past its destination's end."""


class DestinationAlignmentError(DestinationError):
    """A destination's address is not a multiple of its member's itemsize."""


class DestinationOverlapError(DestinationError):
    """Two destinations share bytes."""


class DescriptorError(H2DKernelsError, ValueError):
    """A range descriptor in the header is malformed or out of bounds."""


class PublishError(H2DKernelsError, ValueError):
    """A publication request is out of range (e.g. ``dma_bytes``)."""


class PackBoundsError(PublishError):
    """A count or range would be packed past its arena region: the staging region (which
    ends where the first tail member's pinned source begins, or at the arena's end) or the
    header's range rows. Callers validate first; this is the compiled packing's own end
    check, made before any byte is written."""


class ScatterBackendError(H2DKernelsError, RuntimeError):
    """The requested scatter or launch path is unavailable for this device or process."""


#: the workspace's one error for a compiled core that is not built (every package loads
#: its extensions through :func:`block_tables.native.require_extension`); the name
#: h2d_kernels exported before
NativeRequiredError = NativeBuildError
