"""CPU oracle for the scatter, and the descriptor checker used by tests and debug runs.

Same contract as the Triton kernel: each descriptor ``(src_offset, nbytes,
member_index, dst_offset)`` with ``nbytes > 0`` copies ``arena[src_offset :
src_offset + nbytes]`` to ``destination[member_index]`` at byte ``dst_offset``;
descriptors with ``nbytes == 0`` are no-ops and no other byte is written.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from h2d_kernels.errors import DescriptorError, DestinationError, DestinationLayoutError
from h2d_kernels.layout import DESCRIPTOR_FIELDS

ArrayLike = np.ndarray | torch.Tensor


def as_header(header: ArrayLike) -> np.ndarray:
    """The header as an int64 numpy array of shape ``[num_ranges, 4]`` (a view when possible)."""
    arr = header.detach().cpu().numpy() if isinstance(header, torch.Tensor) else np.asarray(header)
    if arr.dtype == np.uint8:
        if arr.size % (DESCRIPTOR_FIELDS * 8):
            raise DescriptorError(
                f"header of {arr.size} bytes is not a whole number of 32-byte descriptors"
            )
        arr = arr.view(np.int64)
    if arr.dtype != np.int64:
        raise DescriptorError(f"header dtype is {arr.dtype}: descriptors are int64 values")
    if arr.size % DESCRIPTOR_FIELDS:
        raise DescriptorError(
            f"header of {arr.size} int64 values is not a whole number of 4-field descriptors"
        )
    return arr.reshape(-1, DESCRIPTOR_FIELDS)


def byte_view(destination: ArrayLike, name: str = "destination") -> np.ndarray:
    """A writable flat uint8 numpy view of a contiguous CPU tensor or array."""
    if isinstance(destination, torch.Tensor):
        if destination.device.type != "cpu":
            raise DestinationError(
                f"{name} is on {destination.device}: the reference scatter writes CPU tensors only"
            )
        if not destination.is_contiguous():
            raise DestinationLayoutError(
                f"{name} is not contiguous: bind one contiguous tensor per member"
            )
        return destination.reshape(-1).view(torch.uint8).numpy()
    if not isinstance(destination, np.ndarray) or not destination.flags.c_contiguous:
        raise DestinationLayoutError(
            f"{name} is not a contiguous numpy array or tensor: "
            "bind one contiguous buffer per member"
        )
    return destination.reshape(-1).view(np.uint8)


def _member_label(index: int, member_names: Sequence[str] | None) -> str:
    if member_names is not None and 0 <= index < len(member_names):
        return f"member {index} ({member_names[index]!r})"
    return f"member {index}"


def validate_descriptors(
    header: ArrayLike,
    *,
    arena_nbytes: int,
    destination_nbytes: Sequence[int],
    member_names: Sequence[str] | None = None,
    header_bytes: int | None = None,
    dma_bytes: int | None = None,
) -> int:
    """Check every active descriptor; return the smallest ``dma_bytes`` that covers them.

    Errors (:class:`DescriptorError`, naming the descriptor and member): negative
    fields, a member index outside the destination table, a source range past
    the arena (or past ``dma_bytes`` / inside the header when those are given),
    a range past a destination's end, and two ranges writing the same
    destination bytes (the scatter would race on them).
    """
    rows = as_header(header)
    required = 0 if header_bytes is None else header_bytes
    written: list[list[tuple[int, int, int]]] = [[] for _ in destination_nbytes]
    for k, (src, nbytes, member, dst) in enumerate(rows.tolist()):
        if nbytes == 0:
            continue
        if nbytes < 0:
            raise DescriptorError(f"descriptor {k} has nbytes {nbytes}: counts must be >= 0")
        if not 0 <= member < len(destination_nbytes):
            raise DescriptorError(
                f"descriptor {k} names member {member}, but the destination table has "
                f"{len(destination_nbytes)} members: write a valid member_index"
            )
        label = _member_label(member, member_names)
        if src < 0 or dst < 0:
            raise DescriptorError(
                f"descriptor {k} for {label} has a negative offset (src {src}, dst {dst})"
            )
        if src + nbytes > arena_nbytes:
            raise DescriptorError(
                f"descriptor {k} for {label}: source range [{src}, {src + nbytes}) runs past the "
                f"arena's {arena_nbytes} bytes: keep sources inside the member's payload region"
            )
        if header_bytes is not None and src < header_bytes:
            raise DescriptorError(
                f"descriptor {k} for {label}: source offset {src} lies in the {header_bytes}-byte "
                "header: stage payload bytes in the member's payload region"
            )
        if dma_bytes is not None and src + nbytes > dma_bytes:
            raise DescriptorError(
                f"descriptor {k} for {label}: source range ends at {src + nbytes}, past "
                f"dma_bytes={dma_bytes}: raise dma_bytes to cover every descriptor's source"
            )
        limit = destination_nbytes[member]
        if dst + nbytes > limit:
            raise DescriptorError(
                f"descriptor {k} for {label}: range [{dst}, {dst + nbytes}) runs past the "
                f"destination's end ({limit} bytes): shrink the count or the row offset"
            )
        written[member].append((dst, dst + nbytes, k))
        required = max(required, src + nbytes)
    for member, spans in enumerate(written):
        spans.sort()
        for (_, end_a, k_a), (start_b, _, k_b) in itertools.pairwise(spans):
            if start_b < end_a:
                raise DescriptorError(
                    f"descriptors {k_a} and {k_b} both write bytes [{start_b}, {end_a}) of "
                    f"{_member_label(member, member_names)}: publish each byte at most once"
                )
    return required


def scatter_bytes(arena: np.ndarray, rows: np.ndarray, dest_views: Sequence[np.ndarray]) -> None:
    """Unchecked scatter over prepared views (the CPU publication's inner loop)."""
    for src, nbytes, member, dst in rows.tolist():
        if nbytes > 0:
            dest_views[member][dst : dst + nbytes] = arena[src : src + nbytes]


def scatter_reference(
    arena_bytes: ArrayLike,
    header: ArrayLike,
    destinations: Sequence[ArrayLike],
) -> None:
    """Write each descriptor's arena bytes to its destination on the CPU.

    ``arena_bytes`` is the flat uint8 arena (numpy or CPU tensor), ``header``
    the int64 ``[num_ranges, 4]`` descriptors (or their raw bytes) and
    ``destinations`` the per-member contiguous CPU tensors or arrays. Every
    descriptor is validated before the first byte is written.
    """
    arena = byte_view(arena_bytes, "arena")
    rows = as_header(header)
    views = [byte_view(d, f"destination {i}") for i, d in enumerate(destinations)]
    validate_descriptors(rows, arena_nbytes=arena.size, destination_nbytes=[v.size for v in views])
    scatter_bytes(arena, rows, views)
