"""The main job's Llama families: a Llama-3.2-1B-shaped model, where the host can matter.

Imported by ``decode_bench.py`` (which measures, interleaves the ways and writes the
output); this module holds what is Llama's own:

* the model: ``transformers.LlamaForCausalLM`` random-initialised from a ``LlamaConfig``
  (no download). On CUDA the Llama-3.2-1B shape: 16 layers, hidden 2048, MLP 8192, GQA 32
  query / 8 key-value heads of 64, vocab 128256, tied embeddings, llama3 RoPE, bf16. On
  CPU a tiny one (2 layers, hidden 64, 4 / 1 heads of 16, vocab 512, float32) that only
  checks the loops run. One model serves every way and batch size;
* its decoder: :class:`~decode_runner.llama_graph.LlamaGraphDecoder` (the model's own
  modules, paged attention read through the published metadata, capturable) inside a
  :class:`~decode_runner.runner.DecodeRunner`, which captures one graph of the first
  consumers and one of the model and sampler per padded bucket (``graph_sizes=(bs,)``);
* :class:`LlamaDecode`: the steady decode loop of one way (``steady_decode_batches``:
  1/16 of the rows cross a page each step), with block tables sized for 128K-token
  contexts (8192 pages of 16 per request: the destinations, the ATOM-style way's
  full-width rows) and a KV cache sized for the contexts actually run. ``sync=False``
  (family ``llama``): deferred token ids, no readback, the host runs up to two steps
  ahead (the runner's two slots). ``sync=True`` (family ``llama_sync``): the host reads
  each step's sampled ids back before the next step, as a synchronous engine loop does,
  so every µs of its step work is on the GPU's critical path;
* :func:`measure_ttft`: time to first token on a prefill-heavy workload (prompts of
  2K-8K tokens arriving at once, chunked prefill of 2048 tokens a step through the
  library's prefill adapter, first-come first-served), packed vs direct, interleaved.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from decode_runner.llama_graph import LlamaGraphDecoder
from decode_runner.runner import DecodeRunner, RunnerConfig
from decode_runner.scheduler import steady_decode_batches, steady_decode_num_pages
from span_sleep import sleep_cycles

from block_tables import BlockTable
from h2d_runner_adapters import SamplingParams, ScheduledBatch, ScheduledRequest

FAMILIES = ("llama", "llama_sync")
MAX_CONTEXT = 128 * 1024  # the block tables' capacity per request, in tokens
GREEDY = SamplingParams(temperature=0.0)

_MODELS: dict[str, torch.nn.Module] = {}


def llama_config(cuda: bool) -> Any:
    """Llama-3.2-1B's shape on CUDA, a tiny one on CPU (see the module docstring)."""
    import transformers

    if cuda:
        return transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192,
            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
            head_dim=64, max_position_embeddings=MAX_CONTEXT, rms_norm_eps=1e-5,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)


def llama_model(device: str, cuda: bool) -> torch.nn.Module:
    """The run's one model (built on ``device`` at first use, bf16 on CUDA): weights are
    shared by every way and batch size, each decoder has its own KV cache."""
    if device not in _MODELS:
        import transformers

        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(llama_config(cuda))
        _MODELS[device] = model.to(torch.bfloat16 if cuda else torch.float32).eval()
    return _MODELS[device]


