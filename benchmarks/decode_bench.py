"""The main job: end-to-end decode steps, packed publication against direct copies.

Runs the integration decode runner (tests-integration/decode_runner) on steady decode
batches (1/16 of the rows append a page each step, deferred token ids) for batch sizes 1,
8, 64 and 256, both backends in the same run, and reports per batch size:

* H2D copies and kernels per step, counted from ``torch.profiler`` events;
* host µs of metadata preparation + publication (``begin()`` .. ``finish()``, median),
  without the time ``begin()`` waits for source reuse (reported apart: with two slots the
  host runs one step ahead, so it waits only while the GPU is the bottleneck);
* GPU µs from the first publication work to the end of the first consumers (events; the
  GPU is kept busy while the host enqueues the step, so this is device time);
* wall ms per step (= time per output token of each request), CUDA graphs on the GPU.

Without a GPU it runs a small CPU configuration (Triton kernels in the interpreter): only
the host-side metadata figures mean anything there. Writes ``decode_bench.json`` and
``decode_bench.png`` into ``--out`` (default ``results/``) and prints a table last.

    python benchmarks/decode_bench.py [--out DIR] [--steps N] [--batch-sizes 1,8,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("H2D_BENCH_FORCE_CPU"):
    import torch as _torch_probe

    _CUDA = _torch_probe.cuda.is_available()
else:
    _CUDA = False
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the consumers run interpreted

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "tests-integration"))
sys.path.insert(0, str(ROOT / "benchmarks"))
for pkg in ("block-tables", "h2d-kernels", "h2d-core", "h2d-runner-adapters"):
    src = ROOT / "packages" / pkg / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.append(str(src))  # installed packages (nox) win; sources as a fallback

from decode_runner.runner import DecodeRunner, RunnerConfig  # noqa: E402
from decode_runner.scheduler import steady_decode_batches, steady_decode_num_pages  # noqa: E402
from trace_counts import count_per_step  # noqa: E402

PAGE = 16
WINDOW = 512


def _config(bs: int, context: int, cuda: bool) -> RunnerConfig:
    per_row = -(-(context + PAGE - 1 + WINDOW) // PAGE)
    return RunnerConfig(
        max_reqs=bs, max_tokens=bs, max_pages_per_req=per_row, page_size=PAGE,
        num_pages=steady_decode_num_pages(bs, context, PAGE, WINDOW),
        vocab=4096 if cuda else 512, hidden=256 if cuda else 32, layers=2,
        heads=4 if cuda else 2, head_dim=64 if cuda else 16,
        dtype=torch.float16 if cuda else torch.float32,
        graph_sizes=(bs,) if cuda else (), seed=1,
        # two slots: the host prepares step N+1 while the GPU still runs step N
        num_slots=2,
    )


def _batches(bs: int, context: int, n: int) -> list:
    gen = steady_decode_batches(bs, context, PAGE, window=WINDOW, graph_sizes=(bs,))
    out = []
    for _ in range(n):
        b = next(gen)
        b.columns, b.block_tables  # noqa: B018  (build the columns outside the timed region)
        out.append(b)
    return out


def _count_profiled(runner: DecodeRunner, batches: list) -> dict[str, float | None]:
    if runner.device.type != "cuda":
        return {"h2d_per_step": None, "kernels_per_step": None}  # no device, nothing to count
    it = iter(batches)
    return count_per_step(lambda: runner.step(next(it)), len(batches))


def run_one(bs: int, context: int, backend: str, steps: int, warmup: int, cuda: bool) -> dict:
    device = "cuda" if cuda else "cpu"
    runner = DecodeRunner(_config(bs, context, cuda), device, backend)
    batches = _batches(bs, context, warmup + 2 * steps + 10)
    it = iter(batches)
    for _ in range(warmup):
        runner.step(next(it))
    if cuda:
        torch.cuda.synchronize()
    # pass 1: host metadata time and wall time per step (no events recorded)
    host, wait = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step(next(it))
        host.append(runner.host_metadata_ns / 1e3)
        wait.append(runner.state.last_source_wait_ns / 1e3)
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    # pass 2: GPU span from the first publication work to the end of the first consumers
    span = []
    if cuda:
        evs = []
        for _ in range(steps):
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            runner.span_events = pair
            torch.cuda._sleep(800_000)  # device time only: the host enqueues while it sleeps
            runner.step(next(it))
            evs.append(pair)
        runner.span_events = None
        torch.cuda.synchronize()
        span = [a.elapsed_time(b) * 1e3 for a, b in evs]
    counts = _count_profiled(runner, [next(it) for _ in range(10)])
    c = runner.state.counters("decode_step")
    return {
        "bs": bs, "context": context, "backend": backend, "steps": steps,
        "host_metadata_us_median": float(np.median(host)),
        "host_metadata_us_p90": float(np.percentile(host, 90)),
        "source_wait_us_median": float(np.median(wait)),
        "gpu_span_us_median": float(np.median(span)) if span else None,
        "step_ms": wall_ms,
        **counts,
        "publications": c.publications, "dmas": c.dmas, "direct_copies": c.direct_copies,
        "bytes_per_publication": c.bytes / max(c.publications, 1),
    }


def _plot(results: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["bs"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(sizes))
    for k, backend in enumerate(("packed", "direct")):
        rows = {r["bs"]: r for r in results if r["backend"] == backend}
        axes[0].bar(x + (k - 0.5) * 0.4, [rows[s]["host_metadata_us_median"] for s in sizes],
                    0.4, label=backend)
        axes[1].bar(x + (k - 0.5) * 0.4, [rows[s]["step_ms"] for s in sizes], 0.4,
                    label=backend)
    for ax, title in zip(axes, ("host µs: metadata prep + publication", "ms per decode step"),
                         strict=True):
        ax.set_xticks(x, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"decode step, packed vs direct ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--batch-sizes", default=None)
    ap.add_argument("--context", type=int, default=None)
    args = ap.parse_args()
    cuda = _CUDA
    sizes = [int(s) for s in (args.batch_sizes or ("1,8,64,256" if cuda else "1,8,64")).split(",")]
    steps = args.steps or (200 if cuda else 20)
    warmup = args.warmup or (20 if cuda else 3)
    context = args.context or (1024 if cuda else 256)
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or 'host'})"
    if not cuda:
        print("No CUDA device: running the small CPU configuration. Only host-side metadata "
              "figures are meaningful here; GPU spans and step times are not.", flush=True)
    torch.set_num_threads(1) if not cuda else None
    results = []
    total = len(sizes) * 2
    for i, bs in enumerate(sizes):
        for backend in ("packed", "direct"):
            t = time.perf_counter()
            r = run_one(bs, context, backend, steps, warmup, cuda)
            results.append(r)
            print(f"[{len(results)}/{total}] bs={bs} {backend}: host "
                  f"{r['host_metadata_us_median']:.1f} µs, step {r['step_ms']:.3f} ms "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
        del i
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__,
            "context": context, "page_size": PAGE, "steps": steps, "cuda": cuda,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    (out / "decode_bench.json").write_text(json.dumps({"meta": meta, "results": results},
                                                      indent=1))
    try:
        _plot(results, out / "decode_bench.png", device)
        written = f"{out / 'decode_bench.json'}, {out / 'decode_bench.png'}"
    except ImportError:
        print("matplotlib is not installed: no plot written", flush=True)
        written = str(out / "decode_bench.json")
    print(f"\nresults: {written}")
    print(f"device: {device}; context {context}, page {PAGE}, 1/16 rows append per step")
    hdr = ("bs", "backend", "H2D/step", "kern/step", "host µs", "p90", "GPU span µs",
           "ms/step")
    print("{:>4} {:>7} {:>8} {:>9} {:>8} {:>7} {:>11} {:>8}".format(*hdr))
    for r in results:
        span = r["gpu_span_us_median"]
        h2d, kern = r["h2d_per_step"], r["kernels_per_step"]
        print(f"{r['bs']:>4} {r['backend']:>7} {'-' if h2d is None else f'{h2d:.1f}':>8} "
              f"{'-' if kern is None else f'{kern:.1f}':>9} {r['host_metadata_us_median']:>8.1f} "
              f"{r['host_metadata_us_p90']:>7.1f} "
              f"{'-' if span is None else f'{span:.1f}':>11} {r['step_ms']:>8.3f}")
    for bs in sizes:
        p = next(r for r in results if r["bs"] == bs and r["backend"] == "packed")
        d = next(r for r in results if r["bs"] == bs and r["backend"] == "direct")
        ratio = d["host_metadata_us_median"] / p["host_metadata_us_median"]
        print(f"bs={bs}: host metadata {ratio:.2f}x "
              f"less with packed; step time packed/direct "
              f"{p['step_ms'] / d['step_ms']:.3f}")


if __name__ == "__main__":
    main()
