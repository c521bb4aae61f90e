"""The host cost of a steady step as a deterministic count: callgrind instructions per step.

What is counted, per family, on CPU (``device="cpu"``, ``scatter="reference"``, two slots,
``backend="packed"``): one steady step from ``state.begin()`` through the family's producer
calls and ``state.publish`` to ``state.finish()``, all of it counted. On CPU ``publish``
runs the CPU arena's reference scatter (``h2d_kernels``' ``_publish_cpu_reference``: the
"DMA" and the scatter as host copies), so its figure is the host side of a publication
plus CPU copies a GPU would do; it changes whenever that path does (re-record with
``--write-budgets``). The block table's published record moves as in an engine, so the
next stage sends only the changed rows.

* ``mha``: ``DecodeStepInputs.prepare`` at bs=64, 128K-token contexts, 16-token pages,
  1/16 of the rows append a page each step (``steady_decode_batches``, built as
  ``benchmarks/step_targets.py`` builds it);
* ``v41``: ``TokenStepInputs.prepare`` + ``V41MetadataInputs.begin_step`` at bs=64, 128K
  contexts (``benchmarks/v41_step.py``'s batches); both groups published;
* ``mtp``: ``DecodeStepInputs(max_drafts=1).prepare_verify`` (the step and its
  verification indices in one call) at bs=64, 32K contexts, k=1 verify steps
  (``benchmarks/mtp_step.py``'s batches);
* ``gdn``: ``mha``'s step with ``GdnStateInputs`` riding in its group (the GDN hybrid's
  decode step, as ``decode_runner/qwen3next_runner.py`` runs it: ``DecodeStepInputs(...,
  extra_groups=[GDN_STATE])``, then ``gdn.prepare(state_groups)``, non-speculative, each
  request keeping its state group), the same batches as ``mha``;
* ``shared``: ``mha``'s step with its sampling and token adapters shared with a prefill
  step (``DecodeStepInputs.from_adapters`` and ``PrefillStepInputs.from_adapters``: two
  combined groups carry those members, as ``decode_runner/runner.py`` declares them), the
  same batches as ``mha``: its counts go to both groups' records;
* ``prefill``: ``PrefillStepInputs.prepare`` over a 2,048-token chunk: 4 requests of long
  prompts, 512 tokens each a step (32 pages appended per row), prompts already
  8K-32K tokens in, ids staged from the host (:class:`PrefillChunks`).

How: each run is a child Python process under ``valgrind --tool=callgrind
--instr-atstart=no``, so the torch import and the setup run uninstrumented (about 5x
faster than instrumented). The child builds the state, steps ``--warmup`` steps, builds
``--n2`` batches (the same batches in every run), then ``gc.collect(); gc.freeze()`` (as
engines do after warm-up: a full collection then never walks torch's objects). Through
callgrind's client requests (a 3-function C helper compiled here against
``valgrind/callgrind.h``, called through ctypes) it starts instrumentation, steps ``--n1``
of the batches (dump ``n1``: they bring the counted path to its steady state), steps the
other ``n2 - n1`` (dump ``steps``), dumps once more at once (``calibration``: one dump
call) and stops. A run's figure is (steps - calibration) / (n2 - n1). The environment is
fixed: ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` = 1,
``torch.set_num_threads(1)``, ``PYTHONHASHSEED=0``.

The count is exact for one process image, not for the step: a run repeated as it was
gives the same figure under any CPU load, but where the heap puts the names and objects
the steps touch moves it (CPython's type-attribute cache is indexed by the names'
addresses; allocator paths depend on the pools), and that changes with the repository's
path, the environment, the script's text. So each family runs in ``--layouts`` heap
layouts (3; the child allocates ``layout * 211`` small objects before importing the
packages) and its figure is their median; the layouts' spread is the count's
uncertainty, 0.1-0.8% of a step (prefill the least, v41 and mtp the most), and the
median of 3 moves less. The count also depends on the interpreter, numpy, torch and the
compiler that built the compiled core; the budget file records the first three, and the
check names both environments when a family fails.

``--check`` compares each measured family with ``benchmarks/instruction_budgets.json`` and
exits 1 naming every family more than the file's tolerance (2%) over its budget: tight
enough that a few percent of added work fails (``benchmarks/tests/
test_instruction_budgets.py`` injects ~3%), loose enough for the layouts' spread (<1%).
``--write-budgets`` measures and writes the figures there (other families' entries stay):
after an intended change of the counted path, ``python benchmarks/instructions.py
--write-budgets --jobs 2`` re-records every family in one command (18 callgrind runs of
~14 s of CPU each: about 2 minutes on two idle cores). ``--results FILE`` reads a
previous ``--out`` JSON instead of measuring. ``H2D_INSTR_EXTRA_WORK=N`` (environment)
adds a Python loop of ``N`` iterations to every counted step (about 250 instructions an
iteration with CPython 3.11 at small ``N``: 25 add 3.1% to ``mha``): a costlier step, to
see the check fail; it is refused with ``--write-budgets``.

    python benchmarks/instructions.py [--families mha,v41,mtp,gdn,prefill] [--n1 20]
        [--n2 120] [--warmup 50] [--layouts 3] [--jobs 1] [--check | --write-budgets]
        [--budgets FILE] [--results FILE] [--out DIR]

Needs ``valgrind`` and a C compiler (``$CC`` or ``cc``) with valgrind's headers (Debian's
``valgrind`` package ships them; Fedora's ``valgrind-devel``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BUDGETS = HERE / "instruction_budgets.json"
FAMILIES = ("mha", "v41", "mtp", "gdn", "prefill", "shared")
BS = 64
WHAT = ("callgrind instructions (Ir) per steady step on CPU: state.begin() + the family's "
        "producer calls + state.publish (the CPU arena's reference scatter) + state.finish()")
#: how far over its budget a family may measure: heap layouts move a figure by under 1%,
#: so 2% leaves room for that and fails a few percent of added work
TOLERANCE = 0.02
#: what the child process runs under: fixed thread counts and hashing
CHILD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "PYTHONHASHSEED": "0"}
EXTRA_WORK = "H2D_INSTR_EXTRA_WORK"
HELPER_C = r"""
#include <valgrind/callgrind.h>
void h2d_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void h2d_cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
void h2d_cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""


