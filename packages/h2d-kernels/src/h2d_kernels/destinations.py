"""Binding an arena's destinations: each member's device tensor checked once, at bind.

Every rule names the member it refuses: one contiguous tensor per member, all on the
arena's device, large enough for the member's capacity, aligned to its dtype, and no two
sharing a byte. What passes is a fixed ``(address, nbytes)`` table the scatter writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from h2d_kernels.errors import (
    DestinationAlignmentError,
    DestinationBoundsError,
    DestinationCountError,
    DestinationDeviceError,
    DestinationLayoutError,
    DestinationOverlapError,
)
from h2d_kernels.layout import ArenaLayout


def resolve_device(
    destinations: Sequence[torch.Tensor], device: torch.device | str | None
) -> torch.device:
    """The arena's device: ``device``, or the first destination's (CUDA with its
    index); refused unless CUDA or the CPU."""
    if device is None:
        if not destinations or not isinstance(destinations[0], torch.Tensor):
            raise DestinationDeviceError(
                "cannot infer the arena's device: pass device= or tensor destinations"
            )
        resolved = destinations[0].device
    else:
        resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.type not in ("cuda", "cpu"):
        raise DestinationDeviceError(
            f"device {resolved} is not supported: publish to a CUDA device or the CPU"
        )
    return resolved


def bind_destinations(
    layout: ArenaLayout, destinations: Sequence[torch.Tensor], device: torch.device
) -> list[tuple[int, int]]:
    """Check each destination against its member; return ``(address, nbytes)`` per member.

    Rules, each failure naming the member: one contiguous tensor per member,
    all on ``device``, capacity within the destination, address aligned to the
    member's itemsize, no two destinations sharing a byte.
    """
    members = layout.members
    if len(destinations) != len(members):
        raise DestinationCountError(
            f"{len(destinations)} destinations for {len(members)} members: bind exactly one "
            "destination per member, in the layout's member order"
        )
    spans: list[tuple[int, int]] = []
    for member, dest in zip(members, destinations, strict=True):
        if not isinstance(dest, torch.Tensor):
            raise DestinationLayoutError(
                f"member {member.name!r}: destination is a {type(dest).__name__}, "
                "not a torch.Tensor: bind the tensor the consumer reads"
            )
        if dest.device != device:
            raise DestinationDeviceError(
                f"member {member.name!r}: destination is on {dest.device}, the arena on "
                f"{device}: all destinations of one arena must live on one device"
            )
        if not dest.is_contiguous():
            raise DestinationLayoutError(
                f"member {member.name!r}: destination is not contiguous: bind one contiguous "
                "tensor per member (publish a strided view through a direct copy instead)"
            )
        address = dest.data_ptr()
        nbytes = dest.numel() * dest.element_size()
        if member.capacity_bytes > nbytes:
            raise DestinationBoundsError(
                f"member {member.name!r}: range past a destination's end: capacity "
                f"{member.capacity_bytes} bytes but the destination holds {nbytes}: "
                "shrink the capacity or bind a larger destination"
            )
        if address % member.itemsize:
            raise DestinationAlignmentError(
                f"member {member.name!r}: misaligned member for its dtype: destination "
                f"address {address:#x} is not a multiple of itemsize {member.itemsize}"
            )
        spans.append((address, nbytes))
    order = sorted((s for s in enumerate(spans) if s[1][1] > 0), key=lambda s: s[1][0])
    for (i, (addr_a, size_a)), (j, (addr_b, _)) in itertools.pairwise(order):
        if addr_b < addr_a + size_a:
            raise DestinationOverlapError(
                f"members {members[i].name!r} and {members[j].name!r}: destinations overlap "
                f"(bytes from {addr_b:#x} to {addr_a + size_a:#x}): bind disjoint tensors"
            )
    return spans
