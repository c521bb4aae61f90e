"""h2d_kernels: packed host-to-device publication for small per-step metadata.

One pinned host arena holds a header of range descriptors and every member's
payload; ``PackedArena.publish`` moves it with one H2D copy and one Triton
scatter that writes exactly the described byte ranges to fixed destination
addresses. ``PackedGroup`` places a publication group's members in such an arena and
publishes counts and byte ranges in one call (header, packing, DMA, scatter or graph
launch). This package knows arenas, layouts and addresses, not groups' rules or slots.
"""

from h2d_kernels.arena import DEFAULT_LAUNCH, PackedArena, bind_destinations
from h2d_kernels.copy_kinds import (
    HIP_MEMCPY_KINDS,
    classify_trace,
    copy_counts,
    copy_kind,
    count_h2d_copies,
    hip_copy_kind,
    is_copy,
)
from h2d_kernels.driver import CUDA, HIP, DeviceDriver, DriverSymbols, device_driver
from h2d_kernels.errors import (
    ArenaLayoutError,
    DescriptorError,
    DestinationAlignmentError,
    DestinationBoundsError,
    DestinationCountError,
    DestinationDeviceError,
    DestinationError,
    DestinationLayoutError,
    DestinationOverlapError,
    H2DKernelsError,
    NativeRequiredError,
    PackBoundsError,
    PublishError,
    ScatterBackendError,
)
from h2d_kernels.graphs import GraphLaunchTable
from h2d_kernels.layout import (
    DESCRIPTOR_BYTES,
    DESCRIPTOR_FIELDS,
    PAYLOAD_ALIGN,
    ArenaLayout,
    ArenaMember,
    MemberRegion,
    plan_arena,
)
from h2d_kernels.packed_group import (
    INPLACE_LIMIT,
    RANGE_OVERHEAD,
    GroupMember,
    PackedGroup,
    Placement,
    arena_order,
    placement_of,
)
from h2d_kernels.reference import scatter_reference, validate_descriptors
from h2d_kernels.scatter import ScatterConfig, interpreter_enabled

__all__ = [
    "CUDA",
    "DEFAULT_LAUNCH",
    "DESCRIPTOR_BYTES",
    "DESCRIPTOR_FIELDS",
    "HIP",
    "HIP_MEMCPY_KINDS",
    "INPLACE_LIMIT",
    "PAYLOAD_ALIGN",
    "RANGE_OVERHEAD",
    "ArenaLayout",
    "ArenaLayoutError",
    "ArenaMember",
    "DescriptorError",
    "DestinationAlignmentError",
    "DestinationBoundsError",
    "DestinationCountError",
    "DestinationDeviceError",
    "DestinationError",
    "DestinationLayoutError",
    "DestinationOverlapError",
    "DeviceDriver",
    "DriverSymbols",
    "GraphLaunchTable",
    "GroupMember",
    "H2DKernelsError",
    "MemberRegion",
    "NativeRequiredError",
    "PackBoundsError",
    "PackedArena",
    "PackedGroup",
    "Placement",
    "PublishError",
    "ScatterBackendError",
    "ScatterConfig",
    "arena_order",
    "bind_destinations",
    "classify_trace",
    "copy_counts",
    "copy_kind",
    "count_h2d_copies",
    "device_driver",
    "hip_copy_kind",
    "interpreter_enabled",
    "is_copy",
    "placement_of",
    "plan_arena",
    "scatter_reference",
    "validate_descriptors",
]