class MeasureError(RuntimeError):
    """A measurement could not be made (tool missing, child failed, output unreadable)."""


# --------------------------------------------------------------------------- child side
@dataclass
class Setup:
    """A family ready to step: ``loop(work)`` steps each item of ``work`` (begin, the
    producers, publish, finish); ``counters()`` gives each publication group's counters
    afterwards."""

    loop: Callable[[Sequence[Any]], None]
    warm: list[Any]
    work: list[Any]
    counters: Callable[[], dict[str, dict[str, int]]]


def _costlier(fn: Callable[..., Any], iterations: int) -> Callable[..., Any]:
    """``fn`` behind ``iterations`` of Python work (the ``H2D_INSTR_EXTRA_WORK`` hook)."""
    if iterations <= 0:
        return fn

    def costlier(*args: Any, **kwargs: Any) -> Any:
        x = 0
        for i in range(iterations):
            x += i
        return fn(*args, **kwargs)

    return costlier


def _counters(state: Any, groups: Sequence[str]) -> Callable[[], dict[str, dict[str, int]]]:
    def read() -> dict[str, dict[str, int]]:
        out = {}
        for g in groups:
            c = state.counters(g)
            out[g] = {"publications": c.publications, "dmas": c.dmas, "scatters": c.scatters,
                      "direct_copies": c.direct_copies}
        return out

    return read


def _state() -> Any:
    from h2d_core import H2DRunnerState

    return H2DRunnerState("cpu", backend="packed", num_slots=2, scatter="reference")


def _setup_mha(warmup: int, built: int, extra: int) -> Setup:
    return _decode_setup("mha", warmup, built, extra, gdn=False)


def _setup_gdn(warmup: int, built: int, extra: int) -> Setup:
    return _decode_setup("gdn", warmup, built, extra, gdn=True)


def _setup_shared(warmup: int, built: int, extra: int) -> Setup:
    return _decode_setup("shared", warmup, built, extra, gdn=False, shared=True)


