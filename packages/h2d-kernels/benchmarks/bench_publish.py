"""Packed publication on one GPU: host and GPU cost per step against ten direct copies.

Cases and members are those of ``shared/context/floor_bench.py`` (five batch
sizes, ten members). Per case, in one run:

- ``direct``: ten ``gpu.copy_(pinned, non_blocking=True)``, the baseline;
- ``lean``/``compiled_torchdma``/``graph``/``jit``: write the header's counts,
  then ``PackedArena.publish`` through each launch path (sources are written
  in place, so nothing is packed);
- ``lean_pack``: the default path plus one numpy copy per member into the
  arena, for reference.

Host µs: median of perf_counter around each step. GPU µs/step: CUDA events
around the whole loop, divided by steps (host-bound loops read as host time).
GPU span: DMA start to scatter end of one publication, measured with events
around each publication while the stream is held back by ``torch.cuda._sleep``
so the GPU runs them back to back without host gaps.

Scatter bandwidth: one member of 1 MB / 16 MB, the scatter alone against a
device-to-device ``copy_`` of the same bytes, both replayed from CUDA graphs of
20 launches (bytes read + written per second), for several kernel shapes.

Usage: ``python3 bench_publish.py --out DIR`` (JSON to DIR/bench_publish.json;
a short table is printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import triton

from h2d_kernels import DEFAULT_LAUNCH, ArenaMember, PackedArena, ScatterConfig, plan_arena
from h2d_kernels.driver import device_driver
from h2d_kernels.scatter import CompiledScatter

CASES = [(1, 16), (8, 64), (64, 128), (256, 128), (512, 512)]
# (chunk_bytes, num_warps, programs per SM): the first is the package default.
SHAPES = [(8192, 4, 4), (4096, 4, 4), (16384, 8, 4), (8192, 4, 8), (8192, 4, 2), (32768, 8, 2)]


def members(bs: int, pages: int) -> list[tuple[str, np.dtype[Any], int]]:
    """(name, dtype, numel) of a plain MHA decode step + token inputs (as floor_bench.py)."""
    i32, i64, f32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)
    return [
        ("input_ids", i32, bs),
        ("positions", i64, bs),
        ("cu_seqlens_q", i32, bs + 1),
        ("temperature", f32, bs),
        ("top_k", i32, bs),
        ("top_p", f32, bs),
        ("slot_mapping", i64, bs),
        ("context_lens", i32, bs),
        ("block_tables", i32, bs * pages),
        ("kv_prefix", i32, bs + 1),
    ]


def timeit(
    fn: Callable[[], object], steps: int, warmup: int, gap_us: float = 0.0
) -> dict[str, float]:
    """Host µs per call; ``gap_us`` of busy host time between calls lets the GPU keep up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = np.empty(steps)
    gap = int(gap_us * 1e3)
    e0.record()
    for i in range(steps):
        t = time.perf_counter_ns()
        if gap:
            while time.perf_counter_ns() - t < gap:
                pass
            t = time.perf_counter_ns()
        fn()
        host[i] = time.perf_counter_ns() - t
    e1.record()
    torch.cuda.synchronize()
    return {
        "host_us_median": float(np.median(host)) / 1e3,
        "host_us_p90": float(np.percentile(host, 90)) / 1e3,
        "gpu_us_per_step": e0.elapsed_time(e1) * 1e3 / steps,
    }


def gpu_span(fn: Callable[[], object], reps: int = 50) -> dict[str, float]:
    """Median / p90 GPU µs from just before one publication's DMA to its scatter's end."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(20_000_000)  # ~10 ms: the host enqueues everything before the GPU starts
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    spans = np.array([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)])
    return {
        "gpu_span_us_median": float(np.median(spans)),
        "gpu_span_us_p90": float(np.percentile(spans, 90)),
    }


def graph_time_us(fn: Callable[[], object], launches: int = 20, reps: int = 20) -> float:
    """GPU µs per ``fn`` from replays of a graph holding ``launches`` calls (median of reps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / launches)
    return float(np.median(times))


def config_for(shape: tuple[int, int, int]) -> ScatterConfig:
    chunk, warps, per_sm = shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return ScatterConfig(chunk_bytes=chunk, num_warps=warps, max_programs=sms * per_sm)


