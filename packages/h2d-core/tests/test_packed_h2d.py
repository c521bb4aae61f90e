"""Packed publication through the core: arena reuse, direct fallbacks, combined groups,
packed == direct byte for byte, delayed source reuse, profiler counts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from h2d_core import DuplicatePublicationError, H2DRunnerState
from h2d_kernels import copy_counts, is_copy


def _step(setup: Any, h: Any, rng: np.random.Generator, counts: dict[str, int | None],
          group: str = "decode") -> dict[str, torch.Tensor]:
    """Fill every source randomly, set counts, publish; return the expected destinations."""
    st = setup.state
    expected = {}
    for name, b in setup.buffers.items():
        h.fill_random(b, rng)
        before = h.dest_bytes(b)
        st.set_count(b, counts.get(name))
        expected[name] = h.expected_bytes(b, b.cpu, counts.get(name), before)
    st.publish(group)
    return expected


def _random_counts(setup: Any, rng: np.random.Generator) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, b in setup.buffers.items():
        r = rng.random()
        out[name] = None if r < 0.15 else 0 if r < 0.25 else int(
            rng.integers(1, b.spec.capacity + 1))
    return out


def test_arena_reuse_across_epochs(device: str, h: Any) -> None:
    setup = h.build_state(device, num_slots=2)
    st = setup.state
    rng = np.random.default_rng(10)
    arenas = [id(st._slot_groups[s][0].packed.arena) for s in range(2)]
    for step in range(12):
        st.begin()
        counts = _random_counts(setup, rng)
        # at least two active members so the packed path runs
        counts["input_ids"], counts["positions"] = 65 - step, step
        expected = _step(setup, h, rng, counts)
        st.finish()
        h.sync(device)
        for name, b in setup.buffers.items():
            assert torch.equal(h.dest_bytes(b), expected[name]), f"step {step} member {name}"
    assert [id(st._slot_groups[s][0].packed.arena) for s in range(2)] == arenas
    c = st.counters("decode")
    assert (c.dmas, c.scatters, c.publications, c.direct_fallbacks) == (12, 12, 12, 0)


def test_single_active_member_uses_direct_copy(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    rng = np.random.default_rng(11)
    st.begin()
    expected = _step(setup, h, rng, {"block_tables": 5})
    st.finish()
    h.sync(device)
    for name, b in setup.buffers.items():
        assert torch.equal(h.dest_bytes(b), expected[name]), name
    c = st.counters("decode")
    assert (c.dmas, c.direct_copies, c.direct_fallbacks) == (0, 1, 1)
    assert c.bytes == 5 * 24 * 4


def test_empty_publication(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    st.begin()
    before = {n: h.dest_bytes(b) for n, b in setup.buffers.items()}
    for b in setup.buffers.values():
        st.set_count(b, 0)
    st.publish("decode")
    st.finish()
    h.sync(device)
    for name, b in setup.buffers.items():
        assert torch.equal(h.dest_bytes(b), before[name])
    assert st.counters("decode").bytes == 0


def test_noncontiguous_binding_uses_direct_copies(device: str, h: Any) -> None:
    state = H2DRunnerState(device, backend="packed", scatter=h.scatter_mode(device))
    wide = torch.zeros((8, 2), dtype=torch.int32, device=device)
    a = state.buffer("strided", (8,), torch.int32, group="g", gpu=wide[:, 0])
    b = state.buffer("plain", (8,), torch.int32, group="g")
    state.bind()
    plan = state.plan("g")
    assert not plan.packed and "noncontiguous" in plan.why_direct and "strided" in plan.why_direct
    state.begin()
    a.np[:] = np.arange(8)
    b.np[:] = np.arange(8) * 3
    state.set_count(a, 6)
    state.set_count(b, 8)
    state.publish("g")
    state.finish()
    h.sync(device)
    assert wide[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert wide[:, 1].tolist() == [0] * 8
    assert b.gpu.tolist() == [0, 3, 6, 9, 12, 15, 18, 21]
    assert state.counters("g").dmas == 0 and state.counters("g").direct_copies == 2


def test_combined_group_has_one_arena_and_standalone_direct(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    # One packed arena per slot for the combined group; none for the covered groups.
    assert [r.plan.name for r in st._slot_groups[0]] == ["decode"]
    with pytest.raises(Exception, match="unknown group 'token_inputs'"):
        st.plan("token_inputs")
    rng = np.random.default_rng(12)
    st.begin()
    counts = {"input_ids": 9, "temperatures": 3, "cu_seqlens_q": 4}
    expected = _step(setup, h, rng, counts, group="token_inputs")
    # the other covered group can still be published standalone in the same epoch
    st.set_count(setup.buffers["positions"], 7)
    st.publish("mha_decode")
    st.finish()
    h.sync(device)
    for name in counts:
        assert torch.equal(h.dest_bytes(setup.buffers[name]), expected[name]), name
    assert st.counters("token_inputs").direct_copies == 3
    assert st.counters("decode").dmas == 0
    st.begin()
    with pytest.raises(Exception, match="already published"):
        st.publish("token_inputs")
        st.publish("decode")
    st.finish()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_equals_direct_byte_for_byte(device: str, h: Any, seed: int) -> None:
    packed = h.build_state(device, backend="packed", num_slots=2)
    direct = h.build_state(device, backend="direct", num_slots=2)
    assert packed.state.plan("decode").packed and not direct.state.plan("decode").packed
    rng_p, rng_d, rng_c = (np.random.default_rng(seed) for _ in range(3))
    for _ in range(8):
        counts = _random_counts(packed, rng_c)
        for setup, rng in ((packed, rng_p), (direct, rng_d)):
            setup.state.begin()
            _step(setup, h, rng, counts)
            setup.state.finish()
        h.sync(device)
        for name in packed.buffers:
            assert torch.equal(h.dest_bytes(packed.buffers[name]),
                               h.dest_bytes(direct.buffers[name])), name


def test_special_dtypes_round_trip(device: str, h: Any) -> None:
    members = [
        ("bf16", torch.bfloat16, (33,), "g", "elements"),
        ("f64", torch.float64, (9,), "g", "elements"),
        ("raw", torch.uint8, (37,), "g", "bytes"),
        ("i16", torch.int16, (5, 3), "g", "rows"),
    ]
    setup = h.build_state(device, members=members, combined=False)
    st = setup.state
    st.begin()
    bf = setup.buffers["bf16"]
    bf.cpu.view(torch.int16).copy_(torch.tensor(
        [0x7FC1, -0x7FFF - 1, 0x0001, 0x7F80, -0x0080] * 6 + [1, 2, 3], dtype=torch.int16))
    f64 = setup.buffers["f64"]
    f64.np[:] = [np.nan, -0.0, np.inf, -np.inf, 5e-324, 1.0, 2.0, 3.0, 4.0]
    f64.np.view(np.uint64)[0] = 0x7FF800000000BEEF  # NaN payload
    setup.buffers["raw"].np[:] = np.arange(37, dtype=np.uint8)
    setup.buffers["i16"].np[:] = np.arange(15, dtype=np.int16).reshape(5, 3) - 7
    before = {n: h.dest_bytes(b) for n, b in setup.buffers.items()}
    counts = {"bf16": 33, "f64": 9, "raw": 29, "i16": 4}
    for n, c in counts.items():
        st.set_count(setup.buffers[n], c)
    st.publish("g")
    st.finish()
    h.sync(device)
    for n, b in setup.buffers.items():
        assert torch.equal(h.dest_bytes(b), h.expected_bytes(b, b.cpu, counts[n], before[n])), n


def test_raw_byte_count_must_be_whole_elements(device: str, h: Any) -> None:
    state = H2DRunnerState(device, scatter=h.scatter_mode(device))
    b = state.buffer("plan", (8,), torch.int32, group="g", unit="bytes")
    state.bind()
    state.begin()
    with pytest.raises(Exception, match="byte count 6 is not a multiple of its element size 4"):
        state.set_count(b, 6)
    assert state.count(b) is None


def test_copy_to_gpu_is_a_checked_direct_copy(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    ids = setup.buffers["input_ids"]
    with pytest.raises(Exception, match="outside an epoch"):
        ids.copy_to_gpu(3)
    st.begin()
    ids.np[:] = np.arange(65)
    view = ids.copy_to_gpu(5)
    with pytest.raises(Exception, match="count 66 elements is outside"):
        ids.copy_to_gpu(66)
    # the copy published the group: the source may still be read by it
    with pytest.raises(DuplicatePublicationError, match="'token_inputs' was already published"):
        ids.copy_to_gpu(3)
    with pytest.raises(DuplicatePublicationError, match="already published"):
        st.publish("decode")
    st.finish()
    h.sync(device)
    assert view.tolist() == [0, 1, 2, 3, 4]
    assert view.data_ptr() == ids.gpu.data_ptr()
    assert st.counters("token_inputs").direct_copies == 1


# ---------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("events", ["driver", "torch"])
@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_delayed_source_reuse(h: Any, backend: str, events: str) -> None:
    """A slow GPU before the DMA: begin() of the same slot must wait before producers write,
    with the slots' driver events (h2d_core.launch) and with the torch-event fallback."""
    setup = h.build_state("cuda", backend=backend)
    st = setup.state
    assert st.completions.driver_events is not None  # the compiled helpers and libcuda are there
    if events == "torch":  # what a state without them uses
        st.completions.attach(None, [torch.cuda.Event() for _ in range(st.num_slots)])
    ids, pos = setup.buffers["input_ids"], setup.buffers["positions"]
    for step in range(3):
        st.begin()
        ids.np[:] = step * 100 + np.arange(65)
        pos.np[:] = step * 1000 + np.arange(64)
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU work ahead of the DMA
        st.set_count(ids, 65)
        st.set_count(pos, 64)
        st.publish("decode")
        st.finish()
        st.begin()  # must block until the DMA above read the sources
        assert st.last_source_wait_ns > 1_000_000, "begin() did not wait for the busy GPU"
        ids.np[:] = -1
        pos.np[:] = -1
        st.finish()
        torch.cuda.synchronize()
        assert ids.gpu.tolist() == (step * 100 + np.arange(65)).tolist(), f"step {step}"
        assert pos.gpu.tolist() == (step * 1000 + np.arange(64)).tolist(), f"step {step}"