def _decode_setup(family: str, warmup: int, built: int, extra: int, *, gdn: bool,
                  shared: bool = False) -> Setup:
    """``mha``'s step, or with ``gdn`` the GDN hybrid's: the state indices riding in the
    decode step's group, produced after it (``decode_runner/qwen3next_runner.py``); with
    ``shared`` the sampling and token adapters also serve a prefill step's group."""
    import numpy as np
    from decode_runner.scheduler import steady_decode_batches
    from step_targets import PAGE, WINDOW

    from h2d_runner_adapters import (
        DECODE_STEP,
        GDN_STATE,
        DecodeStepInputs,
        GdnStateInputs,
        StepShape,
    )

    context = 131072
    if warmup + built >= WINDOW:
        # step WINDOW restarts every row (a fully replaced batch): not a steady step
        raise MeasureError(f"{family}: warm-up + n2 must stay under {WINDOW} steps, got "
                           f"{warmup} + {built}")
    per_row = -(-(context + PAGE - 1 + WINDOW) // PAGE)
    shape = StepShape(max_reqs=BS, max_tokens=BS, max_pages_per_req=per_row, page_size=PAGE)
    state = _state()
    # the GDN group first: the decode step combines it (as the runner declares them)
    states = GdnStateInputs(state, max_reqs=BS, num_state_slots=BS) if gdn else None
    if shared:
        from h2d_runner_adapters import (
            MhaDecodeInputs,
            PrefillInputs,
            PrefillStepInputs,
            SamplingInputs,
            TokenInputs,
        )

        sampling = SamplingInputs(state, BS)
        tokens = TokenInputs(state, max_reqs=BS, max_tokens=BS)
        step = DecodeStepInputs.from_adapters(
            sampling, tokens, MhaDecodeInputs(state, shape, fuse_kv_indices=False))
        PrefillStepInputs.from_adapters(sampling, tokens, PrefillInputs(state, shape))
    else:
        step = DecodeStepInputs(state, shape, extra_groups=[GDN_STATE] if gdn else (),
                                fuse_kv_indices=False)
    state.bind()
    # the engine's state groups: request i keeps group i (its allocator's work, uncounted)
    groups = np.arange(BS, dtype=np.int32)
    batches = steady_decode_batches(BS, context, PAGE, window=WINDOW)
    warm = [next(batches) for _ in range(warmup)]
    work = [next(batches) for _ in range(built)]
    for b in (*warm, *work):
        b.columns, b.block_tables  # noqa: B018  (both are built lazily: build them now)
    begin, finish, publish = state.begin, state.finish, state.publish
    prepare = _costlier(step.prepare, extra)
    if states is None:
        def loop(items: Sequence[Any]) -> None:
            for b in items:
                begin()
                prepare(b)
                publish(DECODE_STEP)
                finish()
    else:
        prepare_states = states.prepare

        def loop(items: Sequence[Any]) -> None:
            for b in items:
                begin()
                prepare(b)
                prepare_states(groups)
                publish(DECODE_STEP)
                finish()

    return Setup(loop, warm, work, _counters(state, [DECODE_STEP]))


def _setup_v41(warmup: int, built: int, extra: int) -> Setup:
    import numpy as np
    from v41_step import ENVELOPE, TOPK, WINDOW, Batches

    from h2d_runner_adapters import (
        TOKEN_INPUTS,
        V4_BLOCK,
        V41_METADATA,
        BatchColumns,
        ScheduledBatch,
        TokenStepInputs,
        V41MetadataInputs,
    )

    context = 131072
    blocks = -(-(context + 8192) // V4_BLOCK)  # room for 8192 steps
    state = _state()
    tokens = TokenStepInputs(state, max_reqs=BS, max_tokens=BS)
    v4 = V41MetadataInputs(state, max_reqs=BS, max_tokens=BS, max_blocks_per_req=blocks,
                           dummy_state_slot=BS, dummy_block=0, window=WINDOW,
                           index_topk=TOPK, fp8=True, envelope_rows=ENVELOPE,
                           fuse_step_indptrs=False)
    state.bind()
    n = BS
    columns = BatchColumns(
        query_lens=np.ones(n, np.int32), context_lens=np.full(n, context, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
        token_ids=np.zeros(n, np.int32), num_drafts=np.zeros(n, np.int32))
    batch = ScheduledBatch((), False, V4_BLOCK, given_columns=columns)
    batches = Batches(BS, context)
    warm = [batches.step()[:2] for _ in range(warmup)]
    work = [batches.step()[:2] for _ in range(built)]
    begin, finish, publish = state.begin, state.finish, state.publish
    prepare, begin_step = _costlier(tokens.prepare, extra), v4.begin_step

    def loop(items: Sequence[Any]) -> None:
        for item in items:
            spans, rows = item
            begin()
            prepare(batch)
            begin_step(spans, block_tables=rows)
            publish(TOKEN_INPUTS)
            publish(V41_METADATA)
            finish()

    return Setup(loop, warm, work, _counters(state, [TOKEN_INPUTS, V41_METADATA]))


def _setup_mtp(warmup: int, built: int, extra: int) -> Setup:
    from mtp_step import PAGE, Batches

    from h2d_runner_adapters import DECODE_STEP, DecodeStepInputs, StepShape

    context, k = 32768, 1
    per_row = -(-(context + 200 * (k + 1) + 4 * k + 64) // PAGE)
    state = _state()
    shape = StepShape(max_reqs=BS, max_tokens=BS * (k + 1), max_pages_per_req=per_row,
                      page_size=PAGE)
    step = DecodeStepInputs(state, shape, max_drafts=k, fuse_kv_indices=False)
    state.bind()
    batches = Batches(BS, context, k)
    warm = [batches.step()[0] for _ in range(warmup)]
    work = [batches.step()[0] for _ in range(built)]
    for b in (*warm, *work):
        b.columns, b.block_tables  # noqa: B018
    begin, finish, publish = state.begin, state.finish, state.publish
    prepare = _costlier(step.prepare_verify, extra)

    def loop(items: Sequence[Any]) -> None:
        for b in items:
            begin()
            prepare(b)
            publish(DECODE_STEP)
            finish()

    return Setup(loop, warm, work, _counters(state, [DECODE_STEP]))


class PrefillChunks:
    """Steady chunked-prefill steps: ``reqs`` requests with long prompts, each advancing
    ``tokens`` tokens a step (a ``reqs * tokens``-token chunk), request ``r`` starting
    ``START + r * STAGGER`` tokens into its prompt (so the rows cross pages at different
    offsets). Each row's table (its own pages) grows by the step's pages, as a new
    lineage copy, as the scheduler of ``benchmarks/llama_family.py`` does; ids are staged
    from the host (no deferred rows), greedy sampling, no drafts."""

    START, STAGGER = 8192, 8192 + 37
    #: the steps a row can take before its prompt passes 128K + START tokens
    MAX_STEPS = 256

    def __init__(self, reqs: int, tokens: int, page: int) -> None:
        import numpy as np

        from block_tables import BlockTable

        self.reqs, self.tokens, self.page = reqs, tokens, page
        self.done = np.array([self.START + r * self.STAGGER for r in range(reqs)], np.int32)
        self.max_pages = -(-(int(self.done.max()) + tokens * self.MAX_STEPS) // page)
        self.tables = [BlockTable(range(r * self.max_pages,
                                        r * self.max_pages + -(-int(d) // page)))
                       for r, d in enumerate(self.done)]
        self.ids = (np.arange(reqs * tokens, dtype=np.int32) * 7919) % 32000
        self.steps = 0

    def step(self) -> Any:
        import numpy as np

        from h2d_runner_adapters import BatchColumns, ScheduledBatch

        if self.steps >= self.MAX_STEPS:
            raise MeasureError(f"prefill: warm-up + n2 must stay within {self.MAX_STEPS} "
                               "steps (the prompts' declared length)")
        self.steps += 1
        n, page = self.reqs, self.page
        self.done += self.tokens
        for r in range(n):
            need = -(-int(self.done[r]) // page) - len(self.tables[r])
            if need:
                t = self.tables[r].lineage_copy()
                base = r * self.max_pages + len(t)
                t.append(range(base, base + need))
                self.tables[r] = t
        cols = BatchColumns(
            query_lens=np.full(n, self.tokens, np.int32), context_lens=self.done.copy(),
            temperatures=np.zeros(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=self.ids.copy(), num_drafts=np.zeros(n, np.int32))
        return ScheduledBatch((), True, page, given_columns=cols,
                              given_block_tables=list(self.tables))


def _setup_prefill(warmup: int, built: int, extra: int) -> Setup:
    from h2d_runner_adapters import PREFILL_STEP, PrefillStepInputs, StepShape

    reqs, tokens, page = 4, 512, 16
    batches = PrefillChunks(reqs, tokens, page)
    state = _state()
    step = PrefillStepInputs(state, StepShape(max_reqs=reqs, max_tokens=reqs * tokens,
                                              max_pages_per_req=batches.max_pages,
                                              page_size=page))
    state.bind()
    warm = [batches.step() for _ in range(warmup)]
    work = [batches.step() for _ in range(built)]
    for b in (*warm, *work):
        b.columns, b.block_tables  # noqa: B018
    begin, finish, publish = state.begin, state.finish, state.publish
    prepare = _costlier(step.prepare, extra)

    def loop(items: Sequence[Any]) -> None:
        for b in items:
            begin()
            prepare(b)
            publish(PREFILL_STEP)
            finish()

    return Setup(loop, warm, work, _counters(state, [PREFILL_STEP]))


SETUPS: dict[str, Callable[[int, int, int], Setup]] = {
    "mha": _setup_mha, "v41": _setup_v41, "mtp": _setup_mtp, "gdn": _setup_gdn,
    "prefill": _setup_prefill, "shared": _setup_shared}


#: the layout padding's objects, alive for the whole child
_PAD: list[Any] = []


def child(family: str, n1: int, n2: int, warmup: int, layout: int, helper: Path) -> None:
    """Run inside callgrind: set up (after ``layout``'s padding), warm up, then count steps
    ``[0, n1)`` (dump ``n1``), steps ``[n1, n2)`` (dump ``steps``) and the dump call alone
    (dump ``calibration``). Prints the groups' counters as one JSON line."""
    import ctypes

    from repo_paths import use_sources

    use_sources()
    import torch

    torch.set_num_threads(1)
    # Where the heap puts the interned names and objects the steps touch changes their
    # count (CPython's type-attribute cache is indexed by the names' addresses, and
    # obmalloc's and malloc's paths depend on the pools): up to ~1% between two processes
    # that differ only in a path or the script's text. Small objects of several sizes
    # allocated before the packages are imported give each layout index another heap.
    _PAD.extend(str(i) * (1 + i % 9) for i in range(layout * 211))
    lib = ctypes.CDLL(str(helper))
    for name in ("h2d_cg_start", "h2d_cg_stop"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = None, []
    lib.h2d_cg_dump.restype, lib.h2d_cg_dump.argtypes = None, [ctypes.c_char_p]

    setup = SETUPS[family](warmup, n2, int(os.environ.get(EXTRA_WORK, "0")))
    setup.loop(setup.warm)
    first, second = setup.work[:n1], setup.work[n1:n2]
    dump = lib.h2d_cg_dump
    gc.collect()
    gc.freeze()
    lib.h2d_cg_start()
    dump(b"start")
    # the first n1 steps only bring the counted path to its steady state (as in the n1
    # steps of the warm-up); everything between the "n1" and "steps" dumps is counted,
    # publish included: n2 - n1 steps and one dump call, which "calibration" measures
    setup.loop(first)
    dump(b"n1")
    setup.loop(second)
    dump(b"steps")
    dump(b"calibration")
    lib.h2d_cg_stop()
    print(json.dumps({"counters": setup.counters()}))


# --------------------------------------------------------------------------- parent side
def build_helper(folder: Path) -> Path:
    """Compile the client-request helper into ``folder``; raise MeasureError saying what
    is missing when it cannot be built."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise MeasureError(f"no C compiler {cc!r} on PATH: install gcc (or set CC)")
    source, lib = folder / "h2d_callgrind.c", folder / "h2d_callgrind.so"
    source.write_text(HELPER_C)
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(source)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise MeasureError(
            "cannot build the callgrind client-request helper (needs valgrind/callgrind.h: "
            f"Debian's valgrind package, Fedora's valgrind-devel): {proc.stderr.strip()}")
    return lib


def missing_tools() -> str | None:
    """Why nothing can be measured here (valgrind, compiler or headers missing), or None."""
    if shutil.which("valgrind") is None:
        return "valgrind is not on PATH (Debian: apt-get install valgrind)"
    with tempfile.TemporaryDirectory() as folder:
        try:
            build_helper(Path(folder))
        except MeasureError as exc:
            return str(exc)
    return None


def read_parts(out_file: Path) -> dict[str, int]:
    """Ir totals of the labelled dumps of one callgrind run (``out_file``.1, .2, ...)."""
    parts: dict[str, int] = {}
    for path in out_file.parent.glob(out_file.name + ".*"):
        label, total = None, None
        with path.open() as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    label = line.split(":", 3)[3].strip()
                elif line.startswith("summary:"):
                    total = int(line.split()[1])
                    break
        if label is not None and total is not None:
            parts[label] = total
    missing = {"steps", "calibration"} - set(parts)
    if missing:
        raise MeasureError(f"callgrind output {out_file}.*: no dump labelled {sorted(missing)}")
    return parts


def run_child(family: str, layout: int, args: argparse.Namespace, helper: Path,
              folder: Path) -> dict[str, Any]:
    """One callgrind run of ``family`` in heap layout ``layout``: its dumps, its figure
    and the child's counters."""
    out_file = folder / f"{family}.layout{layout}.callgrind"
    for stale in folder.glob(out_file.name + "*"):
        stale.unlink()
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
           f"--callgrind-out-file={out_file}", sys.executable, str(Path(__file__).resolve()),
           "--child", family, "--n1", str(args.n1), "--n2", str(args.n2),
           "--warmup", str(args.warmup), "--layout", str(layout), "--helper", str(helper)]
    proc = subprocess.run(cmd, env={**os.environ, **CHILD_ENV}, capture_output=True,
                          text=True, cwd=HERE)
    if proc.returncode != 0:
        raise MeasureError(f"{family} (layout {layout}) failed under callgrind, exit "
                           f"{proc.returncode}:\n{proc.stderr[-3000:]}")
    parts = read_parts(out_file)
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise MeasureError(f"{family} (layout {layout}): the child printed no counters")
    counters = json.loads(lines[-1])["counters"]
    for group, c in counters.items():
        if c["publications"] != args.warmup + args.n2:
            raise MeasureError(f"{family}: group {group!r} published {c['publications']} "
                               f"times, expected {args.warmup + args.n2}")
    figure = round((parts["steps"] - parts["calibration"]) / (args.n2 - args.n1), 1)
    return {"layout": layout, "steps": args.n2 - args.n1, "steps_ir": parts["steps"],
            "calibration_ir": parts["calibration"], "per_step": figure,
            "counters": counters}


def measure(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Every requested family in ``--layouts`` heap layouts: figures and the runs behind
    them. A family's figure is the median of its layouts' (one layout's figure is exact
    and repeatable; the layouts' spread is the count's uncertainty)."""
    helper = build_helper(folder)
    tasks = [(f, layout) for f in args.families for layout in range(args.layouts)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {t: pool.submit(run_child, t[0], t[1], args, helper, folder)
                   for t in tasks}
        runs = {t: fut.result() for t, fut in futures.items()}
    families = {}
    for f in args.families:
        detail = [runs[(f, layout)] for layout in range(args.layouts)]
        figures = [r["per_step"] for r in detail]
        families[f] = {"per_step": statistics.median(figures), "layouts": figures,
                       "spread": round(max(figures) - min(figures), 1), "detail": detail}
    return {"what": WHAT, "settings": settings(args), "environment": environment(),
            "families": families}


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"n1": args.n1, "n2": args.n2, "warmup": args.warmup, "layouts": args.layouts,
            "bs": BS, "extra_work": int(os.environ.get(EXTRA_WORK, "0"))}


def environment() -> dict[str, str]:
    """What the count depends on besides the code: interpreter, libraries, valgrind."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    vg = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    return {"python": f"{platform.python_implementation()} {platform.python_version()}",
            "numpy": version("numpy"), "torch": version("torch"),
            "valgrind": vg.stdout.strip() if vg.returncode == 0 else "missing",
            "machine": platform.machine()}


def _limit(budget: int, tolerance: float) -> float:
    # rounded: 100,000 * 1.15 is 114,999.99999999999 in binary floating point
    return round(budget * (1 + tolerance), 6)


def check(results: dict[str, Any], budgets: dict[str, Any], path: Path) -> list[str]:
    """One message per measured family over its budget by more than the tolerance (or
    without a budget)."""
    tolerance = float(budgets["tolerance"])
    failures = []
    for family, res in results["families"].items():
        entry = budgets["families"].get(family)
        if entry is None:
            failures.append(f"family {family!r}: no budget in {path}; measure it and run "
                            "--write-budgets")
            continue
        budget, figure = int(entry["budget"]), float(res["per_step"])
        limit = _limit(budget, tolerance)
        if figure > limit:
            note = ""
            if entry.get("environment") != results.get("environment"):
                note = (f" (the budget was measured with {entry.get('environment')}, this "
                        f"run with {results.get('environment')})")
            if budgets.get("what", results["what"]) != results["what"]:
                # e.g. budgets recorded before publish was counted: not comparable
                note += (f" (budgets of another count: the file's are {budgets['what']!r}, "
                         f"this run's {results['what']!r})")
            failures.append(
                f"family {family!r}: {figure:,.0f} instructions per step is more than "
                f"{tolerance:.0%} over its budget of {budget:,} (limit {limit:,.0f}){note}. "
                "Find what the step gained (callgrind_annotate the 'steps' dumps under "
                "--out DIR); if the cost is intended, run --write-budgets and commit "
                f"{path.name}")
    return failures


def write_budgets(results: dict[str, Any], path: Path) -> None:
    """Set each measured family's budget to its figure; keep the other families."""
    if results["settings"].get("extra_work"):
        raise MeasureError(f"{EXTRA_WORK} was set for this measurement: not a budget")
    data: dict[str, Any] = (json.loads(path.read_text()) if path.is_file()
                            else {"tolerance": TOLERANCE, "families": {}})
    data["what"] = WHAT
    data["tolerance"] = data.get("tolerance", TOLERANCE)
    for family, res in results["families"].items():
        data["families"][family] = {"budget": round(res["per_step"]),
                                    "settings": results["settings"],
                                    "environment": results["environment"]}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def table(results: dict[str, Any], budgets: dict[str, Any] | None) -> str:
    s, env = results["settings"], results["environment"]
    lines = [f"{results['what']}; bs={s['bs']}, n1={s['n1']}, n2={s['n2']}, warm-up "
             f"{s['warmup']}; {env['python']}, numpy {env['numpy']}, torch {env['torch']}, "
             f"{env['valgrind']}"]
    if s.get("extra_work"):
        lines.append(f"{EXTRA_WORK}={s['extra_work']}: every step carries extra Python work "
                     "(a test of the check, not a measurement)")
    tolerance = float(budgets["tolerance"]) if budgets else 0.0
    lines += [f"| family | Ir per step | layouts (spread) | budget | limit (+{tolerance:.0%}) "
              "| status |", "|---|---:|---|---:|---:|---|"]
    for family, res in results["families"].items():
        entry = (budgets or {}).get("families", {}).get(family)
        reps = ", ".join(f"{x:,.0f}" for x in res["layouts"])
        if entry is None:
            budget = limit = status = "-"
        else:
            b = int(entry["budget"])
            budget, limit = f"{b:,}", f"{_limit(b, tolerance):,.0f}"
            status = "over" if res["per_step"] > _limit(b, tolerance) else "ok"
            if res["per_step"] < b * (1 - tolerance):
                status = "ok (well under: --write-budgets?)"
        lines.append(f"| {family} | {res['per_step']:,.0f} | {reps} ({res['spread']:,.0f}) | "
                     f"{budget} | {limit} | {status} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--n1", type=int, default=20)
    ap.add_argument("--n2", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--layouts", type=int, default=3,
                    help="heap layouts measured per family (one callgrind run each); the "
                    "figure is their median")
    ap.add_argument("--jobs", type=int, default=1, help="callgrind runs at once")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write-budgets", action="store_true")
    ap.add_argument("--budgets", type=Path, default=BUDGETS)
    ap.add_argument("--results", type=Path, default=None,
                    help="a previous --out DIR's instructions.json instead of measuring")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=FAMILIES, help=argparse.SUPPRESS)
    ap.add_argument("--layout", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--helper", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    if not 0 < args.n1 < args.n2 or args.warmup < 1 or args.layouts < 1 or args.jobs < 1:
        ap.error("need 0 < n1 < n2, warmup >= 1, layouts >= 1 and jobs >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args.child, args.n1, args.n2, args.warmup, args.layout, args.helper)
        return 0
    try:
        if args.results is not None:
            results = json.loads(args.results.read_text())
        elif args.out is not None:
            folder = args.out / "callgrind"
            folder.mkdir(parents=True, exist_ok=True)
            results = measure(args, folder)
        else:
            with tempfile.TemporaryDirectory() as temp:
                results = measure(args, Path(temp))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "instructions.json").write_text(json.dumps(results, indent=1))
        if args.write_budgets:
            write_budgets(results, args.budgets)
        budgets = json.loads(args.budgets.read_text()) if args.budgets.is_file() else None
    except MeasureError as exc:
        print(f"instructions: {exc}", file=sys.stderr)
        return 2
    print(table(results, budgets))
    if args.check:
        if budgets is None:
            print(f"instructions: no budget file {args.budgets}", file=sys.stderr)
            return 2
        failures = check(results, budgets, args.budgets)
        for message in failures:
            print(f"instruction budget exceeded: {message}", file=sys.stderr)
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