def bench_case(bs: int, pages: int, steps: int, warmup: int) -> dict[str, Any]:
    spec = members(bs, pages)
    rng = np.random.default_rng(bs)
    cpu = [torch.from_numpy(rng.integers(0, 1000, n).astype(d)).pin_memory() for _, d, n in spec]
    gpu = [torch.zeros_like(c, device="cuda") for c in cpu]
    total = sum(c.numel() * c.element_size() for c in cpu)
    res: dict[str, Any] = {"bs": bs, "pages": pages, "bytes": total, "members": len(cpu)}

    def direct() -> None:
        for c, g in zip(cpu, gpu, strict=True):
            g.copy_(c, non_blocking=True)

    res["direct"] = timeit(direct, steps, warmup) | gpu_span(direct)

    layout = plan_arena(
        [
            ArenaMember(n, c.numel() * c.element_size(), d.itemsize)
            for (n, d, _), c in zip(spec, cpu, strict=True)
        ]
    )
    counts = np.array([c.numel() * c.element_size() for c in cpu], dtype=np.int64)
    sources = [c.numpy().view(np.uint8).reshape(-1) for c in cpu]

    def make(launch: str, dma: str, config: ScatterConfig | None = None) -> PackedArena:
        for g in gpu:
            g.zero_()
        arena = PackedArena(layout, gpu, launch=launch, dma=dma, config=config)  # type: ignore[arg-type]
        for i, src in enumerate(sources):
            arena.payload_np(i)[:] = src  # producers write in place
        h = arena.header_np
        for r in layout.regions:
            h[r.index] = (r.offset, r.capacity_bytes, r.index, 0)
        return arena

    dma_bytes = layout.regions[-1].end

    def check(arena: PackedArena, name: str) -> None:
        torch.cuda.synchronize()
        res[name]["correct"] = all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu, strict=True))

    variants = {
        "lean": (DEFAULT_LAUNCH, "driver"),
        "compiled_torchdma": ("compiled", "torch"),
        "graph": ("graph", "driver"),
        "jit": ("jit", "torch"),
    }
    for name, (launch, dma) in variants.items():
        arena = make(launch, dma)
        header, publish = arena.header_np, arena.publish

        def step(header: np.ndarray = header, publish: Callable[..., None] = publish) -> None:
            header[:, 1] = counts  # this step's counts
            publish(dma_bytes)

        res[name] = timeit(step, steps, warmup) | gpu_span(step)
        res[name]["launch"], res[name]["dma"] = arena.launch, arena.dma
        check(arena, name)

    arena = make(DEFAULT_LAUNCH, "driver")
    views = [arena.payload_np(i) for i in range(len(sources))]
    header, publish = arena.header_np, arena.publish

    def packed() -> None:
        for v, s in zip(views, sources, strict=True):
            np.copyto(v, s)
        header[:, 1] = counts
        publish(dma_bytes)

    res["lean_pack"] = timeit(packed, steps, warmup) | gpu_span(packed)
    check(arena, "lean_pack")

    # Where the time goes: each piece alone, host µs with the GPU kept idle-ready
    # (100 µs host gap between calls) and its GPU span.
    arena = make(DEFAULT_LAUNCH, "driver")
    header, publish = arena.header_np, arena.publish
    driver = device_driver()
    assert driver is not None
    raw_stream = partial(torch._C._cuda_getCurrentRawStream, 0)
    dev_addr, host_addr = arena.device_arena.data_ptr(), arena.host.data_ptr()
    config = arena.config
    grid = config.grid(dma_bytes, layout.num_ranges)
    scatter = CompiledScatter(arena.device_arena, arena.dest_table, layout.num_ranges, config)
    # Zero-copy comparison (outside the one-DMA contract): the same kernel reading
    # header and payload straight from the pinned host arena through UVA.
    uva = CompiledScatter(arena.host, arena.dest_table, layout.num_ranges, config)

    def header_only() -> None:
        header[:, 1] = counts

    def publish_only() -> None:
        publish(dma_bytes)

    def dma_only() -> None:
        driver.memcpy_htod_async(dev_addr, host_addr, dma_bytes, raw_stream())

    def scatter_only() -> None:
        scatter.launch(grid, raw_stream())

    def uva_step() -> None:
        header[:, 1] = counts
        uva.launch(grid, raw_stream())

    pieces: dict[str, Callable[[], object]] = {
        "events_only": lambda: None,
        "header_write": header_only,
        "publish_call": publish_only,
        "dma_alone": dma_only,
        "scatter_alone": scatter_only,
        "uva_zero_copy": uva_step,
        "direct_spaced": direct,
    }
    res["breakdown"] = {}
    for name, fn in pieces.items():
        spaced = timeit(fn, steps // 2, warmup, gap_us=100.0)
        res["breakdown"][name] = {"host_us_spaced": spaced["host_us_median"]} | gpu_span(fn)
    for g in gpu:
        g.zero_()
    uva_step()
    torch.cuda.synchronize()
    res["breakdown"]["uva_zero_copy"]["correct"] = all(
        torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu, strict=True)
    )
    for name, (launch, dma) in variants.items():
        arena = make(launch, dma)
        header, publish = arena.header_np, arena.publish

        def step2(header: np.ndarray = header, publish: Callable[..., None] = publish) -> None:
            header[:, 1] = counts
            publish(dma_bytes)

        res[name]["host_us_spaced"] = timeit(step2, steps // 2, warmup, gap_us=100.0)[
            "host_us_median"
        ]
    res["direct"]["host_us_spaced"] = res["breakdown"]["direct_spaced"]["host_us_spaced"]

    # GPU span of the default path under each kernel shape (grid size matters for small work).
    res["span_by_shape"] = {}
    for shape in SHAPES:
        arena = make(DEFAULT_LAUNCH, "driver", config_for(shape))
        res["span_by_shape"][str(shape)] = gpu_span(partial(arena.publish, dma_bytes))
    return res