@pytest.mark.gpu
def test_one_copy_and_one_kernel_per_group_in_profiler_trace(h: Any) -> None:
    from torch.profiler import ProfilerActivity, profile

    setup = h.build_state("cuda")
    st = setup.state
    rng = np.random.default_rng(13)
    for _ in range(3):  # warm up (compilation, graph capture)
        st.begin()
        _step(setup, h, rng, {n: 1 for n in setup.buffers})
        st.finish()
    st.begin()
    for b in setup.buffers.values():
        h.fill_random(b, rng)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in setup.buffers.values():
            st.set_count(b, b.spec.capacity)
        st.publish("decode")
        st.finish()
        torch.cuda.synchronize()
    # the profiler mirrors record_function ranges on the GPU timeline: not device work
    names = [e.name for e in prof.events()
             if e.device_type.name == "CUDA" and not e.name.startswith("h2d.")]
    # copies by the runtime's kind (ROCm's HIP kind=1 even where the name says DtoD)
    assert copy_counts(prof) == Counter({"H2D": 1}), names
    kernels = [n for n in names if not is_copy(n) and "Memset" not in n]
    assert len(kernels) == 1, names
    assert any(e.name == "h2d.publish/decode" for e in prof.events())


# ---------------------------------------------------------------------------- placements

