"""Device benchmarks of publication through the public APIs (issues 4 and 5).

``core``: the ten-member decode-like group of ``shared/context/floor-h200.md`` through
``H2DRunnerState`` (begin, ten ``set_count`` calls, publish, finish; validation included),
packed against direct in the same run; H2D copies and kernels per publication counted from
a ``torch.profiler`` trace.

``decode``: a plain-MHA decode step through the runner adapters (sampling, token inputs,
MHA decode with block-table state; one combined group) on steady batches where 1/16 of the
rows append a page, for batch sizes 1, 8, 64, 256 and 4K / 128K contexts, packed against one
copy per field in the same run: host µs for preparation + publication, GPU µs from the first
publication work to the end of the first consumer (KV-index generation; measured with the
GPU kept busy while the host enqueues, so it is device time, not host launch gaps), and
copies and kernels per step from a profiler trace. Variants (``VARIANTS``): the fused
producer (``DecodeStepInputs``) packed and direct, the adapters' separate producers
packed and direct, and "atom", the shared ATOM-style step (``peers/atom_style.py`` through
``decode_runner/atom_style.py``, into the same destinations): per-row full-width
block-table rebuild from the scheduler's Python page lists (kept outside the timed step,
as an engine keeps them) plus one copy per field. Host µs exclude the wait for source reuse
(``begin()``'s, or the ATOM-style step's wait for a free pinned set: GPU-bound steps),
which is reported apart.

    python benchmarks/publication_bench.py [core|decode|all] [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
from repo_paths import use_sources  # noqa: E402

use_sources()

from trace_counts import count_per_step  # noqa: E402

from h2d_core import H2DRunnerState  # noqa: E402
from h2d_runner_adapters import DecodeStepInputs, ScheduledBatch, StepShape  # noqa: E402

#: decode-step variants, all in the same run: "packed" / "direct" = the fused producer
#: (DecodeStepInputs) with packed publication / one copy per field; "separate" /
#: "separate-direct" = the three adapters' own producers, called one by one;
#: "atom" = the shared ATOM-style step: per-row full-width rebuild + one copy per field
VARIANTS = ("packed", "direct", "separate", "separate-direct", "atom")
#: ~0.4 ms of GPU sleep before a measured span (longer than the host's enqueue of a step)
SPAN_DELAY_CYCLES = 800_000
FLOOR_CASES = [(1, 16), (8, 64), (64, 128), (256, 128), (512, 512)]


def _floor_members(bs: int, pages: int) -> list[tuple[str, torch.dtype, tuple[int, ...], str]]:
    return [
        ("input_ids", torch.int32, (bs,), "elements"),
        ("positions", torch.int64, (bs,), "elements"),
        ("cu_seqlens_q", torch.int32, (bs + 1,), "elements"),
        ("temperature", torch.float32, (bs,), "elements"),
        ("top_k", torch.int32, (bs,), "elements"),
        ("top_p", torch.float32, (bs,), "elements"),
        ("slot_mapping", torch.int64, (bs,), "elements"),
        ("context_lens", torch.int32, (bs,), "elements"),
        ("block_tables", torch.int32, (bs, pages), "rows"),
        ("kv_prefix", torch.int32, (bs + 1,), "elements"),
    ]


def bench_core(steps: int) -> list[dict]:
    out = []
    for bs, pages in FLOOR_CASES:
        for backend in ("packed", "direct"):
            st = H2DRunnerState("cuda", backend=backend)
            bufs = [st.buffer(n, shape, dt, group="decode", unit=u)
                    for n, dt, shape, u in _floor_members(bs, pages)]
            st.bind()
            rng = np.random.default_rng(0)
            st.begin()
            for b in bufs:
                b.np[...] = rng.integers(0, 1000, b.np.shape)
            st.finish()
            counts = [b.spec.capacity for b in bufs]

            def step() -> None:
                st.begin()
                for b, c in zip(bufs, counts, strict=True):
                    st.set_count(b, c)
                st.publish("decode")
                st.finish()

            for _ in range(30):
                step()
            torch.cuda.synchronize()
            host = []
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(steps):
                t = time.perf_counter_ns()
                step()
                host.append((time.perf_counter_ns() - t) / 1e3)
            e1.record()
            torch.cuda.synchronize()
            r = {"bs": bs, "pages": pages, "backend": backend,
                 "bytes": sum(b.spec.nbytes for b in bufs),
                 "host_us_median": float(np.median(host)),
                 "host_us_p90": float(np.percentile(host, 90)),
                 "gpu_us_per_step": e0.elapsed_time(e1) * 1e3 / steps,
                 **count_per_step(step, 10)}
            out.append(r)
            print(json.dumps(r), flush=True)
    return out


def bench_decode(steps: int, contexts: list[int], sizes: list[int]) -> list[dict]:
    from decode_runner.atom_style import AtomStyleDecode
    from decode_runner.scheduler import steady_decode_batches

    page, window = 16, 256
    out = []
    for context in contexts:
        for bs in sizes:
            per_row = -(-(context + page - 1 + window) // page)
            gen = steady_decode_batches(bs, context, page, window=window)
            batches = []
            for _ in range(40 + 3 * steps + 10):
                b = next(gen)
                b.columns, b.block_tables  # noqa: B018  (built outside the timed region)
                batches.append(b)
            for backend in VARIANTS:
                st = H2DRunnerState("cuda", backend="direct" if backend in (
                    "direct", "atom", "separate-direct") else "packed")
                fused = backend in ("packed", "direct")
                step_inputs = DecodeStepInputs(st,
                                               StepShape(max_reqs=bs, max_tokens=bs,
                                                         max_pages_per_req=per_row, page_size=page),
                                               fuse_kv_indices=False)
                sampling, tokens, decode = (step_inputs.sampling, step_inputs.tokens,
                                            step_inputs.decode)
                st.bind()
                # the ATOM-style way writes the same destinations; the library only owns them
                atom = AtomStyleDecode(step_inputs, page_size=page) if backend == "atom" else None
                prev = torch.zeros(bs, 1, dtype=torch.int32, device="cuda")
                it = iter(batches)
                events: list = []
                waits: list[float] = []

                def step(record: bool = False) -> float:
                    b = next(it)
                    if atom is not None:
                        return atom_step(b, record)
                    t = time.perf_counter_ns()
                    st.begin()
                    if fused:
                        plan = step_inputs.prepare(b)
                        tp, dp = plan.tokens, plan.decode
                    else:
                        sampling.prepare(b)
                        tp = tokens.prepare_ids(b)
                        tokens.prepare_query_prefix(b)
                        dp = decode.prepare(b)
                    if record:
                        ev = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                        # keep the GPU busy while the host enqueues, so the span measures
                        # device work (DMA, scatter, consumers), not host launch gaps
                        torch.cuda._sleep(SPAN_DELAY_CYCLES)
                        ev[0].record()
                    st.publish("decode_step")
                    st.finish()
                    # host work only: begin()'s wait for source reuse (the GPU still busy
                    # with the previous step) is GPU time, reported apart
                    waits.append(st.last_source_wait_ns / 1e3)
                    host = (time.perf_counter_ns() - t - st.last_source_wait_ns) / 1e3
                    tokens.assemble(tp, prev)
                    decode.generate_kv_indices(dp)
                    if record:
                        ev[1].record()
                        events.append(ev)
                    return host

                def atom_step(b: ScheduledBatch, record: bool) -> float:
                    assert atom is not None
                    atom.sync_lists(b)  # the scheduler's list upkeep: outside the timed step
                    t = time.perf_counter_ns()
                    _, tp, dp = atom.stage(b, None)
                    if record:
                        ev = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                        torch.cuda._sleep(SPAN_DELAY_CYCLES)
                        ev[0].record()
                    atom.copy()
                    waits.append(atom.last_wait_ns / 1e3)
                    host = (time.perf_counter_ns() - t - atom.last_wait_ns) / 1e3
                    tokens.assemble(tp, prev)
                    decode.generate_kv_indices(dp)
                    if record:
                        ev[1].record()
                        events.append(ev)
                    return host

                for _ in range(40):
                    step()
                torch.cuda.synchronize()
                host = [step() for _ in range(steps)]
                for _ in range(steps):
                    step(record=True)
                torch.cuda.synchronize()
                span = [a.elapsed_time(b) * 1e3 for a, b in events]
                c = st.counters("decode_step")
                r = {"context": context, "bs": bs, "backend": backend,
                     "host_us_median": float(np.median(host)),
                     "host_us_p90": float(np.percentile(host, 90)),
                     "gpu_span_us_median": float(np.median(span)),
                     "source_wait_us_median": float(np.median(waits)),
                     "bytes_per_step": (atom.step.last_bytes if atom is not None
                                        else c.bytes / max(c.publications, 1)),
                     **count_per_step(step, 8)}
                out.append(r)
                print(json.dumps(r), flush=True)
    return out


def bench_crossover(steps: int) -> list[dict]:
    """Partial (changed spans as ranges) against whole-table publication of the block
    table, by how many rows change per step, for appends and for replaced rows."""
    from block_tables import BlockTable
    from h2d_core import block_table_state

    bs, page = 256, 16
    out = []
    for context in (4096, 32768):
        width = context // page + 64
        for mode in ("append", "replace"):
            for k in (1, 4, 16, 64, 256):
                if mode == "replace" and k > 64:
                    continue  # a quarter of the table is the staging room
                for policy in ("partial", "whole"):
                    st = H2DRunnerState("cuda")
                    lens = st.buffer("context_lens", (bs,), torch.int32, group="g")
                    bt = st.buffer("block_tables", (bs, width), torch.int32, group="g",
                                   unit="rows", max_ranges=bs)
                    st.bind()
                    tables_state = block_table_state(
                        bt, partial_max_share=1.0 if policy == "partial" else 0.0,
                        partial_max_ranges=bs)
                    rng = np.random.default_rng(0)
                    rows = [BlockTable(rng.integers(0, 1 << 20, context // page))
                            for _ in range(bs)]
                    pick = np.arange(bs)

                    def step(record: list | None = None) -> float:
                        for r in rng.choice(pick, k, replace=False).tolist():
                            if mode == "append":
                                if len(rows[r]) >= width:
                                    rows[r].truncate(context // page)
                                rows[r].append_one(int(rng.integers(0, 1 << 20)))
                            else:
                                rows[r] = BlockTable(rng.integers(0, 1 << 20, context // page))
                        if record is not None:
                            torch.cuda._sleep(SPAN_DELAY_CYCLES)
                        t = time.perf_counter_ns()
                        st.begin()
                        tables_state.prepare(rows)
                        st.set_count(lens, bs)
                        tables_state.stage(bs)
                        if record is not None:
                            ev = (torch.cuda.Event(enable_timing=True),
                                  torch.cuda.Event(enable_timing=True))
                            ev[0].record()
                        st.publish("g")
                        st.finish()
                        host = (time.perf_counter_ns() - t) / 1e3
                        if record is not None:
                            ev[1].record()
                            record.append(ev)
                        return host

                    for _ in range(20):
                        step()
                    c = st.counters("g")
                    bytes0, pubs0 = c.bytes, c.publications
                    host = [step() for _ in range(steps)]
                    step_bytes = (c.bytes - bytes0) / (c.publications - pubs0)
                    evs: list = []
                    for _ in range(min(steps, 100)):
                        step(evs)
                    torch.cuda.synchronize()
                    span = [a.elapsed_time(b) * 1e3 for a, b in evs]
                    r = {"context": context, "mode": mode, "changed_rows": k, "policy": policy,
                         "stage": tables_state.last_stage,
                         "host_us_median": float(np.median(host)),
                         "gpu_span_us_median": float(np.median(span)),
                         "bytes_per_step": step_bytes}
                    out.append(r)
                    print(json.dumps(r), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", nargs="?", default="all",
                    choices=["core", "decode", "crossover", "all"])
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--contexts", default="4096,131072")
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("publication_bench needs a CUDA device (the decode benchmark runs on CPU)")
    res: dict[str, object] = {"date": time.strftime("%Y-%m-%d"),
                              "device": torch.cuda.get_device_name(),
                              "torch": torch.__version__}
    if args.which in ("core", "all"):
        res["core"] = bench_core(args.steps)
    if args.which in ("decode", "all"):
        res["decode"] = bench_decode(args.steps, [int(c) for c in args.contexts.split(",")],
                                     [int(s) for s in args.batch_sizes.split(",")])
    if args.which == "crossover":
        res["crossover"] = bench_crossover(args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "crossover_bench.json" if args.which == "crossover" else "publication_bench.json"
    (out / name).write_text(json.dumps(res, indent=1))
    if "crossover" in res:
        print("\ncrossover: ctx mode changed | partial host µs / span µs | whole host / span")
        cx = res["crossover"]
        for i in range(0, len(cx), 2):  # type: ignore[arg-type]
            p, w = cx[i], cx[i + 1]  # type: ignore[index]
            print(f"{p['context']:>6} {p['mode']:>7} {p['changed_rows']:>4} | "
                  f"{p['host_us_median']:6.1f} / {p['gpu_span_us_median']:6.1f} ({p['stage']}) | "
                  f"{w['host_us_median']:6.1f} / {w['gpu_span_us_median']:6.1f} ({w['stage']})")
    if "core" in res:
        print("\ncore: bs pages bytes | packed host/GPU µs | direct host/GPU µs | x | H2D,kern")
        core = res["core"]
        for i in range(0, len(core), 2):  # type: ignore[arg-type]
            p, d = core[i], core[i + 1]  # type: ignore[index]
            print(f"{p['bs']:>4} {p['pages']:>4} {p['bytes']:>8} | {p['host_us_median']:6.1f}/"
                  f"{p['gpu_us_per_step']:6.1f} | {d['host_us_median']:6.1f}/"
                  f"{d['gpu_us_per_step']:6.1f} | {d['host_us_median'] / p['host_us_median']:4.1f}"
                  f" | {p['h2d_per_step']:.0f},{p['kernels_per_step']:.0f} vs "
                  f"{d['h2d_per_step']:.0f},{d['kernels_per_step']:.0f}")
    if "decode" in res:
        print("\ndecode (host µs median / GPU span µs; x = host time vs packed; "
              "H2D,kernels per step)")
        print("   ctx   bs | packed | direct (1 copy/field) | separate | separate-direct | atom")
        dec = res["decode"]
        k = len(VARIANTS)
        for i in range(0, len(dec), k):  # type: ignore[arg-type]
            p, *others = dec[i : i + k]  # type: ignore[index]

            def cell(r: dict, base: dict | None) -> str:
                x = "" if base is None else f" {r['host_us_median'] / base['host_us_median']:.1f}x"
                return (f"{r['host_us_median']:6.1f}/{r['gpu_span_us_median']:6.1f}{x} "
                        f"{r['h2d_per_step']:.0f},{r['kernels_per_step']:.0f}")
            print(f"{p['context']:>6} {p['bs']:>4} | {cell(p, None)} | "
                  + " | ".join(cell(o, p) for o in others))


if __name__ == "__main__":
    main()