def bench_bandwidth(nbytes: int, shape: tuple[int, int, int]) -> dict[str, Any]:
    config = config_for(shape)
    dest = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    layout = plan_arena([ArenaMember("payload", nbytes, 1)])
    arena = PackedArena(layout, [dest], launch="compiled", dma="driver", config=config)
    arena.payload_np(0)[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    arena.header_np[0] = (layout.payload_offset(0), nbytes, 0, 0)
    arena.publish(layout.total_bytes)
    torch.cuda.synchronize()
    correct = bool((dest.cpu().numpy() == arena.payload_np(0)).all())
    scatter = CompiledScatter(arena.device_arena, arena.dest_table, 1, config)
    grid = config.grid(layout.total_bytes, 1)
    stream = torch.cuda.current_stream
    scatter_us = graph_time_us(lambda: scatter(grid, stream().cuda_stream))
    src = arena.device_arena[layout.payload_offset(0) : layout.payload_offset(0) + nbytes]
    d2d_us = graph_time_us(lambda: dest.copy_(src))
    publish_span = gpu_span(lambda: arena.publish(layout.total_bytes))
    gbps = lambda us: 2 * nbytes / (us * 1e-6) / 1e9  # noqa: E731  (read + write)
    return {
        "bytes": nbytes,
        "shape": list(shape),
        "grid": grid,
        "correct": correct,
        "scatter_us": scatter_us,
        "d2d_us": d2d_us,
        "scatter_GBps": gbps(scatter_us),
        "d2d_GBps": gbps(d2d_us),
        "ratio": d2d_us / scatter_us,
        "publish_span": publish_span,
    }


def dma_sweep() -> list[dict[str, Any]]:
    """GPU span of one pinned H2D copy by size (where the copy engine's latency starts)."""
    driver = device_driver()
    assert driver is not None
    host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    out = []
    for size in (64, 256, 1024, 2048, 4096, 8192, 16384, 65536, 1 << 20):
        fn = partial(
            driver.memcpy_htod_async,
            dev.data_ptr(),
            host.data_ptr(),
            size,
            torch.cuda.current_stream().cuda_stream,
        )
        # The whole publication (DMA + scatter, default path) of one member of ``size`` bytes.
        dest = torch.zeros(size, dtype=torch.uint8, device="cuda")
        layout = plan_arena([ArenaMember("payload", size, 1)])
        arena = PackedArena(layout, [dest])
        arena.header_np[0] = (layout.payload_offset(0), size, 0, 0)
        publish = partial(arena.publish, layout.regions[0].end)
        out.append({"bytes": size, "dma": gpu_span(fn), "publish": gpu_span(publish)})
    return out


def graph_launcher() -> str | None:
    dest = torch.zeros(16, dtype=torch.uint8, device="cuda")
    return PackedArena(plan_arena([ArenaMember("x", 16, 1)]), [dest], launch="graph").graph_launcher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.cuda.init()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "default_launch": DEFAULT_LAUNCH,
        "graph_launcher": graph_launcher(),
        "shapes": SHAPES,
    }
    print(json.dumps(meta), flush=True)
    cases = []
    for bs, pages in CASES:
        r = bench_case(bs, pages, args.steps, args.warmup)
        cases.append(r)
        print(json.dumps(r), flush=True)
    sweep = dma_sweep()
    print(json.dumps(sweep), flush=True)
    bandwidth = []
    for nbytes in (1 << 20, 16 << 20):
        for shape in SHAPES:
            b = bench_bandwidth(nbytes, shape)
            bandwidth.append(b)
            print(json.dumps(b), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_publish.json"), "w") as f:
        json.dump(
            {"meta": meta, "cases": cases, "dma_sweep": sweep, "bandwidth": bandwidth}, f, indent=1
        )

    def hg(r: dict[str, Any]) -> str:
        return f"{r['host_us_median']:.1f}/{r['gpu_us_per_step']:.1f}/{r['gpu_span_us_median']:.1f}"

    print("\nhost µs median / GPU µs per step / GPU span µs (DMA start -> scatter end)")
    names = ["direct", "lean", "compiled_torchdma", "graph", "jit", "lean_pack"]
    print("bs pages bytes | " + " | ".join(names) + " | ok")
    for r in cases:
        ok = all(r[n].get("correct", True) for n in names)
        print(r["bs"], r["pages"], r["bytes"], "|", " | ".join(hg(r[n]) for n in names), "|", ok)
    print("\nhost µs with a 100 µs gap between steps (GPU not saturated)")
    print("bs | " + " | ".join(names[:-1]))
    for r in cases:
        print(r["bs"], "|", " | ".join(f"{r[n]['host_us_spaced']:.1f}" for n in names[:-1]))
    print("\nbreakdown: host µs (spaced) / GPU span µs")
    keys = list(cases[0]["breakdown"])
    print("bs | " + " | ".join(keys))
    for r in cases:
        b = r["breakdown"]
        cells = [f"{b[k]['host_us_spaced']:.1f}/{b[k]['gpu_span_us_median']:.1f}" for k in keys]
        print(r["bs"], "|", " | ".join(cells), "| uva ok", b["uva_zero_copy"]["correct"])
    print("\nDMA alone, GPU span µs by size:")
    print(" ".join(f"{d['bytes']}:{d['dma']['gpu_span_us_median']:.1f}" for d in sweep))
    print("one-member publication (DMA + scatter), GPU span µs by payload size:")
    print(" ".join(f"{d['bytes']}:{d['publish']['gpu_span_us_median']:.1f}" for d in sweep))
    print("\nspan µs of the default path by shape (chunk, warps, programs/SM)")
    for r in cases:
        spans = " ".join(
            f"{k}:{v['gpu_span_us_median']:.1f}" for k, v in r["span_by_shape"].items()
        )
        print(r["bs"], spans)
    print("\nbytes shape grid | scatter µs GB/s | d2d µs GB/s | ratio | ok")
    for b in bandwidth:
        print(
            b["bytes"],
            b["shape"],
            b["grid"],
            "|",
            f"{b['scatter_us']:.2f} {b['scatter_GBps']:.0f}",
            "|",
            f"{b['d2d_us']:.2f} {b['d2d_GBps']:.0f}",
            "|",
            f"{b['ratio']:.2f}",
            "|",
            b["correct"],
        )


if __name__ == "__main__":
    main()
