"""nano-vllm end to end, stock against the library as its metadata path.

The engine is nano-vllm (PyPI ``nano-vllm-fork==20260210``, unedited) run three ways:

* ``stock``: its own ``ModelRunner`` (``prepare_decode`` uploads input ids, positions,
  slot mapping, context lengths and block tables with one ``.cuda()`` each,
  ``prepare_sample`` temperatures and cfg scales);
* ``library``: ``tests-integration/nanovllm_harness/library_runner.py``'s
  ``LibraryModelRunner``, whose ``prepare_prefill`` / ``prepare_decode`` publish the step
  through one ``H2DRunnerState`` (one packed DMA + one scatter per step) and whose
  ``prepare_sample`` hands out views of that publication; nano-vllm's graphs as stock;
* ``graphs``: the same runner with its decode graphs captured over the library's
  destinations (``nanovllm_harness/library_graphs.py``, nano-vllm's capture sizes): each
  decode step publishes padded to its graph's size and the replay follows, with none of
  stock's copies and fills into static buffers.

**One engine per process, the ways alternating by rounds.** Two live engines cannot share a
process: ``ModelRunner.__init__`` calls ``dist.init_process_group`` (NCCL, world size 1)
unconditionally, and a second call raises while the first group lives (it is destroyed only
by the engine's ``atexit`` exit); the ``torch.compile``'d layers (RMSNorm, SiLU, rotary,
sampler) are module-level code whose dynamo caches, guards and recompile limit two models
would share, so the second engine would run code compiled differently from the first;
``LLMEngine`` picks its runner class from a module-level name and ``set_context`` is a
process global. So each round runs each way in a child process of its own (this script with
``--child``), one after the other, with the order flipped every other round (stock,
library, graphs; graphs, library, stock; ...) so a drift of the lent host's speed within
the run falls on every way alike. Each child builds its engine once (``max_num_seqs`` = the
largest batch size), then measures every batch size in turn. Figures are reported per round
and as the median over rounds; ratios are each library way / stock of the same round, their
median and their spread (min-max over rounds). ``--time-budget`` (360 s) starts no round
that the last one's duration says would end past it (the first round, which also compiles
nano-vllm's layers cold, always runs), so a slow host drops the third round rather than run
past about 6 minutes; ``--json`` is rewritten after every child, so an interrupted run
keeps what it measured.

**Model.** One random-weight model directory (``nanovllm_harness.model_dir``), shared by
every child: Qwen3-0.6B-shaped by default (hidden 1024, 28 layers, 16 query / 8 key-value
heads, head_dim 128, intermediate 3072, vocabulary 151936, tied embeddings, bf16);
``--tiny`` uses the harness's small config (the CPU smoke mode). Attention is the
harness's flash-attn stand-in (``flash_attn_standin.py``, torch SDPA over the paged cache;
no flash-attn wheel exists for this torch), the same in every way: the tokens per second
are not flash-attn's. The stand-in's decode gathers every block-table column, so contexts
are kept moderate: ``max_model_len`` is the prompt plus the decoded tokens rounded up to
256-token blocks (one block by default).

**Workload per batch size** ``bs``: ``bs`` requests of ``--prompt-len`` random tokens (the
same in every way), ``ignore_eos``, ``--decode-steps`` new tokens after the prefill's, all
prefilled in one step (``max_num_batched_tokens`` >= ``bs`` x prompt) and decoded together
(``max_num_seqs`` >= ``bs``). CUDA graphs on (``enforce_eager=False``) on CUDA; the KV cache
(``--gpu-memory-utilization``, by default sized from the largest batch) is checked to hold
every request at once: the fork crashes when it preempts. Sampling: temperature 1.0, no
top-k / top-p, and ``--repetition-penalty`` 1.1 by default: the fork's inverted flag
(``engine/model_runner.py`` lines 321-322) uploads the penalties only when every one is
exactly 1.0, and then ``run()`` reads each back with ``.item()`` (a host sync per sequence
per step) -- a stock cost the library runner avoids by keeping them on the host, unrelated
to the publication; pass ``--repetition-penalty 1.0`` to include it. Per batch size, in
each child: two warm-up batches (the prefill shape's recompile, the sampler's, the graphs'
first replays, the library's first prefill over replaced rows), the timed batch, then a
counting batch.

**Measured** (host side, ``time.perf_counter_ns``):

* host µs of the runner's ``prepare_prefill``, ``prepare_decode`` and ``prepare_sample``
  (instance-level timing wrappers; p50 and p90 over the decode steps; ``prepare_prefill``
  is the timed batch's one call) and of ``engine.step()`` (p50 over the decode steps);
* decode tokens/s: ``bs`` x decode steps over the decode phase's wall clock, with a
  ``torch.cuda.synchronize()`` at the phase's two ends only;
* TTFT: from the first ``add_request`` to the prefill step's return (its tokens are on the
  host: nano-vllm's ``run`` ends with ``.tolist()``);
* H2D copies per decode step by kind, in the separate counting batch only (never while
  timing): calls of ``Tensor.cuda``, ``Tensor.to`` (to CUDA, from the host),
  ``Tensor.copy_`` (host to device), ``torch.tensor(..., device=cuda)`` and device
  ``Tensor.fill_`` / ``zero_`` made inside ``prepare_*`` and ``run_model``, through
  temporary wrappers installed for each such call; plus the library's own publication
  counters (``runner.h2d_state.counters(group)``: publications, DMAs, scatters) over the
  timed batch. Calls made inside the library's ``publish`` are kept apart (its DMA is
  counted once, as a DMA). nano-vllm's graph replay adds, for ``stock`` and ``library``,
  the copies into its static buffers (device to device, not counted) and two fills and a
  zero (counted); ``graphs`` has none.

On CPU (no CUDA device, or ``--cpu``) only ``--tiny`` runs: the children apply the
harness's CPU patches (``compat.patch_for_cpu``: never on CUDA), eager, bf16, one thread.
It checks that every way and size runs; its figures predict no GPU host (every "device" is
the host there, so ``copy_`` / ``fill_`` counts include host copies, the Triton
interpreter's among them).

    python benchmarks/nanovllm_bench.py [--batch-sizes 1,8,64,256] [--decode-steps 64]
        [--prompt-len 128] [--rounds 3] [--time-budget 360] [--json PATH] [--tiny] [--cpu]
        [--eager] [--repetition-penalty 1.1] [--gpu-memory-utilization F] [--model-dir D]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from repo_paths import use_sources

use_sources()

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
WAYS = ("stock", "library", "graphs")
#: the ways whose runner is the library's
LIBRARY_WAYS = WAYS[1:]
#: nano-vllm's KV block (the fork requires a multiple of 256)
BLOCK = 256
#: Qwen3-0.6B's shape (``Qwen3Config`` keywords over the harness's ``model_dir.CONFIG``)
QWEN3_06B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, tie_word_embeddings=True, eos_token_id=151645)
#: the copy kinds counted per decode step (H2D) and the device fills
COPY_KINDS = ("cuda", "to", "copy_", "tensor")
FILL_KINDS = ("fill_", "zero_")
CHILD_TIMEOUT_S = 600


# -- the child: one engine, every batch size ---------------------------------------------
class Probe:
    """Instance-level wrappers around the runner's ``prepare_*`` and ``run_model``: host ns
    per call (by step kind) and, while ``counting``, the tensor calls made inside them."""

    METHODS = ("prepare_prefill", "prepare_decode", "prepare_sample", "run_model")

    def __init__(self, runner: Any, device_type: str) -> None:
        self.device_type = device_type
        self.kind = "prefill"
        self.counting = False
        self.in_publish = 0
        self.counts: Counter[str] = Counter()
        self.prefill_sizes: list[int] = []
        self.ns: dict[str, list[int]] = {}
        self.clear()
        self.state = getattr(runner, "h2d_state", None)
        for name in self.METHODS:
            setattr(runner, name, self._wrap(name, getattr(runner, name)))

    def clear(self) -> None:
        self.ns = {k: [] for k in ("prepare_prefill", "prepare_decode", "prepare_sample:prefill",
                                   "prepare_sample:decode", "run_model:prefill",
                                   "run_model:decode")}
        self.prefill_sizes = []

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        from time import perf_counter_ns

        def timed(*a: Any, **k: Any) -> Any:
            if name == "prepare_prefill":
                self.kind = "prefill"
                self.prefill_sizes.append(len(a[0]))
            elif name == "prepare_decode":
                self.kind = "decode"
            key = name if name.startswith("prepare_") and name != "prepare_sample" \
                else f"{name}:{self.kind}"
            undo = self._patch() if self.counting and self.kind == "decode" else None
            t0 = perf_counter_ns()
            try:
                return method(*a, **k)
            finally:
                dt = perf_counter_ns() - t0
                if undo is not None:
                    undo()
                self.ns[key].append(dt)

        return timed

    def _patch(self) -> Callable[[], None]:
        """Count tensor calls until the returned function restores torch."""
        import torch

        T, dev, counts = torch.Tensor, self.device_type, self.counts
        names = ("cuda", "to", "copy_", "fill_", "zero_")
        saved = {n: getattr(T, n) for n in names}
        own = {n: n in T.__dict__ for n in names}  # else inherited from torch._C.TensorBase
        factory = torch.tensor

        def bump(kind: str) -> None:
            counts[f"in_publish:{kind}" if self.in_publish else kind] += 1

        def names_cuda(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
            for x in (*a, k.get("device")):
                if isinstance(x, torch.Tensor):
                    return x.device.type == "cuda"
                if isinstance(x, (str, torch.device)):
                    return torch.device(x).type == "cuda"
            return False

        def cuda(t: Any, *a: Any, **k: Any) -> Any:
            bump("cuda")
            return saved["cuda"](t, *a, **k)

        def to(t: Any, *a: Any, **k: Any) -> Any:
            if t.device.type == "cpu" and names_cuda(a, k):
                bump("to")
            return saved["to"](t, *a, **k)

        def copy_(t: Any, src: Any, *a: Any, **k: Any) -> Any:
            if t.device.type == dev and isinstance(src, torch.Tensor) \
                    and src.device.type == "cpu":
                bump("copy_")
            return saved["copy_"](t, src, *a, **k)

        def fill_(t: Any, *a: Any, **k: Any) -> Any:
            if t.device.type == dev:
                bump("fill_")
            return saved["fill_"](t, *a, **k)

        def zero_(t: Any, *a: Any, **k: Any) -> Any:
            if t.device.type == dev:
                bump("zero_")
            return saved["zero_"](t, *a, **k)

        def tensor(*a: Any, **k: Any) -> Any:
            device = k.get("device")
            if device is not None and torch.device(device).type == "cuda":
                bump("tensor")
            return factory(*a, **k)

        for n, f in (("cuda", cuda), ("to", to), ("copy_", copy_), ("fill_", fill_),
                     ("zero_", zero_)):
            setattr(T, n, f)
        torch.tensor = tensor
        state = self.state
        if state is not None:  # the library's publication: its own copies kept apart
            publish = state.publish

            def published(*a: Any, **k: Any) -> Any:
                self.in_publish += 1
                try:
                    return publish(*a, **k)
                finally:
                    self.in_publish -= 1

            state.publish = published

        def undo() -> None:  # torch.Tensor exactly as it was
            for n, f in saved.items():
                if own[n]:
                    setattr(T, n, f)
                else:
                    delattr(T, n)
            torch.tensor = factory
            if state is not None:
                del state.publish  # the class's method again

        return undo


def _prompts(n: int, length: int, vocab: int, eos: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random tokens (never ``eos``), the same in every way."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(1, vocab) for _ in range(length)]
        out.append([t if t != eos else 1 for t in p])
    return out


def _setup_child(args: argparse.Namespace, cuda: bool, kv_blocks: int) -> Any:
    """nano-vllm imported (flash-attn stand-in), its quirks wrapped; on CPU the harness's
    CPU patches first (process-wide: this child only). Returns ``nanovllm``."""
    from nanovllm_harness import compat

    if not cuda:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.model_dir)
        compat.patch_for_cpu(kv_blocks, compat.kv_block_bytes(hf_config, BLOCK))
    import torch
    from nanovllm_harness.flash_attn_standin import import_nanovllm

    if not cuda:
        torch.set_num_threads(1)
    torch.manual_seed(1234)
    nanovllm = import_nanovllm()
    import nanovllm.models.qwen3 as qwen3

    compat.patch_rope(qwen3)
    if not cuda:
        import nanovllm.layers.layernorm as layernorm

        compat.patch_rmsnorm_fp32(layernorm)  # float32 only; bf16 runs the fork's own
    if args.child in LIBRARY_WAYS:
        from nanovllm_harness.library_graphs import graph_runner_class
        from nanovllm_harness.library_runner import install

        install(graph_runner_class() if args.child == "graphs" else None)
    return nanovllm


def _counters(runner: Any, group: str) -> Any:
    state = getattr(runner, "h2d_state", None)
    return None if state is None else state.counters(group).snapshot()


def _per_step(after: Any, before: Any, steps: int) -> dict[str, float] | None:
    if after is None:
        return None
    return {k: v / steps for k, v in (after - before).as_dict().items()}


def _batch(llm: Any, nanovllm: Any, prompts: list[list[int]], max_tokens: int,
           penalty: float) -> None:
    params = nanovllm.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                     repetition_penalty=penalty)
    for p in prompts:
        llm.add_request(p, params)


def _measure_size(llm: Any, nanovllm: Any, probe: Probe, bs: int, args: argparse.Namespace,
                  cuda: bool, vocab: int, eos: int) -> dict[str, Any]:
    """One batch size: warm-up batch, timed batch, counting batch (see the docstring)."""
    import torch

    runner = llm.model_runner
    if probe.state is not None:
        from h2d_runner_adapters import DECODE_STEP, PREFILL_STEP
    else:
        DECODE_STEP = PREFILL_STEP = ""  # stock: no publication counters

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def drain() -> int:
        steps = 0
        while not llm.is_finished():
            llm.step()
            steps += 1
        return steps

    # warm-up: the same shapes as the timed batch, twice (a prefill over rows that replace
    # an earlier batch's takes paths a first prefill does not: one-time imports among them)
    for i, tokens in enumerate((1 + args.warmup, 2)):
        _batch(llm, nanovllm, _prompts(bs, args.prompt_len, vocab, eos, seed=bs + 1000 * i),
               tokens, args.repetition_penalty)
        drain()
    # timed
    prompts = _prompts(bs, args.prompt_len, vocab, eos, seed=10_000 + bs)
    gc.collect()
    sync()
    probe.clear()
    pf0 = _counters(runner, PREFILL_STEP)
    t0 = time.perf_counter_ns()
    _batch(llm, nanovllm, prompts, 1 + args.decode_steps, args.repetition_penalty)
    llm.step()  # the prefill: every request in one step
    ttft_ns = time.perf_counter_ns() - t0
    if probe.prefill_sizes != [bs]:
        raise RuntimeError(f"bs={bs}: the prefill was {probe.prefill_sizes} sequences, not "
                           f"one step of {bs} (max_num_batched_tokens / KV cache too small?)")
    pf1 = _counters(runner, PREFILL_STEP)
    d0 = _counters(runner, DECODE_STEP)
    step_ns = []
    sync()
    t1 = time.perf_counter_ns()
    while not llm.is_finished():
        s0 = time.perf_counter_ns()
        llm.step()
        step_ns.append(time.perf_counter_ns() - s0)
    sync()
    decode_ns = time.perf_counter_ns() - t1
    d1 = _counters(runner, DECODE_STEP)
    if len(step_ns) != args.decode_steps or len(probe.ns["prepare_decode"]) != args.decode_steps:
        raise RuntimeError(f"bs={bs}: {len(step_ns)} decode steps, "
                           f"{len(probe.ns['prepare_decode'])} prepare_decode calls; want "
                           f"{args.decode_steps} of each (a preemption?)")
    ns = {k: list(v) for k, v in probe.ns.items()}
    # counting: tensor calls inside prepare_* and run_model of decode steps, never timed
    probe.counts.clear()
    _batch(llm, nanovllm, _prompts(bs, args.prompt_len, vocab, eos, seed=20_000 + bs),
           1 + args.count_steps, args.repetition_penalty)
    llm.step()
    probe.counting = True
    try:
        counted = drain()
    finally:
        probe.counting = False
    counts = {k: v / counted for k, v in sorted(probe.counts.items())}
    us = {k: [x / 1e3 for x in v] for k, v in ns.items()}
    return {
        "bs": bs, "ttft_ms": ttft_ns / 1e6, "decode_steps": len(step_ns),
        "decode_s": decode_ns / 1e9, "decode_tok_s": bs * len(step_ns) / (decode_ns / 1e9),
        "step_us": [x / 1e3 for x in step_ns],
        "prepare_prefill_us": us["prepare_prefill"][0],
        "prepare_sample_prefill_us": us["prepare_sample:prefill"][0],
        "run_model_prefill_us": us["run_model:prefill"][0],
        "prepare_decode_us": us["prepare_decode"],
        "prepare_sample_us": us["prepare_sample:decode"],
        "run_model_decode_us": us["run_model:decode"],
        "prep_us": [a + b for a, b in zip(us["prepare_decode"], us["prepare_sample:decode"],
                                          strict=True)],
        "h2d_calls_per_step": counts, "count_steps": counted,
        "library_decode_per_step": _per_step(d1, d0, len(step_ns)),
        "library_prefill": _per_step(pf1, pf0, 1),
    }


def child_main(args: argparse.Namespace) -> None:
    """One way: the engine, then every batch size; writes ``--child-out``."""
    t_start = time.perf_counter()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("no CUDA device: only --tiny runs on CPU")
    sizes = args.sizes
    max_bs = max(sizes)
    max_model_len = BLOCK * math.ceil((args.prompt_len + args.decode_steps + 1) / BLOCK)
    blocks_needed = max_bs * (max_model_len // BLOCK)
    nanovllm = _setup_child(args, cuda, kv_blocks=blocks_needed + 2)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model_dir)
    vocab, eos = hf.vocab_size, hf.eos_token_id
    options: dict[str, Any] = dict(
        enforce_eager=args.eager or not cuda, max_model_len=max_model_len,
        max_num_batched_tokens=max(max_bs * args.prompt_len, max_model_len),
        max_num_seqs=max_bs, kvcache_block_size=BLOCK)
    if cuda:
        util = args.gpu_memory_utilization
        if util is None:  # the largest batch's blocks and a half, and 5% for the rest
            from nanovllm_harness.compat import kv_block_bytes

            total = torch.cuda.mem_get_info()[1]
            util = min(0.9, 0.05 + (1.5 * blocks_needed + 16) * kv_block_bytes(hf, BLOCK)
                       / total)
        options["gpu_memory_utilization"] = round(util, 4)
    t_engine = time.perf_counter()
    llm = nanovllm.LLM(args.model_dir, **options)
    engine_s = time.perf_counter() - t_engine
    runner = llm.model_runner
    kv_blocks = len(llm.scheduler.block_manager.blocks)
    if kv_blocks < blocks_needed:
        raise SystemExit(f"the KV cache holds {kv_blocks} blocks, the largest batch needs "
                         f"{blocks_needed}: raise --gpu-memory-utilization (the fork crashes "
                         "when it preempts)")
    if args.child in LIBRARY_WAYS and getattr(runner, "h2d_state", None) is None:
        raise SystemExit("the library runner was not installed")
    probe = Probe(runner, "cuda" if cuda else "cpu")
    results = []
    for bs in sizes:
        t = time.perf_counter()
        row = _measure_size(llm, nanovllm, probe, bs, args, cuda, vocab, eos)
        row["measure_s"] = time.perf_counter() - t
        results.append(row)
    out = {
        "way": args.child, "round": args.round, "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "torch": torch.__version__, "dtype": str(runner.dtype).removeprefix("torch."),
        "engine": {**options, "num_kvcache_blocks": kv_blocks,
                   "graph_sizes": sorted(getattr(runner, "graphs", {}))},
        "runner_class": type(runner).__name__, "engine_s": engine_s,
        "child_s": time.perf_counter() - t_start, "results": results,
    }
    Path(args.child_out).write_text(json.dumps(out))


# -- the parent: the model, the rounds, the tables -----------------------------------------
def _pct(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def _med(xs: list[float]) -> float:
    return _pct(xs, 50)


def _run_child(way: int | str, rnd: int, args: argparse.Namespace, model_dir: Path,
               work: Path, cpu: bool) -> dict[str, Any]:
    out = work / f"{way}.{rnd}.json"
    log = work / f"{way}.{rnd}.log"
    cmd = [sys.executable, str(SCRIPT), "--child", str(way), "--round", str(rnd),
           "--child-out", str(out), "--model-dir", str(model_dir),
           "--batch-sizes", ",".join(map(str, args.sizes)), "--decode-steps",
           str(args.decode_steps), "--prompt-len", str(args.prompt_len), "--warmup",
           str(args.warmup), "--count-steps", str(args.count_steps),
           "--repetition-penalty", str(args.repetition_penalty)]
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    cmd += ["--tiny"] * args.tiny + ["--eager"] * args.eager
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU patches, and the library on the host too
    else:
        env.pop("TRITON_INTERPRET", None)  # the fork's Triton kernel and ours compiled
    t = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        tail = log.read_text()[-6000:]
        raise SystemExit(f"round {rnd}, {way}: the child failed ({done.returncode}):\n{tail}")
    run: dict[str, Any] = json.loads(out.read_text())
    run["wall_s"] = time.perf_counter() - t
    return run


def _write(path: str, obj: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1))


def summarise(runs: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Per (bs, way): per-round figures and their medians; per bs and library way: way /
    stock ratios, round by round, their median and min-max."""
    rows, ratios = [], []
    by = {(r["way"], r["round"]): {x["bs"]: x for x in r["results"]} for r in runs}
    rounds = sorted({r["round"] for r in runs})
    for bs in sizes:
        per: dict[str, dict[str, list[float]]] = {}
        for way in WAYS:
            xs = [by[(way, rnd)][bs] for rnd in rounds]
            fig = {
                "prep_us": [_med(x["prep_us"]) for x in xs],
                "step_us": [_med(x["step_us"]) for x in xs],
                "decode_tok_s": [x["decode_tok_s"] for x in xs],
                "ttft_ms": [x["ttft_ms"] for x in xs],
            }
            per[way] = fig
            pooled = {k: [v for x in xs for v in x[k]] for k in
                      ("prepare_decode_us", "prepare_sample_us", "step_us", "prep_us")}
            calls = xs[0]["h2d_calls_per_step"]
            copies = sum(v for k, v in calls.items() if k in COPY_KINDS)
            fills = sum(v for k, v in calls.items() if k in FILL_KINDS)
            lib = xs[0]["library_decode_per_step"]
            rows.append({
                "bs": bs, "way": way, "rounds": fig,
                **{f"{k}_median": _med(v) for k, v in fig.items()},
                "prepare_decode_us_p50": _med(pooled["prepare_decode_us"]),
                "prepare_decode_us_p90": _pct(pooled["prepare_decode_us"], 90),
                "prepare_sample_us_p50": _med(pooled["prepare_sample_us"]),
                "prepare_sample_us_p90": _pct(pooled["prepare_sample_us"], 90),
                "prep_us_p90": _pct(pooled["prep_us"], 90),
                "step_us_p90": _pct(pooled["step_us"], 90),
                "prepare_prefill_us_median": _med([x["prepare_prefill_us"] for x in xs]),
                "h2d_calls_per_step": calls,
                "h2d_copies_per_step": copies + (lib["dmas"] if lib else 0),
                "tensor_copies_per_step": copies, "device_fills_per_step": fills,
                "library_decode_per_step": lib, "library_prefill": xs[0]["library_prefill"],
            })
        for way in LIBRARY_WAYS:
            r: dict[str, Any] = {"bs": bs, "way": way}
            for k in ("prep_us", "step_us", "decode_tok_s", "ttft_ms"):
                rs = [a / b for a, b in zip(per[way][k], per["stock"][k], strict=True)]
                r[k] = {"rounds": rs, "median": _med(rs), "min": min(rs), "max": max(rs)}
            ratios.append(r)
    return {"rows": rows, "ratios": ratios}


