"""Byte-preserving DMA + scatter and arena reuse (the kernel half of the spec's test_packed_h2d).

Every check compares whole poisoned pools byte for byte: destinations are
carved out of one pool with gaps between them, so a stray write into a gap,
a tail or another member shows up as a changed poison byte.

On CPU both halves run: the reference scatter and the Triton kernel in the
interpreter (TRITON_INTERPRET=1, set by the nox ``tests`` session). On CUDA
(RUN_H2D_GPU_TESTS=1) the kernel runs compiled, through every launch path.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2d_kernels import (
    CUDA,
    HIP,
    ArenaLayoutError,
    ArenaMember,
    DescriptorError,
    DestinationAlignmentError,
    DestinationBoundsError,
    DestinationCountError,
    DestinationDeviceError,
    DestinationLayoutError,
    DestinationOverlapError,
    DeviceDriver,
    DriverSymbols,
    PackedArena,
    PublishError,
    ScatterBackendError,
    ScatterConfig,
    interpreter_enabled,
    plan_arena,
    scatter_reference,
    validate_descriptors,
)

POISON = 0xA5
SCATTERS = ["reference", "triton"]
# Small chunks and grids so the CPU interpreter walks multi-chunk ranges and the
# (range + chunk) % programs ownership with few bytes.
SMALL = ScatterConfig(chunk_bytes=64, num_warps=4, max_programs=3)

DTYPES = [
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
]


def arena_options(device: str, scatter: str, config: ScatterConfig | None = None) -> dict[str, Any]:
    """Constructor options for one half of the suite, skipping halves this run cannot do."""
    if device == "cpu":
        if scatter == "triton" and not interpreter_enabled():
            pytest.skip(
                "Triton half on CPU needs TRITON_INTERPRET=1 before triton is imported "
                "(the nox tests session sets it)"
            )
        return {"scatter": scatter, "config": config}
    if scatter == "reference":
        pytest.skip("the reference scatter is CPU-only; its CPU half covers it")
    return {"scatter": "triton", "config": config}


# -- pools, destinations and the byte model ------------------------------------------------------


@dataclass
class Pool:
    """One poisoned uint8 buffer with destinations carved out of it, and its expected bytes."""

    buffer: torch.Tensor
    offsets: list[int]
    destinations: list[torch.Tensor]
    expected: np.ndarray

    def apply(self, arena: PackedArena, rows: Sequence[tuple[int, int, int, int]]) -> None:
        """Record what a publication of ``rows`` must write (from the host arena's bytes)."""
        host = arena.host_np
        for src, nbytes, member, dst in rows:
            if nbytes:
                start = self.offsets[member] + dst
                self.expected[start : start + nbytes] = host[src : src + nbytes]

    def check(self) -> None:
        actual = self.buffer.cpu().numpy()
        diff = np.flatnonzero(actual != self.expected)
        assert diff.size == 0, (
            f"{diff.size} bytes differ, first at pool byte {diff[0]}: "
            f"got {actual[diff[0]]}, want {self.expected[diff[0]]}"
        )


def carve(
    device: str,
    specs: Sequence[tuple[torch.dtype, int]],
    phases: Sequence[int] | None = None,
    gaps: Sequence[int] | None = None,
) -> Pool:
    """Destinations (dtype, numel) in one poisoned pool; ``phases`` in items shift them mod 16."""
    offsets, cursor = [], 0
    for i, (dtype, numel) in enumerate(specs):
        item = torch.empty(0, dtype=dtype).element_size()
        cursor += gaps[i] if gaps else 24
        cursor = -(-cursor // 16) * 16 + (phases[i] if phases else 0) * item
        offsets.append(cursor)
        cursor += numel * item
    buffer = torch.full((cursor + 32,), POISON, dtype=torch.uint8, device=device)
    dests = []
    for (dtype, numel), off in zip(specs, offsets, strict=True):
        item = torch.empty(0, dtype=dtype).element_size()
        dests.append(buffer[off : off + numel * item].view(dtype))
    return Pool(buffer, offsets, dests, np.full(buffer.numel(), POISON, dtype=np.uint8))


def members_for(pool: Pool, names: Sequence[str] | None = None) -> list[ArenaMember]:
    return [
        ArenaMember(names[i] if names else f"m{i}", d.numel() * d.element_size(), d.element_size())
        for i, d in enumerate(pool.destinations)
    ]


def write_rows(arena: PackedArena, rows: Sequence[tuple[int, int, int, int]]) -> int:
    """Write descriptors (zeroing the rest); return the dma_bytes that covers them."""
    header = arena.header_np
    header[:] = 0
    for k, row in enumerate(rows):
        header[k] = row
    return max([arena.header_bytes] + [src + n for src, n, _, _ in rows if n])


def publish_and_sync(arena: PackedArena, dma_bytes: int) -> None:
    arena.publish(dma_bytes)
    if arena.device.type == "cuda":
        torch.cuda.synchronize(arena.device)


def full_rows(arena: PackedArena) -> list[tuple[int, int, int, int]]:
    layout = arena.layout
    return [(r.offset, r.capacity_bytes, r.index, 0) for r in layout.regions]


# -- layout --------------------------------------------------------------------------------------


def test_plan_places_header_then_aligned_regions_in_order() -> None:
    members = [
        ArenaMember("ids", 12, 4),
        ArenaMember("empty", 0, 8),
        ArenaMember("pos", 24, 8),
        ArenaMember("flags", 3, 1),
        ArenaMember("table", 64, 4),
    ]
    layout = plan_arena(members, num_ranges=7)
    assert layout.num_ranges == 7 and layout.header_bytes == 7 * 32
    assert layout.members == tuple(members)
    offsets = [layout.payload_offset(i) for i in range(5)]
    assert offsets == sorted(offsets) and offsets[0] >= layout.header_bytes
    assert all(o % 16 == 0 for o in offsets)
    for a, b in itertools.pairwise(layout.regions):
        assert a.end <= b.offset
    assert layout.total_bytes % 16 == 0 and layout.total_bytes >= layout.regions[-1].end
    assert layout.member_index("table") == 4
    assert layout.source_offset(4, 20) == layout.payload_offset(4) + 20
    assert plan_arena(members).num_ranges == 5


@pytest.mark.parametrize(
    ("members", "kwargs", "needle"),
    [
        ([], {}, "at least one member"),
        ([ArenaMember("a", 8, 4), ArenaMember("a", 8, 4)], {}, "'a' appears twice"),
        ([ArenaMember("", 8, 4)], {}, "no name"),
        ([ArenaMember("odd", 8, 3)], {}, "'odd' has itemsize 3"),
        ([ArenaMember("neg", -4, 4)], {}, "'neg' has capacity_bytes -4"),
        ([ArenaMember("part", 6, 4)], {}, "'part' has capacity_bytes 6"),
        ([ArenaMember("a", 8, 4)], {"num_ranges": 0}, "num_ranges=0"),
        (["not a member"], {}, "not an ArenaMember"),
    ],
)
def test_plan_rejects_bad_members_naming_them(
    members: list[Any], kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ArenaLayoutError, match=needle):
        plan_arena(members, **kwargs)
    with pytest.raises(ArenaLayoutError, match="no member named 'zz'"):
        plan_arena([ArenaMember("a", 4, 4)]).member_index("zz")


# -- bind-time errors ----------------------------------------------------------------------------


def _assert_rejected(
    device: str, layout: Any, dests: list[torch.Tensor], exc: type[Exception], needle: str
) -> None:
    mine = [d for d in dests if d.device.type == device]
    before = [d.clone() for d in mine]
    if device == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    with pytest.raises(exc, match=needle):
        PackedArena(layout, dests, device=device)
    # A rejected binding allocates nothing and writes nothing (peak read before the
    # comparisons below, which allocate their own temporaries).
    if device == "cuda":
        assert torch.cuda.max_memory_allocated() == allocated
    for d, b in zip(mine, before, strict=True):
        assert torch.equal(d, b)


def test_bind_rejects_bad_destinations_naming_the_member(device: str) -> None:
    pool = carve(device, [(torch.int32, 8), (torch.int64, 4)])
    a, b = pool.destinations
    layout = plan_arena([ArenaMember("ids", 32, 4), ArenaMember("pos", 32, 8)])
    _assert_rejected(device, layout, [a], DestinationCountError, "1 destinations for 2 members")
    big = plan_arena([ArenaMember("ids", 36, 4), ArenaMember("pos", 32, 8)])
    _assert_rejected(
        device, big, [a, b], DestinationBoundsError, "'ids': range past a destination's end"
    )
    base = torch.zeros(48, dtype=torch.uint8, device=device)
    shifted = base[4:36].view(torch.int32)  # 4-byte aligned, not 8
    _assert_rejected(
        device,
        layout,
        [a, shifted],
        DestinationAlignmentError,
        "'pos': misaligned member for its dtype",
    )
    strided = torch.zeros(16, dtype=torch.int64, device=device)[::2]
    _assert_rejected(device, layout, [a, strided], DestinationLayoutError, "'pos'.*not contiguous")
    whole = torch.zeros(16, dtype=torch.int64, device=device)
    _assert_rejected(
        device,
        layout,
        [whole[:4].view(torch.int32), whole[2:6]],
        DestinationOverlapError,
        "'ids' and 'pos': destinations overlap",
    )
    other = "cpu" if device == "cuda" else "meta"
    _assert_rejected(
        device,
        layout,
        [a, torch.zeros(4, dtype=torch.int64, device=other)],
        DestinationDeviceError,
        "'pos': destination is on",
    )


def test_backend_choices_are_checked(device: str) -> None:
    pool = carve(device, [(torch.int32, 4)])
    layout = plan_arena(members_for(pool))
    with pytest.raises(ScatterBackendError, match="scatter='fast'"):
        PackedArena(layout, pool.destinations, scatter="fast")  # type: ignore[arg-type]
    if device == "cpu":
        with pytest.raises(ScatterBackendError, match="needs a CUDA device"):
            PackedArena(layout, pool.destinations, launch="graph")
        if interpreter_enabled():
            assert PackedArena(layout, pool.destinations, scatter="triton").scatter == "triton"
        else:
            with pytest.raises(ScatterBackendError, match="TRITON_INTERPRET=1"):
                PackedArena(layout, pool.destinations, scatter="triton")
        assert PackedArena(layout, pool.destinations).scatter == "reference"
    else:
        with pytest.raises(ScatterBackendError, match="CPU devices only"):
            PackedArena(layout, pool.destinations, scatter="reference")


def test_publish_rejects_dma_bytes_outside_the_arena(device: str) -> None:
    pool = carve(device, [(torch.int32, 4)])
    arena = PackedArena(plan_arena(members_for(pool)), pool.destinations)
    for bad in (arena.header_bytes - 1, arena.total_bytes + 1):
        with pytest.raises(PublishError, match=f"dma_bytes={bad}"):
            arena.publish(bad)
    pool.check()


def test_graph_launch_table_only_for_graph_arenas(device: str) -> None:
    """A compiled launcher gets handles only from an arena that launches captured graphs
    through cuGraphLaunch; every bucket from the header to the whole arena has one."""
    pool = carve(device, [(torch.int32, 300), (torch.int64, 70)])
    layout = plan_arena(members_for(pool))
    arena = PackedArena(layout, pool.destinations)
    table = arena.graph_launch_table()
    if device == "cpu" or arena.graph_launcher != "cuGraphLaunch":
        assert table is None
        return
    from h2d_kernels.graphs import bucket_index

    assert table.graph_launch and table.stream_is_capturing
    covered = range(bucket_index(arena.header_bytes), bucket_index(arena.total_bytes) + 1)
    assert all(table.execs[i] for i in covered)
    assert not any(table.execs[i] for i in range(len(table.execs)) if i not in covered)
    compiled = PackedArena(layout, pool.destinations, launch="compiled")
    assert compiled.graph_launch_table() is None


class _FakeFn:  # stands in for a ctypes function of the runtime library
    argtypes: object = None
    restype: object = None


class _FakeLib:
    """A runtime library exporting exactly ``names`` (attribute access like ctypes.CDLL)."""

    def __init__(self, names: set[str]) -> None:
        self._fns = {n: _FakeFn() for n in names}

    def __getattr__(self, name: str) -> _FakeFn:
        try:
            return self.__dict__["_fns"][name]
        except KeyError:
            raise AttributeError(name) from None


def _symbols(table: DriverSymbols) -> set[str]:
    return {v for k, v in vars(table).items() if k not in ("runtime", "library")}


def test_driver_hands_out_only_known_entry_points() -> None:
    driver = DeviceDriver(_FakeLib(_symbols(CUDA)))  # type: ignore[arg-type]
    with pytest.raises(ScatterBackendError, match="'cuMemFree' is not an entry point"):
        driver.address("cuMemFree")
    with pytest.raises(ScatterBackendError, match="'cuGraphLaunch' is not an entry point"):
        driver.address("cuGraphLaunch")  # runtime-neutral names only


@pytest.mark.parametrize("table", [CUDA, HIP], ids=["cuda", "hip"])
def test_driver_binds_each_runtimes_symbols(table: DriverSymbols) -> None:
    """The same interface over libcuda and libamdhip64: each table binds only its own
    runtime's names, and a library missing one fails at load, not mid-run."""
    lib = _FakeLib(_symbols(table))
    driver = DeviceDriver(lib, table)  # type: ignore[arg-type]
    assert driver.symbols.runtime == table.runtime
    assert driver._graph_launch is lib._fns[table.graph_launch]
    other = HIP if table is CUDA else CUDA
    with pytest.raises(AttributeError):
        DeviceDriver(_FakeLib(_symbols(other)), table)  # type: ignore[arg-type]
    partial = _symbols(table) - {table.event_query}
    with pytest.raises(AttributeError, match=table.event_query):
        DeviceDriver(_FakeLib(partial), table)  # type: ignore[arg-type]


@pytest.mark.parametrize("table", [CUDA, HIP], ids=["cuda", "hip"])
def test_a_driver_without_record_with_flags_still_loads_and_says_why(
        table: DriverSymbols) -> None:
    """The graphs' completion record is optional: without the entry point the driver
    binds, says what is missing, and refuses the record (finish() then records)."""
    full = DeviceDriver(_FakeLib(_symbols(table)), table)  # type: ignore[arg-type]
    assert full.record_external_missing is None
    lacking = DeviceDriver(_FakeLib(_symbols(table) - {table.event_record_with_flags}),
                           table)  # type: ignore[arg-type]
    why = f"{table.event_record_with_flags} is missing from {table.library}"
    assert lacking.record_external_missing == why
    with pytest.raises(ScatterBackendError, match=why):
        lacking.event_record_external(1, 2)


# -- exact bytes ---------------------------------------------------------------------------------


def special_values(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Edge values first (extremes, -0.0, infinities, NaNs with payloads), then random bits."""
    gen = torch.Generator().manual_seed(int(numel) * 7 + len(str(dtype)))
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    out = raw.view(dtype).clone()
    if dtype.is_floating_point:
        edges = torch.tensor([0.0, -0.0, 1.5, -2.25], dtype=torch.float32).to(dtype)
        if dtype != torch.float8_e4m3fn:
            info = torch.finfo(dtype)
            more = torch.tensor([info.max, info.min, info.tiny, float("inf"), float("-inf")])
            edges = torch.cat([edges, more.to(dtype)])
        bits = edges.view(torch.uint8)
        nan_bits = {
            torch.float16: [0x7E01, 0xFC03],
            torch.bfloat16: [0x7FC1, 0xFF81],
            torch.float32: [0x7FC00001, 0x7F800003],
            torch.float64: [0x7FF8000000000001, 0x7FF0000000000005],
            torch.float8_e4m3fn: [0x7F, 0xFF],  # both NaN encodings
        }[dtype]
        nans = torch.from_numpy(np.array(nan_bits, dtype=f"<u{size}").view(np.uint8))
        head = torch.cat([bits, nans]).view(dtype)
    else:
        info_i = torch.iinfo(dtype)
        head = torch.tensor([info_i.max, info_i.min, 0, -1 if info_i.min < 0 else 1], dtype=dtype)
    n = min(numel, head.numel())
    out[:n] = head[:n]
    return out


@pytest.mark.parametrize("scatter", SCATTERS)
def test_exact_bytes_for_every_dtype(device: str, scatter: str) -> None:
    opts = arena_options(device, scatter)
    specs = [(dtype, 37 + 3 * i) for i, dtype in enumerate(DTYPES)]
    pool = carve(device, specs, phases=[i % 3 for i in range(len(specs))])
    arena = PackedArena(plan_arena(members_for(pool)), pool.destinations, **opts)
    for i, (dtype, numel) in enumerate(specs):
        arena.payload_host(i).view(dtype)[:] = special_values(dtype, numel)
    rows = full_rows(arena)
    dma = write_rows(arena, rows)
    pool.apply(arena, rows)
    publish_and_sync(arena, dma)
    pool.check()
    for i, (dtype, numel) in enumerate(specs):
        got = pool.destinations[i].cpu().view(torch.uint8)
        assert torch.equal(got, special_values(dtype, numel).view(torch.uint8)), dtype


@pytest.mark.parametrize("scatter", SCATTERS)
def test_unaligned_heads_and_tails_for_every_phase(device: str, scatter: str) -> None:
    # One descriptor per (source phase, destination phase, length) combination,
    # all in one publication: 16-, 4- and 1-byte bodies with every head and tail.
    opts = arena_options(device, scatter, SMALL)
    cases = [(sp, dp, n) for sp in (0, 1, 4, 9) for dp in (0, 2, 4, 13) for n in (1, 15, 16, 47)]
    pool = carve(device, [(torch.uint8, 96)] * len(cases))
    layout = plan_arena(members_for(pool))
    arena = PackedArena(layout, pool.destinations, **opts)
    arena.host_np[layout.header_bytes :] = np.random.default_rng(1).integers(
        0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8
    )
    rows = [(layout.payload_offset(i) + sp, n, i, dp) for i, (sp, dp, n) in enumerate(cases)]
    pool.apply(arena, rows)
    publish_and_sync(arena, write_rows(arena, rows))
    pool.check()


@pytest.mark.parametrize("scatter", SCATTERS)
def test_reuse_with_changing_counts_and_zero_length_members(device: str, scatter: str) -> None:
    opts = arena_options(device, scatter, SMALL)
    specs = [(torch.int32, 64), (torch.int64, 0), (torch.float32, 40), (torch.int8, 33)]
    pool = carve(device, specs, phases=[1, 0, 2, 5])
    layout = plan_arena(members_for(pool), num_ranges=6)
    arena = PackedArena(layout, pool.destinations, **opts)
    rng = np.random.default_rng(7)
    for step, counts in enumerate([(64, 0, 40, 33), (3, 0, 0, 1), (0, 0, 0, 0), (64, 0, 17, 0)]):
        payload = rng.integers(0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8)
        arena.host_np[layout.header_bytes :] = payload
        rows = [
            (layout.payload_offset(i), n * pool.destinations[i].element_size(), i, 0)
            for i, n in enumerate(counts)
        ]
        # Unused descriptors hold garbage member indices and offsets: nbytes == 0 makes them no-ops.
        rows += [(10**9, 0, 99, 10**9)] if step % 2 else []
        dma = write_rows(arena, rows)
        pool.apply(arena, rows)
        publish_and_sync(arena, dma)
        pool.check()


@pytest.mark.parametrize("scatter", SCATTERS)
def test_row_ranges_start_inside_the_destination(device: str, scatter: str) -> None:
    # A block table [rows, pages] where only changed rows travel, each through
    # its own descriptor, staged at the row's own offset in the member's region.
    opts = arena_options(device, scatter, SMALL)
    rows_n, pages = 12, 9
    pool = carve(device, [(torch.int32, rows_n * pages), (torch.int64, 5)], phases=[1, 0])
    layout = plan_arena(members_for(pool, ["block_tables", "positions"]), num_ranges=6)
    arena = PackedArena(layout, pool.destinations, **opts)
    table = arena.payload_np(0).view(np.int32).reshape(rows_n, pages)
    table[:] = np.arange(rows_n * pages, dtype=np.int32).reshape(rows_n, pages)
    rows = full_rows(arena)
    pool.apply(arena, rows)
    publish_and_sync(arena, write_rows(arena, rows))
    pool.check()
    row_bytes = pages * 4
    for changed in ([3, 4, 10], [0], [11, 5, 7, 1, 2]):
        table[changed] = -np.asarray(changed, dtype=np.int32)[:, None] - 1000
        descs = [
            (layout.source_offset(0, r * row_bytes), row_bytes, 0, r * row_bytes) for r in changed
        ]
        pool.apply(arena, descs)
        publish_and_sync(arena, write_rows(arena, descs))
        pool.check()


@st.composite
def publications(draw: st.DrawFn) -> dict[str, Any]:
    """Random members, destination phases and gaps, and a few publications of random ranges."""
    count = draw(st.integers(1, 5))
    specs = [(draw(st.sampled_from(DTYPES)), draw(st.integers(0, 80))) for _ in range(count)]
    phases = [draw(st.integers(0, 15)) for _ in range(count)]
    gaps = [draw(st.integers(0, 40)) for _ in range(count)]
    extra = draw(st.integers(0, 3))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        per_member = []
        for dtype, numel in specs:
            size = numel * torch.empty(0, dtype=dtype).element_size()
            cuts = sorted(draw(st.lists(st.integers(0, size), max_size=4)))
            spans = list(zip(cuts[::2], cuts[1::2], strict=False))
            # Sources at the rows' own offsets, or shifted anywhere in the region.
            shifted = [draw(st.booleans()) and draw(st.integers(0, size)) for _ in spans]
            per_member.append([(a, b - a, s) for (a, b), s in zip(spans, shifted, strict=True)])
        steps.append(per_member)
    config = ScatterConfig(
        chunk_bytes=draw(st.sampled_from([16, 64, 8192])),
        max_programs=draw(st.integers(1, 5)),
    )
    return {
        "specs": specs,
        "phases": phases,
        "gaps": gaps,
        "extra": extra,
        "steps": steps,
        "config": config,
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@pytest.mark.parametrize("scatter", SCATTERS)
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=publications())
def test_random_layouts_and_counts(device: str, scatter: str, case: dict[str, Any]) -> None:
    opts = arena_options(device, scatter, case["config"])
    pool = carve(device, case["specs"], case["phases"], case["gaps"])
    most = max(sum(len(m) for m in step) for step in case["steps"])
    layout = plan_arena(members_for(pool), num_ranges=max(1, most + case["extra"]))
    arena = PackedArena(layout, pool.destinations, **opts)
    rng = np.random.default_rng(case["seed"])
    for step in case["steps"]:
        arena.host_np[layout.header_bytes :] = rng.integers(
            0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8
        )
        rows = []
        for member, spans in enumerate(step):
            region = layout.region(member)
            for dst, n, shift in spans:
                src = (
                    region.offset + dst
                    if shift is False
                    else region.offset + min(int(shift), region.capacity_bytes - n)
                )
                rows.append((src, n, member, dst))
        dma = write_rows(arena, rows)
        assert arena.validate(dma) == dma
        pool.apply(arena, rows)
        publish_and_sync(arena, dma)
        pool.check()


@pytest.mark.parametrize("scatter", SCATTERS)
def test_staging_region_sources_land_in_members(device: str, scatter: str) -> None:
    # plan_arena(staging_bytes=...) reserves an unnamed region; descriptors may
    # take their source bytes from it instead of the member's own region.
    opts = arena_options(device, scatter, SMALL)
    pool = carve(device, [(torch.int32, 40), (torch.int16, 30)], phases=[1, 3])
    layout = plan_arena(members_for(pool), num_ranges=4, staging_bytes=100, staging_before=1)
    assert layout.staging_offset % 16 == 0 and layout.staging_bytes == 100
    assert layout.region(0).end <= layout.staging_offset
    assert layout.staging_offset + 100 <= layout.payload_offset(1)
    arena = PackedArena(layout, pool.destinations, **opts)
    staged = np.arange(100, dtype=np.uint8) + 7
    arena.host_np[layout.staging_offset : layout.staging_offset + 100] = staged
    rows = [
        (layout.staging_offset, 12, 0, 8),
        (layout.staging_offset + 12, 21, 1, 5),
        (layout.staging_offset + 40, 60, 0, 100),
    ]
    pool.apply(arena, rows)
    publish_and_sync(arena, write_rows(arena, rows))
    pool.check()
    with pytest.raises(ArenaLayoutError, match="staging_before=3"):
        plan_arena(members_for(pool), staging_bytes=16, staging_before=3)


# -- reference and descriptor validation ---------------------------------------------------------


def test_scatter_reference_writes_numpy_and_tensor_destinations() -> None:
    arena = np.arange(128, dtype=np.uint8)
    dst_np = np.full(10, POISON, dtype=np.uint8)
    dst_t = torch.full((3,), -1, dtype=torch.int32)
    header = np.array([[100, 7, 0, 2], [64, 8, 1, 4], [0, 0, 5, 999]], dtype=np.int64)
    scatter_reference(torch.from_numpy(arena), header, [dst_np, dst_t])
    assert dst_np.tolist() == [POISON] * 2 + list(range(100, 107)) + [POISON]
    assert dst_t.view(torch.uint8).tolist() == [255] * 4 + list(range(64, 72))


@pytest.mark.parametrize(
    ("row", "kwargs", "needle"),
    [
        ((100, -1, 0, 0), {}, "descriptor 1 has nbytes -1"),
        ((100, 4, 2, 0), {}, "descriptor 1 names member 2"),
        ((100, 4, 1, -2), {}, "descriptor 1 for member 1 \\('b'\\) has a negative offset"),
        ((126, 4, 1, 0), {}, "runs past the arena's 128 bytes"),
        ((100, 9, 1, 0), {}, "member 1 \\('b'\\): range \\[0, 9\\) runs past the destination"),
        ((100, 4, 1, 6), {}, "runs past the destination's end"),
        ((16, 4, 1, 0), {"header_bytes": 64}, "lies in the 64-byte header"),
        ((100, 4, 1, 0), {"dma_bytes": 102}, "past dma_bytes=102"),
        ((110, 4, 0, 2), {}, "descriptors 0 and 1 both write bytes \\[2, 4\\)"),
    ],
)
def test_validate_descriptors_names_descriptor_and_member(
    row: tuple[int, int, int, int], kwargs: dict[str, Any], needle: str
) -> None:
    header = np.array([[96, 4, 0, 0], row], dtype=np.int64)
    with pytest.raises(DescriptorError, match=needle):
        validate_descriptors(
            header, arena_nbytes=128, destination_nbytes=[10, 8], member_names=["a", "b"], **kwargs
        )
    dests = [np.full(10, POISON, np.uint8), np.full(8, POISON, np.uint8)]
    if not kwargs:
        # The oracle validates everything before writing anything.
        with pytest.raises(DescriptorError):
            scatter_reference(np.zeros(128, np.uint8), header, dests)
        assert all((d == POISON).all() for d in dests)


def test_validate_descriptors_returns_the_covering_dma_bytes() -> None:
    header = np.array([[96, 4, 0, 0], [120, 8, 1, 0], [0, 0, 0, 0]], dtype=np.int64)
    assert validate_descriptors(header, arena_nbytes=128, destination_nbytes=[4, 8]) == 128
    header[1, 1] = 0
    assert (
        validate_descriptors(header, arena_nbytes=128, destination_nbytes=[4, 8], header_bytes=96)
        == 100
    )


# -- CUDA only -----------------------------------------------------------------------------------

LAUNCHES = [("compiled", "driver"), ("compiled", "torch"), ("graph", "driver"), ("jit", "torch")]


def _cuda_arena(launch: str, dma: str, seed: int = 0) -> tuple[PackedArena, Pool]:
    specs = [(torch.int32, 300), (torch.bfloat16, 77), (torch.int64, 9), (torch.int8, 5000)]
    pool = carve("cuda", specs, phases=[1, 3, 0, 7])
    layout = plan_arena(members_for(pool), num_ranges=6)
    arena = PackedArena(layout, pool.destinations, launch=launch, dma=dma)  # type: ignore[arg-type]
    arena.host_np[layout.header_bytes :] = np.random.default_rng(seed).integers(
        0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8
    )
    return arena, pool


@pytest.mark.gpu
@pytest.mark.parametrize(("launch", "dma"), LAUNCHES)
def test_cuda_launch_paths_publish_exact_bytes_without_allocating(launch: str, dma: str) -> None:
    arena, pool = _cuda_arena(launch, dma)
    assert (arena.launch, arena.dma) == (launch, dma)
    layout = arena.layout
    rng = np.random.default_rng(3)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated()
    side = torch.cuda.Stream()
    for i in range(6):
        rows = []
        for r in layout.regions:
            start = int(rng.integers(0, r.capacity_bytes))
            n = int(rng.integers(0, r.capacity_bytes - start + 1))
            rows.append((r.offset + start, n, r.index, start))
        arena.host_np[layout.header_bytes :] = rng.integers(
            0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8
        )
        pool.apply(arena, rows)
        dma_bytes = write_rows(arena, rows)
        arena.publish(dma_bytes, stream=side if i % 2 else None)
        torch.cuda.synchronize()
        pool.check()
    # The peak, not the current figure: a free by the garbage collector must not hide an allocation.
    assert torch.cuda.max_memory_allocated() == allocated


@pytest.mark.gpu
@pytest.mark.parametrize("explicit_stream", [False, True])
@pytest.mark.parametrize("launch", ["compiled", "graph", "jit"])
def test_cuda_publish_captured_into_a_graph_then_replayed(launch: str,
                                                          explicit_stream: bool) -> None:
    # The capture check runs on the current stream (stream=None) or on the given one.
    arena, pool = _cuda_arena(launch, "torch" if launch == "jit" else "driver")
    rows = full_rows(arena)
    write_rows(arena, rows)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        arena.publish(arena.total_bytes)  # eager warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool.apply(arena, rows)
    pool.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        arena.publish(arena.total_bytes,
                      torch.cuda.current_stream() if explicit_stream else None)
    # New payload and new counts travel through the captured DMA on each replay.
    rng = np.random.default_rng(11)
    for _ in range(3):
        layout = arena.layout
        arena.host_np[layout.header_bytes :] = rng.integers(
            0, 256, layout.total_bytes - layout.header_bytes, dtype=np.uint8
        )
        rows = [
            (r.offset, int(rng.integers(0, r.capacity_bytes + 1)), r.index, 0)
            for r in layout.regions
        ]
        write_rows(arena, rows)
        pool.apply(arena, rows)
        graph.replay()
        torch.cuda.synchronize()
        pool.check()


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["compiled", "graph"])
def test_cuda_host_arena_is_read_when_the_dma_runs(launch: str) -> None:
    # The DMA reads the host arena when the GPU reaches it, not at publish():
    # sources may be rewritten only after an event recorded after publish.
    arena, pool = _cuda_arena(launch, "driver")
    rows = full_rows(arena)
    dma = write_rows(arena, rows)
    layout = arena.layout
    first = arena.host_np[layout.header_bytes :].copy()
    second = (first ^ 0x5A).astype(np.uint8)
    done = torch.cuda.Event()

    torch.cuda._sleep(200_000_000)  # keep the stream busy well past the host's next steps
    arena.publish(dma)
    done.record()
    assert not done.query(), "publish waited for the GPU"
    done.synchronize()
    pool.apply(arena, rows)
    arena.host_np[layout.header_bytes :] = second  # safe: the event has completed
    torch.cuda.synchronize()
    pool.check()

    torch.cuda._sleep(200_000_000)
    arena.publish(dma)
    done.record()
    third = (first ^ 0x33).astype(np.uint8)
    arena.host_np[layout.header_bytes :] = third  # too early: the pending DMA sees these bytes
    assert not done.query()
    torch.cuda.synchronize()
    pool.apply(arena, rows)
    pool.check()


def test_compiled_cpu_publication_matches_the_reference_scatter() -> None:
    """The CPU arena's publication (compiled: a memcpy per descriptor) writes exactly what
    ``scatter_reference``, the plain statement of the rule, writes from the same bytes."""
    rng = np.random.default_rng(39)
    pool = carve("cpu", [(torch.int32, 97), (torch.uint8, 300), (torch.float32, 64)])
    arena = PackedArena(plan_arena(members_for(pool)), pool.destinations, scatter="reference")
    oracle = [d.clone() for d in pool.destinations]
    for _ in range(50):
        arena.host_np[arena.header_bytes:] = rng.integers(0, 256, arena.total_bytes
                                                          - arena.header_bytes, np.uint8)
        rows = []
        for r in arena.layout.regions:  # a random span of each member, some left out
            size = r.capacity_bytes
            n = int(rng.integers(0, size + 1)) if rng.random() < 0.8 else 0
            dst = int(rng.integers(0, size - n + 1))
            rows.append((r.offset + dst, n, r.index, dst))
        dma = write_rows(arena, rows)
        publish_and_sync(arena, dma)
        scatter_reference(arena.host_np[:dma], arena.header_np, oracle)
        for got, want in zip(pool.destinations, oracle, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # NaN bytes too
