"""The main job: end-to-end decode loops per model family, three ways in one process.

Families (each a runner of ``tests-integration/decode_runner``, CUDA graphs where the
runner has them):

* ``mha``: plain paged-attention decode (``DecodeRunner``), 1/16 of the rows append a page
  each step, deferred token ids;
* ``v41``: DeepSeek-V4.1-shaped decode (``V41Runner``): ``token_inputs`` + ``v41_metadata``
  (two groups), their first consumers and a compressed-attention stand-in, 256-token blocks;
* ``mtp``: MHA + MTP (``MtpRunner``, k=1): a verify step (one group: sampling, tokens,
  speculative indices, MHA metadata), acceptance, and the draft loop (no upload);
* ``gdn``: GDN + MTP: as ``mtp`` with GDN state indices riding in the verify group;
* ``deepseek_v4`` (not in the default set): transformers' ``DeepseekV4ForCausalLM`` (8
  layers on CUDA: sliding-window, compressed-sparse rate 4 and heavily-compressed rate
  128; fp32, eager) decoded by ``DeepseekV4Runner`` through ``token_inputs`` +
  ``v41_metadata`` and their first consumers, 256-token blocks; its rows add tokens per
  second and the metadata's share of the step's host work, as the Llama rows do. See
  ``deepseek_v4_family.py``;
* ``llama`` / ``llama_sync`` (not in the default set): a transformers ``LlamaForCausalLM``,
  Llama-3.2-1B-shaped random weights on CUDA, decoded by ``DecodeRunner`` over a paged KV
  cache through the published metadata, one graph per padded bucket, 128K-capable block
  tables; ``llama_sync`` reads each step's ids back (a synchronous engine loop). Their
  rows add tokens per second, the whole step's host µs and the metadata's share of it,
  and on CUDA the step's GPU busy µs and the GPU idle µs per step (wall less busy). See
  ``llama_family.py``, which also holds ``--ttft``: time to first token on a
  prefill-heavy workload (2K-8K-token prompts, chunked prefill), packed vs direct.

Ways, interleaved by chunks (the lent host's speed drifts between and within processes):

* ``packed``: this library (one DMA + one scatter per group);
* ``direct``: the same code with ``backend="direct"`` (one copy per member);
* ``atom``: the ATOM-style step (the host builds every array, one copy each). For ``mha``
  it publishes into the runner's destinations and its steps' logits equal packed's (the
  tests check it); for ``v41``/``deepseek_v4``/``mtp``/``gdn`` it is the ATOM-style host
  step of
  ``v41_step.py``/``mtp_step.py`` into its own destinations and the model runs over the
  destinations as last published: its host time, copies and GPU span are ATOM's, its
  values are not consumed.

Per family, batch size and way:

* H2D copies and kernels per step from a ``torch.profiler`` trace, **by copy kind**: the
  source and destination memory kinds the runtime reports for each memcpy (an H2D copy is
  one from pinned or pageable host memory to the device, whatever its label says);
* host µs of the step's metadata work, every way to the same point: its first consumers'
  work enqueued (the library: ``begin()`` through ``finish()`` and the first consumers'
  launches, less the wait for source reuse, reported apart; the ATOM-style ways build
  those arrays on the host). p50 over every timed step, and the spread: the lowest and
  highest chunk median;
* GPU span µs: CUDA events from the first publication work through the first consumers and
  the model's first kernel (the embedding gather of the step's ids, run eagerly in this
  pass), each step queued behind a sleep longer than the way's host time, so the span is
  GPU work, not host gaps (except where a way itself waits on the GPU: the ATOM-style GDN
  step's ``.item()``). The ATOM-style V4.1 and MTP ways have no first consumers of ours:
  their host builds those arrays;
* ms per output token: wall time per step (chunks of steps, synchronized at their end;
  the scheduler's inputs built before each chunk) over the tokens each request gains per
  step (1; for MTP 1 + the accepted drafts, the packed way's for the ATOM-style way, whose
  values are not consumed).

``--nanovllm`` adds the real-engine row: ``nanovllm_bench.py`` (stock nano-vllm against the
library runner and the graph-native runner, bf16 Qwen3-0.6B-shaped, CUDA graphs) at the
job's batch sizes, in processes of its own (one engine per process); on CPU its tiny smoke
mode. Its report joins ``decode_bench.json`` under ``nanovllm`` and its tables print last.

Ratios are way / packed. Without a GPU a small CPU configuration runs (Triton kernels in the
interpreter): it checks that every loop and way runs, but its figures predict no GPU host
(the packed scatter runs on the host there, and every "copy" is a memcpy). Writes
``decode_bench.json`` and ``decode_bench.png`` into ``--out`` (default ``results/``) and
prints the tables last.

    python benchmarks/decode_bench.py [--families mha,v41,mtp,gdn,deepseek_v4,llama,...]
        [--batch-sizes 1,8,64,256] [--rounds 4] [--chunk 50] [--ttft] [--nanovllm]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from repo_paths import use_sources  # noqa: E402

use_sources()

from decode_runner.runner import HOST_PARTS  # noqa: E402
from host_parts import GcClock, summarise  # noqa: E402
from main_job_loops import BUILDERS, DEFAULT_FAMILIES, FAMILIES, PAGE, WAYS, WINDOW, Loop  # noqa: E402
from main_job_output import SUMMARY_METRIC, parts_tables, plot, table  # noqa: E402
from span_sleep import sleep_cycles  # noqa: E402
from trace_counts import count_per_step  # noqa: E402


def nanovllm_row(out: Path, sizes: list[int], rounds: int, cuda: bool) -> dict[str, Any]:
    """The real-engine row: ``nanovllm_bench.py`` (stock nano-vllm against the library
    runners; one engine per child process, so it runs as a process of its own) at the
    job's batch sizes; on CPU its ``--tiny`` smoke mode. Its JSON report."""
    import subprocess

    path = out / "nanovllm_bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "nanovllm_bench.py"), "--batch-sizes",
           ",".join(map(str, sizes)), "--json", str(path)]
    cmd += ["--rounds", str(min(rounds, 2))] if cuda else [
        "--tiny", "--cpu", "--rounds", "1", "--decode-steps", "3"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nanovllm_bench.py failed ({done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(path.read_text())
    return report


# -- measuring ---------------------------------------------------------------------------
@dataclass
class Chunk:
    """One chunk of steps of one way: per step host µs, wait µs, whole host µs (where the
    loop reports it), metadata parts (ns, where the runner reports them), the collector's
    ns and runs; and wall ms per step, tokens per request per step."""

    host: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    parts: list[list[int]] = field(default_factory=list)
    gc_ns: list[int] = field(default_factory=list)
    gc_runs: list[int] = field(default_factory=list)
    ms: float = 0.0
    tokens: float = 0.0


def _chunk(loop: Loop, steps: int, cuda: bool, clock: GcClock) -> Chunk:
    """``steps`` steps of ``loop`` (see :class:`Chunk`)."""
    c = Chunk()
    tokens = 0.0
    loop.prefetch(steps)  # the scheduler's side, outside the wall clock
    parts = getattr(loop.runner, "host_parts_ns", None) if loop.isolated else None
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        gc_ns, gc_runs = clock.ns, clock.collections
        tokens += loop.step()
        c.gc_ns.append(clock.ns - gc_ns)
        c.gc_runs.append(clock.collections - gc_runs)
        c.host.append(loop.runner.host_metadata_ns / 1e3)
        c.wait.append(loop.wait_ns() / 1e3)
        if parts is not None:
            c.parts.append(list(parts))
        if loop.host_step_ns is not None:
            c.whole.append(loop.host_step_ns() / 1e3)
    if cuda:
        torch.cuda.synchronize()
    c.ms, c.tokens = (time.perf_counter() - t0) * 1e3 / steps, tokens / steps
    return c


def _alone(loop: Loop, steps: int, cuda: bool) -> tuple[list[float], list[list[int]]]:
    """``steps`` isolated steps (the metadata alone, no model): host µs and parts."""
    assert loop.isolated is not None
    host, parts = [], []
    loop.prefetch(steps)
    if cuda:
        torch.cuda.synchronize()
    for _ in range(steps):
        loop.isolated()
        host.append(loop.runner.host_metadata_ns / 1e3)
        parts.append(list(loop.runner.host_parts_ns))
    if cuda:
        torch.cuda.synchronize()
    return host, parts


def _span(loop: Loop, steps: int, host_us: float) -> list[float]:
    """GPU µs from the first publication work through the model's first kernel."""
    cycles = sleep_cycles(host_us)  # the span is GPU work, not host gaps
    runner = loop.runner
    runner.span_through_model = True
    loop.prefetch(steps)
    evs = []
    for _ in range(steps):
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        runner.span_events = pair
        torch.cuda._sleep(cycles)
        loop.step()
        evs.append(pair)
    runner.span_events = None
    runner.span_through_model = False
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in evs]


def measure(family: str, bs: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One family at one batch size: the three ways interleaved; one row per way."""
    loops = {w: BUILDERS[family](w, bs, args) for w in WAYS}
    clock = GcClock()
    for loop in loops.values():
        _chunk(loop, args.warmup, args.cuda, clock)
        if loop.isolated is not None:
            _alone(loop, args.warmup, args.cuda)
    chunks: dict[str, list[Chunk]] = {w: [] for w in WAYS}
    alone: dict[str, list[float]] = {w: [] for w in WAYS}
    alone_parts: dict[str, list[list[int]]] = {w: [] for w in WAYS}
    with clock:
        for r in range(args.rounds):
            for w in (WAYS if r % 2 == 0 else WAYS[::-1]):
                loop = loops[w]
                if loop.isolated is not None:
                    # the same step alone, just before its loop's chunk: same process,
                    # same runner, the next batches
                    h, parts = _alone(loop, args.chunk, args.cuda)
                    alone[w] += h
                    alone_parts[w] += parts
                chunks[w].append(_chunk(loop, args.chunk, args.cuda, clock))
    rows = []
    for w, loop in loops.items():
        cs = chunks[w]
        host = [x for c in cs for x in c.host]
        whole = [x for c in cs for x in c.whole]
        chunk_p50 = [float(np.median(c.host)) for c in cs]
        hs = np.asarray(host)
        ms = float(np.median([c.ms for c in cs]))
        tok = float(np.mean([c.tokens for c in cs]))
        row: dict[str, Any] = {
            "family": family, "bs": bs, "way": w, "steps": len(hs),
            # the spread: the chunk medians' extremes (the host drifts within a process)
            "host_us_p50": float(np.median(hs)), "host_us_chunk_min": min(chunk_p50),
            "host_us_chunk_max": max(chunk_p50), "host_us_chunk_p50s": chunk_p50,
            "source_wait_us_p50": float(np.median([x for c in cs for x in c.wait])),
            "step_ms": ms, "tokens_per_request_step": tok, "ms_per_output_token": ms / tok,
            "tokens_per_s": bs * tok / ms * 1e3,
            "library_per_step": loop.counters() if w != "atom" else None,
        }
        row.update(summarise(
            HOST_PARTS, [p for c in cs for p in c.parts], [x for c in cs for x in c.gc_ns],
            [x for c in cs for x in c.gc_runs], alone[w], alone_parts[w]))
        if whole:  # the whole step's host work, and the metadata's share of it
            ws = np.asarray(whole)
            row["host_step_us_p50"] = float(np.median(ws))
            row["metadata_share_p50"] = float(np.median(hs / np.maximum(ws, 1e-3)))
        if args.cuda:
            span = _span(loop, args.span_steps, float(np.percentile(hs, 90)))
            row["gpu_span_us_p50"] = float(np.median(span))
            if loop.extra is not None:
                row.update(loop.extra(row, args))
            loop.prefetch(args.profile_steps)
            row.update(count_per_step(loop.step, args.profile_steps))
        rows.append(row)
    packed = rows[0]
    if family in ("mtp", "gdn"):
        # the ATOM-style way's values are not consumed, so its acceptance is not its own:
        # its time per output token uses the packed way's tokens per step
        atom = rows[2]
        atom["tokens_per_request_step"] = packed["tokens_per_request_step"]
        atom["ms_per_output_token"] = atom["step_ms"] / packed["tokens_per_request_step"]
    for row in rows:
        row["host_vs_packed"] = row["host_us_p50"] / packed["host_us_p50"]
        row["tpot_vs_packed"] = row["ms_per_output_token"] / packed["ms_per_output_token"]
    del loops, loop
    gc.collect()  # runners hold cycles (the ATOM-style way points back at its runner)
    if args.cuda:
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                    help=f"comma-separated, of {','.join(FAMILIES)}")
    ap.add_argument("--batch-sizes", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--context", type=int, default=None,
                    help="MHA and Llama decode tokens per request")
    ap.add_argument("--ttft", action="store_true",
                    help="also time to first token on the Llama prefill-heavy workload")
    ap.add_argument("--ttft-reps", type=int, default=None)
    ap.add_argument("--nanovllm", action="store_true",
                    help="also the real-engine row: nano-vllm stock against the library "
                         "runners (benchmarks/nanovllm_bench.py, its own processes)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    cuda = args.cuda = _CUDA
    args.device = "cuda" if cuda else "cpu"
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    sizes = [int(s) for s in (args.batch_sizes or ("1,8,64,256" if cuda else "1,8")).split(",")]
    args.rounds = args.rounds or (4 if cuda else 2)
    args.chunk = args.chunk or (50 if cuda else 3)
    args.warmup = args.warmup or (20 if cuda else 2)
    args.span_steps = 40 if cuda else 0
    args.profile_steps = 5
    args.context = args.context or (1024 if cuda else 64)
    args.v41_context = 32768 if cuda else 600
    args.mtp_context = 1024 if cuda else 40
    args.total_steps = args.warmup + args.rounds * args.chunk + args.span_steps + \
        args.profile_steps + 2
    args.page, args.window = PAGE, WINDOW
    args.ttft_reps = args.ttft_reps or (5 if cuda else 1)
    llama = args.ttft or any(f.startswith("llama") for f in families)
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or 'host'})"
    if not cuda:
        print("No CUDA device: running the small CPU configuration. It checks that every "
              "loop and way runs; its figures predict no GPU host (the packed scatter runs "
              "on the host here, every copy is a memcpy, kernels are interpreted).",
              flush=True)
        torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__,
            "cuda": cuda, "mha_context": args.context, "v41_context": args.v41_context,
            "mtp_context": args.mtp_context, "rounds": args.rounds, "chunk": args.chunk,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    output: dict[str, Any] = {"meta": meta}
    if llama:
        import llama_family

        meta["llama"] = llama_family.describe(args, sizes)
    if "deepseek_v4" in families:
        import deepseek_v4_family

        meta["deepseek_v4"] = deepseek_v4_family.describe(args, sizes)
    results: list[dict[str, Any]] = []
    output["results"] = results
    for fam in families:
        for bs in sizes:
            t = time.perf_counter()
            rows = measure(fam, bs, args)
            results += rows
            print(f"{fam} bs={bs}: {SUMMARY_METRIC}: " + ", ".join(
                f"{r['way']} {r['host_us_p50']:.1f}" for r in rows)
                + f" ({time.perf_counter() - t:.1f} s to measure)", flush=True)
            # written after every size: an interrupted run keeps what it measured
            (out / "decode_bench.json").write_text(json.dumps(output, indent=1))
    if args.ttft:
        t = time.perf_counter()
        output["ttft"] = llama_family.measure_ttft(args)
        print("llama TTFT p50: " + ", ".join(
            f"{w} {r['ttft_ms']['p50']:.1f} ms" for w, r in output["ttft"]["ways"].items())
            + f" ({time.perf_counter() - t:.1f} s)", flush=True)
        (out / "decode_bench.json").write_text(json.dumps(output, indent=1))
    if args.nanovllm:
        t = time.perf_counter()
        output["nanovllm"] = nanovllm_row(out, sizes, args.rounds, cuda)
        print(f"nano-vllm: {time.perf_counter() - t:.1f} s", flush=True)
        (out / "decode_bench.json").write_text(json.dumps(output, indent=1))
    written = str(out / "decode_bench.json")
    try:
        if results:
            plot(results, out / "decode_bench.png", meta)
            written += f", {out / 'decode_bench.png'}"
    except ImportError:
        print("matplotlib is not installed: no plot written", flush=True)
    print(f"\nresults: {written}")
    print(f"device: {device}; torch {torch.__version__}; {args.rounds} rounds x {args.chunk} "
          "steps per way, interleaved")
    print(table(results, cuda))
    if "deepseek_v4" in families:
        print(deepseek_v4_family.table(results, cuda))
    if llama:
        print(llama_family.table(results, cuda))
        if args.ttft:
            print(llama_family.ttft_table(output["ttft"]))
    print(parts_tables(results))
    if args.nanovllm:
        from nanovllm_bench import tables as nanovllm_tables

        row = output["nanovllm"]
        print(f"\nnano-vllm (a real engine): {row['meta']['command']}\n")
        print(nanovllm_tables(row["summary"], row["runs"], cuda))


if __name__ == "__main__":
    main()