def describe(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    """The model and workload shape, for the output's ``meta``: the KV cache per way is
    ``layers x 2 x slots x kv_heads x head_dim x item`` bytes over the steady pages."""
    cfg = llama_config(args.cuda)
    layers, kvh, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    per_token = layers * 2 * kvh * dim * (2 if args.cuda else 4)
    return {"layers": layers, "hidden": cfg.hidden_size, "intermediate":
            cfg.intermediate_size, "heads": cfg.num_attention_heads, "kv_heads": kvh,
            "head_dim": dim, "vocab": cfg.vocab_size, "dtype": "bf16" if args.cuda else "fp32",
            "kv_bytes_per_token": per_token, "max_pages_per_request": MAX_CONTEXT // args.page,
            "context": args.context, "graphs": bool(args.cuda),
            "kv_cache_gib_per_way": {bs: steady_decode_num_pages(
                bs, args.context, args.page, args.window) * args.page * per_token / 2**30
                for bs in sizes}}


def _decoder(num_pages: int, max_pages: int, args: argparse.Namespace) -> LlamaGraphDecoder:
    model = llama_model(args.device, args.cuda)
    return LlamaGraphDecoder(model, page_size=args.page, num_pages=num_pages,
                             max_pages=max_pages, target_programs=None if args.cuda else 4)


class LlamaDecode:
    """One way's steady decode of ``bs`` requests near ``args.context`` tokens (see the
    module docstring); ``decode_bench`` wraps it in its ``Loop``."""

    def __init__(self, way: str, bs: int, args: argparse.Namespace, *, sync: bool) -> None:
        page, window = args.page, args.window
        num_pages = steady_decode_num_pages(bs, args.context, page, window)
        self.decoder = _decoder(num_pages, -(-(args.context + page + window) // page), args)
        vocab = self.decoder.vocab
        cfg = RunnerConfig(
            max_reqs=bs, max_tokens=bs, max_pages_per_req=MAX_CONTEXT // page, page_size=page,
            num_pages=num_pages, vocab=vocab, graph_sizes=(bs,) if args.cuda else (), seed=1,
            num_slots=2)  # two slots: the host prepares step N+1 while the GPU runs N
        self.runner = DecodeRunner(cfg, args.device, way, model=self.decoder)
        self.sync = sync
        self.way = way
        self._batches = steady_decode_batches(bs, args.context, page, window=window,
                                              graph_sizes=(bs,), vocab_size=vocab)
        self._queue: deque[ScheduledBatch] = deque()
        self.last_host_step_ns = 0
        #: when set (CUDA), recorded after the step's GPU work is enqueued (before the
        #: readback of ``sync``): the end of :meth:`gpu_busy_us`'s span
        self.end_event: torch.cuda.Event | None = None

    def _next(self) -> ScheduledBatch:
        b = next(self._batches)
        b.columns, b.block_tables  # noqa: B018  (the scheduler's side, built ahead)
        return b

    def prefetch(self, n: int) -> None:
        while len(self._queue) < n:
            self._queue.append(self._next())

    def isolated(self) -> None:
        """The next step's metadata alone (no model, no sampler): the isolated step."""
        self.runner.decode_metadata(self._queue.popleft() if self._queue else self._next())

    def wait_ns(self) -> int:
        """The last step's wait for source reuse (a GPU still reading older sources)."""
        r = self.runner
        return r.atom.last_wait_ns if r.atom else r.state.last_source_wait_ns

    def step(self) -> float:
        batch = self._queue.popleft() if self._queue else self._next()
        t0 = time.perf_counter_ns()
        res = self.runner.step(batch)
        # the step's host work: metadata, first consumers, graph replay, sampler launch
        self.last_host_step_ns = time.perf_counter_ns() - t0 - self.wait_ns()
        if self.end_event is not None:
            self.end_event.record()
        if self.sync:
            res.sampled.cpu()  # the synchronous loop: the ids reach the host each step
            if self.runner.atom is None:
                # that blocking read on the one stream every epoch runs on came after
                # finish(): the next begin() need not ask the driver about the slot
                self.runner.state.mark_synchronized()
        return 1.0

    def host_step_ns(self) -> int:
        return self.last_host_step_ns

    def gpu_busy_us(self, steps: int, host_us: float) -> list[float]:
        """GPU µs of one step's work alone: after a synchronize, the step is enqueued behind
        a sleep that outlasts the host's step three times, between two events (the second
        recorded before any readback), so no host gap lies inside the span."""
        cycles = sleep_cycles(host_us)
        self.prefetch(steps)
        out = []
        for _ in range(steps):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            start.record()
            self.step()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(self.end_event) * 1e3)
        self.end_event = None
        return out

    def extra(self, row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
        """CUDA only: the step's GPU busy time and the GPU idle time per step it implies
        (wall per step less busy: the gaps the host leaves, between and inside steps)."""
        # twice the median whole step sizes the sleep (see ``gpu_busy_us``)
        busy = self.gpu_busy_us(args.span_steps, 2 * row.get("host_step_us_p50", 500.0))
        p50 = float(np.median(busy))
        return {"gpu_busy_us_p50": p50,
                "gpu_idle_us_per_step": row["step_ms"] * 1e3 - p50,
                "gpu_idle_share": 1.0 - p50 / (row["step_ms"] * 1e3)}


def table(results: list[dict[str, Any]], cuda: bool) -> str:
    """The Llama families' printed table."""
    lines = [("\nllama: decode steps replay CUDA graphs (one per padded bucket: the first "
              "consumers; the model and the sampler)") if cuda else
             "\nllama: eager, no CUDA graphs (no CUDA device: the tiny CPU model)"]
    for fam in FAMILIES:
        rows = [r for r in results if r["family"] == fam]
        if not rows:
            continue
        how = ("host reads each step's ids back" if fam == "llama_sync"
               else "deferred ids, host up to 2 steps ahead")
        lines.append(
            f"\n{fam} ({how}): tokens/s, ms per step, host µs per step: metadata p50 "
            "(x = way / packed) and the whole step's host work p50, metadata's share of it; "
            "GPU busy µs per step (events, step queued behind a sleep) and GPU idle µs per "
            "step (wall - busy); H2D + kernels per step (profiler)")
        lines += step_rows(rows)
    return "\n".join(lines)


def step_rows(rows: list[dict[str, Any]]) -> list[str]:
    """A model family's rows as a table (tok/s, ms per step, metadata and whole-step host
    µs, the metadata's share, GPU busy and idle µs, H2D + kernels): the Llama and
    DeepSeek-V4 families print the same columns."""
    lines = ["| bs | way | tok/s | ms/step | metadata µs | step host µs | share | "
             "GPU busy µs | GPU idle µs | H2D + kernels |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        busy = f"{r['gpu_busy_us_p50']:.0f}" if "gpu_busy_us_p50" in r else "-"
        idle = (f"{r['gpu_idle_us_per_step']:.0f} ({100 * r['gpu_idle_share']:.0f}%)"
                if "gpu_idle_us_per_step" in r else "-")
        counts = (f"{r['h2d_per_step']:.0f} + {r['kernels_per_step']:.0f}"
                  if "h2d_per_step" in r else "-")
        lines.append(
            f"| {r['bs']} | {r['way']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.3f} | "
            f"{r['host_us_p50']:.1f} ({r['host_vs_packed']:.1f}x) | "
            f"{r['host_step_us_p50']:.1f} | {100 * r['metadata_share_p50']:.1f}% | "
            f"{busy} | {idle} | {counts} |")
    return lines


# -- TTFT --------------------------------------------------------------------------------
TTFT_WAYS = ("packed", "direct")


def ttft_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The prompts (lengths drawn once, seeded) and the step's token budget."""
    rng = np.random.default_rng(7)
    if args.cuda:
        n, lo, hi, chunk = 8, 2048, 8192, 2048
    else:
        n, lo, hi, chunk = 3, 16, 40, 16
    lens = [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    return {"prompt_lens": lens, "chunk_tokens": chunk, "page": args.page,
            "arrival": "all at once, first-come first-served"}


def _prefill_plan(work: dict[str, Any], vocab: int, rep: int
                  ) -> Iterator[tuple[ScheduledBatch, list[int]]]:
    """The workload's chunked prefill steps: each batch and the requests whose prompt it
    completes (their first token is sampled there). Fresh tables per repetition; request
    ``r`` owns pages ``[offset_r, offset_r + pages_r)``."""
    rng = np.random.default_rng(100 + rep)
    page, budget_per_step = work["page"], work["chunk_tokens"]
    lens = work["prompt_lens"]
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in lens]
    offsets = np.cumsum([0] + [-(-n // page) for n in lens]).tolist()
    tables = [BlockTable() for _ in lens]
    done = [0] * len(lens)
    head, step = 0, 0
    while head < len(lens):
        budget, rows, completes = budget_per_step, [], []
        r = head
        while budget and r < len(lens):
            start = done[r]
            n = min(lens[r] - start, budget)
            need = -(-(start + n) // page) - len(tables[r])
            if need:
                base = offsets[r] + len(tables[r])
                tables[r].append(list(range(base, base + need)))
            rows.append(ScheduledRequest(
                req_id=rep * 1000 + r, num_tokens=n, context_len=start + n,
                block_table=tables[r].lineage_copy(), sampling=GREEDY,
                token_ids=tuple(prompts[r][start:start + n])))
            done[r] = start + n
            budget -= n
            if done[r] == lens[r]:
                completes.append(r)
                head = r + 1
            r += 1
        batch = ScheduledBatch(tuple(rows), True, page, step=step)
        batch.columns, batch.block_tables  # noqa: B018
        yield batch, completes
        step += 1


def _ttft_runner(way: str, work: dict[str, Any], args: argparse.Namespace) -> DecodeRunner:
    page, lens = work["page"], work["prompt_lens"]
    num_pages = sum(-(-n // page) for n in lens)
    decoder = _decoder(num_pages, -(-max(lens) // page), args)
    cfg = RunnerConfig(max_reqs=len(lens), max_tokens=work["chunk_tokens"],
                       max_pages_per_req=MAX_CONTEXT // page, page_size=page,
                       num_pages=num_pages, vocab=decoder.vocab, seed=1, num_slots=2)
    return DecodeRunner(cfg, args.device, way, model=decoder)


def _ttft_once(runner: DecodeRunner, plan: list[tuple[ScheduledBatch, list[int]]],
               cuda: bool) -> tuple[list[float], list[float], list[float]]:
    """One pass of the workload: each request's TTFT ms (from the common arrival to its
    first token on the host), each step's host metadata µs and wall ms. Every step's
    sampled ids are read back (what a server streaming first tokens waits for)."""
    ttft = [0.0] * sum(len(done) for _, done in plan)
    host, wall = [], []
    if cuda:
        torch.cuda.synchronize()
    t0 = last = time.perf_counter()
    for batch, done in plan:
        res = runner.step(batch)
        res.sampled.cpu()
        now = time.perf_counter()
        host.append(runner.host_metadata_ns / 1e3)
        wall.append((now - last) * 1e3)
        last = now
        for r in done:
            ttft[r] = (now - t0) * 1e3
    return ttft, host, wall


def _pcts(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "min": float(a.min()), "max": float(a.max())}


def measure_ttft(args: argparse.Namespace) -> dict[str, Any]:
    """TTFT per way over ``args.ttft_reps`` repetitions (after one warm-up each), the
    ways' order alternating; ratios are paired by repetition and request."""
    work = ttft_workload(args)
    runners = {w: _ttft_runner(w, work, args) for w in TTFT_WAYS}
    vocab = runners["packed"].model.vocab
    ttft: dict[str, list[list[float]]] = {w: [] for w in TTFT_WAYS}
    host: dict[str, list[float]] = {w: [] for w in TTFT_WAYS}
    wall: dict[str, list[float]] = {w: [] for w in TTFT_WAYS}
    for rep in range(1 + args.ttft_reps):
        for w in (TTFT_WAYS if rep % 2 == 0 else TTFT_WAYS[::-1]):
            plan = list(_prefill_plan(work, vocab, rep))  # the scheduler's side, untimed
            t, h, s = _ttft_once(runners[w], plan, args.cuda)
            if rep:  # rep 0 warms up (kernel compilation, first allocations)
                ttft[w].append(t)
                host[w] += h
                wall[w] += s
    out: dict[str, Any] = {"workload": work, "reps": args.ttft_reps,
                           "steps_per_rep": len(list(_prefill_plan(work, vocab, 0))),
                           "ways": {}}
    for w in TTFT_WAYS:
        flat = [x for rep in ttft[w] for x in rep]
        out["ways"][w] = {"ttft_ms": _pcts(flat), "ttft_ms_all": ttft[w],
                          "makespan_ms": _pcts([max(rep) for rep in ttft[w]]),
                          "host_metadata_us_per_step": _pcts(host[w]),
                          "step_ms": _pcts(wall[w])}
    pairs = [d / p for dr, pr in zip(ttft["direct"], ttft["packed"], strict=True)
             for d, p in zip(dr, pr, strict=True)]
    diffs = [d - p for dr, pr in zip(ttft["direct"], ttft["packed"], strict=True)
             for d, p in zip(dr, pr, strict=True)]
    out["direct_vs_packed"] = {"ratio": _pcts(pairs), "diff_ms": _pcts(diffs)}
    del runners
    return out


def ttft_table(t: dict[str, Any]) -> str:
    """The TTFT run's printed table and what its numbers say."""
    work = t["workload"]
    lines = [f"\nTTFT: {len(work['prompt_lens'])} prompts of {min(work['prompt_lens'])}-"
             f"{max(work['prompt_lens'])} tokens arriving at once, chunked prefill of "
             f"{work['chunk_tokens']} tokens a step ({t['steps_per_rep']} steps), every "
             f"step's ids read back; {t['reps']} reps per way, interleaved",
             "| way | TTFT ms p50 [p10-p90] | makespan ms p50 [min-max] | metadata µs per "
             "step p50 | step ms p50 |", "|---|---:|---:|---:|---:|"]
    for w, r in t["ways"].items():
        f, m = r["ttft_ms"], r["makespan_ms"]
        lines.append(f"| {w} | {f['p50']:.2f} [{f['p10']:.2f}-{f['p90']:.2f}] | "
                     f"{m['p50']:.2f} [{m['min']:.2f}-{m['max']:.2f}] | "
                     f"{r['host_metadata_us_per_step']['p50']:.1f} | {r['step_ms']['p50']:.3f} |")
    ratio, diff = t["direct_vs_packed"]["ratio"], t["direct_vs_packed"]["diff_ms"]
    p, d = t["ways"]["packed"], t["ways"]["direct"]
    saved = (d["host_metadata_us_per_step"]["p50"] - p["host_metadata_us_per_step"]["p50"]) \
        * t["steps_per_rep"] / 1e3
    lines.append(
        f"direct / packed TTFT, paired by rep and request: {ratio['p50']:.4f} "
        f"[p10 {ratio['p10']:.4f}, p90 {ratio['p90']:.4f}]; direct - packed "
        f"{diff['p50']:+.3f} ms [p10 {diff['p10']:+.3f}, p90 {diff['p90']:+.3f}]. The "
        f"metadata µs packed saves per step, over the {t['steps_per_rep']} steps: "
        f"{saved:.3f} ms against a makespan of {p['makespan_ms']['p50']:.1f} ms")
    return "\n".join(lines)