def tables(summary: dict[str, Any], runs: list[dict[str, Any]], cuda: bool) -> str:
    """The markdown tables: the figures (medians over rounds), the ratios, per round, and
    the ``prepare_*`` detail."""
    out = ["| bs | way | prepare_decode+prepare_sample µs p50 | step µs p50 | decode tok/s "
           "| TTFT ms | H2D per decode step | device fills per step | publications / DMAs "
           "per step |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in summary["rows"]:
        calls = row["h2d_calls_per_step"]
        kinds = ", ".join(f"{k} {calls[k]:g}" for k in COPY_KINDS if calls.get(k))
        lib = row["library_decode_per_step"]
        if lib:
            kinds = ", ".join(x for x in (kinds, f"DMA {lib['dmas']:g}") if x)
            pubs = f"{lib['publications']:g} / {lib['dmas']:g}"
        else:
            pubs = "-"
        out.append(f"| {row['bs']} | {row['way']} | {row['prep_us_median']:.1f} | "
                   f"{row['step_us_median']:.0f} | {row['decode_tok_s_median']:,.0f} | "
                   f"{row['ttft_ms_median']:.1f} | {row['h2d_copies_per_step']:g} ({kinds}) | "
                   f"{row['device_fills_per_step']:g} | {pubs} |")
    out += ["", "way / stock, median over rounds (min-max); below 1: the way's is lower "
            "(for tok/s: slower)", "",
            "| bs | way | prepare_decode+prepare_sample µs | step µs | decode tok/s | TTFT |",
            "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in summary["ratios"]:
        cells = [f"{r[k]['median']:.2f} ({r[k]['min']:.2f}-{r[k]['max']:.2f})"
                 for k in ("prep_us", "step_us", "decode_tok_s", "ttft_ms")]
        out.append(f"| {r['bs']} | {r['way']} | " + " | ".join(cells) + " |")
    out += ["", "per round (in the order run)", "",
            "| round | way | bs | prepare µs p50 | step µs p50 | decode tok/s | TTFT ms |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        for x in run["results"]:
            out.append(f"| {run['round']} | {run['way']} | {x['bs']} | {_med(x['prep_us']):.1f} "
                       f"| {_med(x['step_us']):.0f} | {x['decode_tok_s']:,.0f} | "
                       f"{x['ttft_ms']:.1f} |")
    out += ["", "prepare_* host µs (decode steps of every round pooled; prefill: the median "
            "over rounds of the timed batch's one call)", "",
            "| bs | way | prepare_prefill | prepare_decode p50 / p90 | prepare_sample p50 / p90 "
            "| step p90 |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for row in summary["rows"]:
        out.append(f"| {row['bs']} | {row['way']} | {row['prepare_prefill_us_median']:.1f} | "
                   f"{row['prepare_decode_us_p50']:.1f} / {row['prepare_decode_us_p90']:.1f} | "
                   f"{row['prepare_sample_us_p50']:.1f} / {row['prepare_sample_us_p90']:.1f} | "
                   f"{row['step_us_p90']:.0f} |")
    if not cuda:
        out += ["", "CPU smoke run: the figures predict no GPU host (every device is the "
                "host: copy_/fill_ counts include host copies)."]
    return "\n".join(out)


def parent_main(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    if cpu and not args.tiny:
        raise SystemExit("no CUDA device (or --cpu): only the --tiny smoke mode runs on CPU")
    command = " ".join(["python", os.path.relpath(SCRIPT, Path.cwd()), *sys.argv[1:]])
    print(f"command: {command}\ntorch {torch.__version__}; "
          f"{'CPU (smoke mode, eager)' if cpu else 'CUDA'}", flush=True)
    from nanovllm_harness.model_dir import CONFIG, write_model_dir

    config = {} if args.tiny else QWEN3_06B
    with tempfile.TemporaryDirectory(prefix="nanovllm_bench.") as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        model_dir = Path(args.model_dir) if args.model_dir else work / "model"
        if not (model_dir / "config.json").exists():
            write_model_dir(model_dir, dtype="bfloat16", config=config)
        print(f"model: {'tiny (harness)' if args.tiny else 'Qwen3-0.6B-shaped'}, random "
              f"weights, bf16, at {model_dir} ({time.perf_counter() - t:.1f} s)", flush=True)
        runs: list[dict[str, Any]] = []
        round_s: list[float] = []
        for rnd in range(args.rounds):
            left = args.time_budget - (time.perf_counter() - t_start)
            if rnd and args.time_budget and round_s[-1] * 1.1 > left:
                print(f"time budget: {rnd} round(s) of {args.rounds} run, the next would "
                      f"end past {args.time_budget:.0f} s", flush=True)
                break
            t = time.perf_counter()
            for way in (WAYS if rnd % 2 == 0 else WAYS[::-1]):
                run = _run_child(way, rnd, args, model_dir, work, cpu)
                runs.append(run)
                print(f"round {rnd} {way} ({run['device']}): {run['wall_s']:.1f} s (engine "
                      f"{run['engine_s']:.1f} s); step µs p50 " + ", ".join(
                          f"bs={x['bs']} {_med(x['step_us']):.0f}" for x in run["results"]),
                      flush=True)
                if args.json:  # an interrupted run keeps what it measured
                    _write(args.json, {"meta": {"command": command, "partial": True},
                                       "runs": runs})
            round_s.append(time.perf_counter() - t)
    summary = summarise(runs, args.sizes)
    first = runs[0]
    rounds_run = len(round_s)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command,
        "device": first["device"], "torch": first["torch"], "cuda": first["cuda"],
        "dtype": first["dtype"], "runner_classes": {r["way"]: r["runner_class"] for r in runs},
        "model": {**CONFIG, **config}, "engine": first["engine"],
        "batch_sizes": args.sizes, "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps, "rounds": rounds_run,
        "rounds_asked": args.rounds, "round_s": round_s,
        "order": [f"{r['round']}:{r['way']}" for r in runs],
        "attention": "flash-attn stand-in (torch SDPA), the same in every way",
        "repetition_penalty": args.repetition_penalty,
        "wall_s": time.perf_counter() - t_start,
    }
    if args.json:
        _write(args.json, {"meta": meta, "summary": summary, "runs": runs})
    print(f"\ndevice: {meta['device']}; torch {meta['torch']}; {meta['dtype']}; CUDA graphs "
          f"{'off' if first['engine']['enforce_eager'] else 'on'}; prompt {args.prompt_len} "
          f"tokens, {args.decode_steps} decode steps; {rounds_run} round(s), one child "
          f"process per way and round, alternating; attention: the flash-attn stand-in "
          f"(the same in every way)\ncommand: {command}\n")
    print(tables(summary, runs, bool(first["cuda"])))
    print(f"\nwall: {meta['wall_s']:.0f} s" + (f"; raw figures: {args.json}" if args.json
                                                 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="prompt tokens per request (default 128; --tiny: 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=None,
                    help="decode steps of each size's warm-up batch (default 8; --tiny: 1)")
    ap.add_argument("--count-steps", type=int, default=None,
                    help="decode steps of each size's counting batch (default 3; --tiny: 2)")
    ap.add_argument("--repetition-penalty", type=float, default=1.1,
                    help="1.0 makes stock upload penalties and sync per sequence per step")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="nano-vllm's KV cache share of the GPU (default: the largest "
                         "batch's blocks and a half, plus 5%%)")
    ap.add_argument("--time-budget", type=float, default=360,
                    help="seconds: start no round that would end past this (the first "
                         "always runs; 0: no limit)")
    ap.add_argument("--tiny", action="store_true", help="the harness's small model")
    ap.add_argument("--cpu", action="store_true", help="run on CPU even with a GPU (--tiny)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--json", default=None, help="write every raw figure here")
    ap.add_argument("--model-dir", default=None, help="reuse (or write) the model here")
    ap.add_argument("--child", default=None, choices=WAYS, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = sorted({int(s) for s in args.batch_sizes.split(",") if s})
    args.prompt_len = args.prompt_len or (32 if args.tiny else 128)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 8)
    args.count_steps = args.count_steps or (2 if args.tiny else 3)
    if args.decode_steps < 1 or args.rounds < 1 or min(args.sizes) < 1:
        ap.error("--decode-steps, --rounds and every batch size must be positive")
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