BIG_MEMBERS = [
    ("temperatures", torch.float32, (64,), "g", "elements"),
    ("context_lens", torch.int32, (64,), "g", "elements"),
    ("input_ids", torch.int32, (20_000,), "g", "elements"),      # staged (80 KB)
    ("positions", torch.int64, (20_000,), "g", "elements"),      # staged (160 KB)
    ("block_tables", torch.int32, (64, 256), "g", "rows"),       # tail (64 KB)
]


def test_large_members_are_staged_or_tail_and_unused_capacity_stays_home(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from h2d_kernels import Placement, placement_of

    setup = h.build_state(device, members=BIG_MEMBERS, combined=False)
    st = setup.state
    b = setup.buffers
    places = {m.name: placement_of(m) for m in st._slot_groups[0][0].packed.members}
    assert [places[n] for n in ("temperatures", "input_ids", "block_tables")] == [
        Placement.INPLACE, Placement.STAGED, Placement.TAIL]
    assert [m.name for m in st.plan("g").members] == [
        "temperatures", "context_lens", "input_ids", "positions", "block_tables"]
    slot = st._slot_groups[0][0].packed
    seen = h.spy_dma(monkeypatch, slot)
    rng = np.random.default_rng(20)
    for step, (ids, rows) in enumerate([(8, None), (300, 5), (20_000, 64), (1, 0)]):
        st.begin()
        counts = {"temperatures": 8, "context_lens": 8, "input_ids": ids, "positions": ids,
                  "block_tables": rows}
        expected = _step(setup, h, rng, counts, group="g")
        st.finish()
        h.sync(device)
        for name, buf in b.items():
            assert torch.equal(h.dest_bytes(buf), expected[name]), (step, name)
        # the DMA ends at the staged bytes unless the table (tail) travels
        if rows:
            assert seen[-1] == slot.offsets[4] + rows * 256 * 4
        else:
            used = slot.staging_offset + 2 * 16 + ((ids * 4 + 15) // 16 + (ids * 8 + 15) // 16) * 16
            assert seen[-1] <= used, (step, seen[-1], used)


def _ranged_state(device: str, h: Any, backend: str = "packed") -> Any:
    members = [
        ("context_lens", torch.int32, (64,), "g", "elements"),
        ("slot_mapping", torch.int64, (64,), "g", "elements"),
    ]
    setup = h.build_state(device, members=members, combined=False, backend=backend,
                          )
    return setup


def _build_ranged(device: str, h: Any, backend: str = "packed") -> Any:
    st = H2DRunnerState(device, backend=backend, scatter=h.scatter_mode(device))
    bufs = {
        "context_lens": st.buffer("context_lens", (64,), torch.int32, group="g"),
        "block_tables": st.buffer("block_tables", (64, 128), torch.int32, group="g",
                                  unit="rows", max_ranges=8),
    }
    st.bind()
    for b in bufs.values():
        b.gpu.view(torch.uint8).fill_(h.POISON)

    class S:
        state = st
        buffers = bufs

    return S


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_ranges_publish_only_those_bytes(device: str, h: Any, backend: str) -> None:
    setup = _build_ranged(device, h, backend)
    st, bt, cl = setup.state, setup.buffers["block_tables"], setup.buffers["context_lens"]
    rng = np.random.default_rng(21)
    row = 128 * 4
    ranges = [(0, 16), (3 * row + 40, 3 * row + 48), (10 * row, 12 * row)]
    st.begin()
    h.fill_random(bt, rng)
    h.fill_random(cl, rng)
    before = h.dest_bytes(bt)
    st.set_ranges(bt, ranges)
    st.set_count(cl, 9)
    st.publish("g")
    st.finish()
    h.sync(device)
    expect = before.clone()
    src = bt.cpu.reshape(-1).view(torch.uint8)
    # packed: only the ranges travel (one DMA); direct: the spec's bulk rule, one copy of
    # the span from the first range to the last, never one copy per range
    spans = ranges if backend == "packed" else [(ranges[0][0], ranges[-1][1])]
    for a, z in spans:
        expect[a:z] = src[a:z]
    assert torch.equal(h.dest_bytes(bt), expect)
    assert torch.equal(h.dest_bytes(bt)[12 * row :], before[12 * row :])  # tail untouched
    assert torch.equal(cl.gpu[:9].cpu(), cl.cpu[:9])
    c = st.counters("g")
    assert c.bytes == sum(z - a for a, z in spans) + 9 * 4
    if backend == "packed":
        assert (c.dmas, c.direct_copies) == (1, 0)
    else:
        assert (c.dmas, c.direct_copies) == (0, 2)  # one per member: the table in bulk
    # a single member with a single range: one direct copy
    st.begin()
    st.set_ranges(bt, [(row, 2 * row)])
    st.publish("g")
    st.finish()
    assert c.direct_copies == (1 if backend == "packed" else 3)


def test_direct_backend_changed_table_is_one_bulk_copy(device: str, h: Any) -> None:
    """Spec: "Changed tables still use one bulk publication; this does not add partial H2D
    transfers." A block table with changed rows scattered over the table goes as one copy
    on the direct backend, through block_table_state as through set_ranges."""
    from h2d_core import block_table_state

    setup = _build_ranged(device, h, "direct")
    st, bt = setup.state, setup.buffers["block_tables"]
    tables = block_table_state(bt)
    rows = [list(range(r * 8, r * 8 + 8)) for r in range(40)]
    st.begin()
    tables.prepare(rows)
    assert tables.stage(40) == "whole"
    st.publish("g")
    st.finish()
    h.sync(device)
    for changed in ([3], [2, 17, 33], list(range(0, 40, 5))):
        before = st.counters("g").direct_copies
        for r in changed:
            rows[r] = [*rows[r][:7], 9000 + r]
        st.begin()
        tables.prepare(rows)
        tables.stage(40)
        st.publish("g")
        st.finish()
        h.sync(device)
        assert st.counters("g").direct_copies == before + 1, changed
        assert torch.equal(bt.gpu[:40].cpu(), bt.cpu[:40])
    # explicit ranges on the direct backend: one copy for three ranges
    row = 128 * 4
    before = st.counters("g").direct_copies
    st.begin()
    st.set_ranges(bt, [(0, 16), (5 * row, 5 * row + 4), (20 * row, 21 * row)])
    st.publish("g")
    st.finish()
    assert st.counters("g").direct_copies == before + 1


@pytest.mark.parametrize(
    ("ranges", "match"),
    [
        ([(0, 4)] * 9, "9 ranges exceed its max_ranges=8"),
        ([(8, 16), (0, 4)], r"range 1 \[0, 4\) must be non-empty, sorted"),
        ([(4, 4)], "must be non-empty"),
        ([(0, 64 * 128 * 4 + 4)], "inside"),
        ([(2, 8)], "splits a 4-byte element"),
        ([(0, 20_000)], "exceed the group's staging room"),
        ([(0.0, 4)], "must be two ints"),
    ],
)
def test_bad_ranges_rejected_and_nothing_changes(device: str, h: Any, ranges: Any,
                                                 match: str) -> None:
    setup = _build_ranged(device, h)
    st, bt = setup.state, setup.buffers["block_tables"]
    st.begin()
    st.set_count(bt, 2)
    rec = st._slot_groups[0][0]
    before = (list(rec.counts), list(rec.ranges), rec.active, rec.packed.header.copy())
    with pytest.raises(Exception, match=match) as err:
        st.set_ranges(bt, ranges)
    assert "'block_tables'" in str(err.value)
    assert (list(rec.counts), list(rec.ranges), rec.active) == before[:3]
    assert np.array_equal(rec.packed.header, before[3])


def test_count_after_ranges_is_rejected(device: str, h: Any) -> None:
    setup = _build_ranged(device, h)
    st, bt = setup.state, setup.buffers["block_tables"]
    st.begin()
    st.set_ranges(bt, [(0, 8)])
    with pytest.raises(Exception, match="count or ranges, not both"):
        st.set_count(bt, 3)
    assert st._slot_groups[0][0].ranges == [(1, 0, 8)]
    st.set_count(bt, None)  # None omits the member: its ranges go too
    rec = st._slot_groups[0][0]
    assert (rec.ranges, rec.active, rec.counts[1]) == ([], 0, None)


def test_producer_group_carried_by_two_combined_groups(device: str, h: Any) -> None:
    st = H2DRunnerState(device, scatter=h.scatter_mode(device))
    bufs = {
        "temperatures": st.buffer("temperatures", (64,), torch.float32, group="tokens"),
        "input_ids": st.buffer("input_ids", (20_000,), torch.int32, group="tokens"),
        "slots": st.buffer("slots", (64,), torch.int64, group="mha_decode"),
        "cu_k": st.buffer("cu_k", (65,), torch.int32, group="prefill_inputs"),
    }
    st.combine("decode", ["tokens", "mha_decode"])
    st.combine("prefill", ["tokens", "prefill_inputs"])
    st.bind()
    for b in bufs.values():
        b.gpu.view(torch.uint8).fill_(h.POISON)
    assert st.plan("decode").borrowed == frozenset()
    assert st.plan("prefill").borrowed == {"temperatures", "input_ids"}
    # one source per buffer, living in its primary (first) group's arena
    assert len(bufs["temperatures"].homes) == 2
    rng = np.random.default_rng(30)

    class Setup:
        state = st
        buffers = bufs

    for group, counts in (("decode", {"temperatures": 5, "input_ids": 5, "slots": 5}),
                          ("prefill", {"temperatures": 3, "input_ids": 900, "cu_k": 4}),
                          ("decode", {"temperatures": 64, "input_ids": 1, "slots": 64})):
        st.begin()
        expected = _step(Setup, h, rng, counts, group=group)
        st.finish()
        h.sync(device)
        for name, b in bufs.items():
            assert torch.equal(h.dest_bytes(b), expected[name]), (group, name)
    assert (st.counters("decode").dmas, st.counters("prefill").dmas) == (2, 1)
    st.begin()
    st.set_count(bufs["temperatures"], 1)
    st.set_count(bufs["slots"], 1)
    st.publish("decode")
    with pytest.raises(Exception, match=r"\['tokens'\] already published"):
        st.publish("prefill")
    st.reopen("tokens", reason="prefill after decode in one epoch")
    assert st.count(bufs["temperatures"]) is None
    st.set_count(bufs["temperatures"], 2)
    st.set_count(bufs["cu_k"], 2)
    st.publish("prefill")
    st.finish()
