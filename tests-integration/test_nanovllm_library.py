"""The library as nano-vllm's metadata path, on CPU, against stock nano-vllm.

``nanovllm_harness/library_runner.py`` is a ``ModelRunner`` subclass whose
``prepare_prefill``, ``prepare_decode`` and ``prepare_sample`` publish through one
``H2DRunnerState`` (``PrefillStepInputs`` / ``DecodeStepInputs``: one producer call, one
publication per step) and hand nano-vllm's ``set_context`` views of the published
destinations. Each run is a subprocess over the stock test's workload and harness
(``nanovllm_harness/stock_cpu.py``: six requests, two prefix-cache hits, a page appended
while decoding; bf16, the fork's code path untouched) plus a preemption phase
(``stock_cpu.PREEMPT_STEP``: E is preempted while F holds their shared first block, so its
re-prefill under the same ``seq_id`` is a prefix-cache hit on a new page list, the case the
lineage mapping must start a new lineage for). Stock runs ``stock_cpu.py``; the library runs
``library_cpu.py``, whose runner also runs stock's ``prepare_*`` on every scheduled batch
and records the differences. Two variants: near-greedy (the stock test's temperature) and
seeded sampling (``stock_cpu.SAMPLED``: per-request temperatures, top-k and top-p; the fork's
sampler draws its noise from torch's global CPU generator, seeded, so two stock runs give
the same tokens, checked here).

Asserted, for both variants:

* identical tokens, request by request, stock against the library;
* every member nano-vllm reads equals stock's upload for the same scheduled batch, step by
  step: ``input_ids``, ``positions``, ``cu_seqlens_q`` / ``cu_seqlens_k``, ``max_seqlen_q`` /
  ``max_seqlen_k``, ``slot_mapping``, ``context_lens``, block tables (each row's pages;
  width and None-ness too; stock pads with -1, the library's table with 0), temperatures,
  top-k / top-p (tensor or None), cfg scales and repetition penalties (values; host
  tensors on the library's side);
* one publication per prefill / decode step (the step group's counters: 1 publication,
  1 DMA, 1 scatter, no direct copy; the other group nothing; ``prepare_sample``
  publishes nothing), and no ``Tensor.cuda`` / ``Tensor.to`` / ``Tensor.copy_`` call in
  the library's ``prepare_*`` (the CPU harness makes ``Tensor.cuda`` a copy).

Mutation (``H2D_NANOVLLM_MUTATION=stale_lineage``, read only by ``library_cpu.py``): the
lineage mapping keeps a re-allocated sequence's old lineage and appends only past its
length. E's re-prefill then publishes E's old second page; the published block table and
KV slots differ from stock's from that step on, and the test must see it. (The tokens stay
equal: the stale page is E's own freed page, still holding E's keys for the same positions,
written and read through the same wrong slots, and no request takes it before E ends. The
member check is what catches it.)

Skips when ``nanovllm`` is not installed, unless ``H2D_REQUIRE_NANOVLLM=1``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nanovllm_harness.availability import require_nanovllm
from nanovllm_harness.library_cpu import MUTATION_ENV
from nanovllm_harness.library_runner import SequenceLineages
from nanovllm_harness.stock_cpu import BLOCK, PREEMPTED

HARNESS_ROOT = Path(__file__).parent  # tests-integration: nanovllm_harness's parent
TIMEOUT_S = 300
#: name: (script, flags, extra environment): the runs the tests read
RUNS: dict[str, tuple[str, tuple[str, ...], dict[str, str]]] = {
    "stock": ("stock_cpu", ("--preempt",), {}),
    "library": ("library_cpu", ("--preempt",), {}),
    "stock_sampled": ("stock_cpu", ("--preempt", "--sampled"), {}),
    "stock_sampled_again": ("stock_cpu", ("--preempt", "--sampled"), {}),
    "library_sampled": ("library_cpu", ("--preempt", "--sampled"), {}),
    "library_mutant": ("library_cpu", ("--preempt",), {MUTATION_ENV: "stale_lineage"}),
    "library_graphs": ("library_cpu", ("--preempt", "--graphs"), {}),
    "library_graphs_mutant": ("library_cpu", ("--preempt", "--graphs"),
                              {MUTATION_ENV: "unpadded_replay"}),
}


# -- the lineage mapping alone ----------------------------------------------------------------

class _Seq:
    """What :class:`SequenceLineages` reads of a nano-vllm ``Sequence``."""

    def __init__(self, seq_id: int, pages: list[int]) -> None:
        self.seq_id, self.block_table = seq_id, pages


def test_sequence_lineages_append_or_start_over() -> None:
    lineages = SequenceLineages()
    a = _Seq(1, [3, 7])
    t = lineages.row(a)
    assert t.tolist() == [3, 7]
    version = t.version
    assert lineages.row(a) is t and t.version == version          # unchanged: the same table
    a.block_table.append(9)                                       # may_append: in place
    assert lineages.row(a) is t and t.tolist() == [3, 7, 9] and t.version == version
    for rewrite in ([3, 8, 9], [4, 7, 9], [3, 7], [5, 7, 9, 11]):  # re-allocated, shrunk
        a.block_table[:] = rewrite
        u = lineages.row(a)
        assert u.tolist() == rewrite and u.version != version, rewrite
        version = u.version
    b = _Seq(2, [3, 7, 9])  # another sequence with the same pages: a lineage of its own
    assert lineages.row(b).version != version
    assert [r.tolist() for r in lineages.rows([b, a])] == [[3, 7, 9], [5, 7, 9, 11]]
    del a
    gc.collect()
    assert len(lineages) == 1  # a lineage goes with its sequence


def test_sequence_lineages_mutation_keeps_a_stale_lineage() -> None:
    """The switch the library test turns on: a re-allocated list keeps the old lineage."""
    lineages = SequenceLineages(stale_on_rewrite=True)
    a = _Seq(1, [3, 7])
    t = lineages.row(a)
    a.block_table[:] = [3, 8, 10]  # a prefix-cache hit on 3, then new pages
    assert lineages.row(a) is t and t.tolist() == [3, 7, 10]  # stale: 7 stays


# -- nano-vllm: stock against the library -----------------------------------------------------

def _start(script: str, model_dir: Path, flags: tuple[str, ...],
           env_extra: dict[str, str]) -> subprocess.Popen[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop(MUTATION_ENV, None)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HARNESS_ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", f"nanovllm_harness.{script}",
                             str(model_dir), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(name: str, proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{name} ran past {TIMEOUT_S} s:\n{err[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{name} failed ({proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_nanovllm()
    from nanovllm_harness.model_dir import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("nanovllm") / "qwen3", dtype="bfloat16")


def _runs(model_dir: Path, *names: str) -> dict[str, dict[str, Any]]:
    """The runs of :data:`RUNS` named, started at once (each process uses one torch
    thread); each test starts its own, so none runs twice under xdist."""
    procs = {name: _start(RUNS[name][0], model_dir, RUNS[name][1], RUNS[name][2])
             for name in names}
    try:
        return {name: _finish(name, proc) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _check_workload(run: dict[str, Any]) -> None:
    """The workload ran as meant: both prefix-cache hits, the preemption's re-prefill (a
    hit under the same seq_id), every request's full length."""
    assert run["dtype"] == "bfloat16"
    seen = [(p["name"], p["cached"]) for p in run["prefills"]]
    assert seen == [("A", 0), ("B", BLOCK), ("C", 0), ("D", 0), ("E", 0), ("F", BLOCK),
                    (PREEMPTED, BLOCK)], run["prefills"]
    for name, req in run["requests"].items():
        assert len(req["tokens"]) == req["max_tokens"], name


def _tokens_differ(stock: dict[str, Any], library: dict[str, Any]) -> list[str]:
    return [f"{name}: stock {req['tokens']}\n    library {library['requests'][name]['tokens']}"
            for name, req in stock["requests"].items()
            if req["tokens"] != library["requests"][name]["tokens"]]


def _step_problems(run: dict[str, Any]) -> list[str]:
    """Each step's departures from stock's uploads, publication counts and copies."""
    problems = []
    groups = {"prefill": "prefill_step", "decode": "decode_step"}
    for i, step in enumerate(run["steps"]):
        where = f"step {i} ({step['kind']}, seq_ids {step['seq_ids']})"
        for m in step["mismatches"]:
            problems.append(f"{where}: {m['member']}: stock {m['stock']}, library "
                            f"{m['library']}")
        for pad in step["padding"]:
            if set(pad["stock"]) != {-1} or set(pad["library"]) != {0}:
                problems.append(f"{where}: block-table padding {pad}")
        for group, c in step["counters"].items():
            want = (1, 1, 1, 0) if groups.get(step["kind"]) == group else (0, 0, 0, 0)
            got = (c["publications"], c["dmas"], c["scatters"], c["direct_copies"])
            if got != want:
                problems.append(f"{where}: {group} counters {c}, want (publications, dmas, "
                                f"scatters, direct_copies) = {want}")
        if any(step["calls"].values()):
            problems.append(f"{where}: tensor copies in the library's path: {step['calls']}")
    return problems


def _check_library_run(stock: dict[str, Any], library: dict[str, Any]) -> None:
    _check_workload(stock)
    _check_workload(library)
    assert library["prefills"] == stock["prefills"]
    wrong = _tokens_differ(stock, library)
    assert not wrong, "tokens differ:\n" + "\n".join(wrong)
    kinds = [s["kind"] for s in library["steps"]]
    assert kinds.count("prefill") == 4 and kinds.count("decode") > 20  # prefill steps: 4
    assert kinds.count("sample") == kinds.count("prefill") + kinds.count("decode")
    problems = _step_problems(library)
    assert not problems, "\n".join(problems[:20])


def test_library_runner_near_greedy_equals_stock(model_dir: Path) -> None:
    runs = _runs(model_dir, "stock", "library")
    _check_library_run(runs["stock"], runs["library"])
    sources = {(k, v) for s in runs["library"]["steps"] for k, v in s.get("sources", {}).items()}
    assert ("temperatures", "published") in sources


def test_library_runner_seeded_sampling_equals_stock(model_dir: Path) -> None:
    runs = _runs(model_dir, "stock_sampled", "stock_sampled_again", "library_sampled")
    stock, again = runs["stock_sampled"], runs["stock_sampled_again"]
    # the comparison means something: two stock runs under the seed agree
    assert not _tokens_differ(stock, again), "stock's seeded sampling is not reproducible"
    _check_library_run(stock, runs["library_sampled"])
    sources = {(k, v) for s in runs["library_sampled"]["steps"]
               for k, v in s.get("sources", {}).items()}
    # per-request filters published, uniform ones stock uploads as device fills
    assert {("top_ks", "published"), ("top_ps", "published"), ("top_ks", "device fill"),
            ("top_ps", "device fill")} <= sources, sources


def test_stale_lineage_mutation_is_detected(model_dir: Path) -> None:
    """The mutant keeps E's lineage over its re-allocation: its published block table and
    KV slots leave stock's at E's re-prefill, which the member check reports (the correct
    mapping's run on the same workload has no mismatch:
    :func:`test_library_runner_near_greedy_equals_stock`)."""
    mutant = _runs(model_dir, "library_mutant")["library_mutant"]
    assert mutant["mutation"] == "stale_lineage"
    _check_workload(mutant)
    e = next(p["seq_id"] for p in mutant["prefills"] if p["name"] == PREEMPTED)
    steps = mutant["steps"]
    bad = [i for i, s in enumerate(steps) if s["mismatches"]]
    assert bad, "the stale lineage went unnoticed"
    first = steps[bad[0]]
    assert first["kind"] == "prefill" and first["seq_ids"] == [e]
    assert {m["member"].split("[")[0] for m in first["mismatches"]} == {
        "slot_mapping", "block_tables"}
    assert all(e in steps[i]["seq_ids"] for i in bad)


def test_graph_native_runner_pads_its_publication(model_dir: Path) -> None:
    """The graph-native runner (``nanovllm_harness/library_graphs.py``): each decode step
    publishes padded to a capture size (here :data:`library_cpu.TEST_GRAPH_SIZES`, so every
    decode batch of the workload pads: 4 requests to 8, 2 and 1 to 3) and the model reads
    the padded destinations (on CPU the graph's body runs in place of a replay). Tokens,
    members and publication counts as for the plain library runner. Its mutant publishes
    unpadded while the replay reads the padded size: the padded rows' stale slots then
    overwrite live KV, and the tokens leave stock's."""
    runs = _runs(model_dir, "stock", "library_graphs", "library_graphs_mutant")
    stock, graphs = runs["stock"], runs["library_graphs"]
    _check_library_run(stock, graphs)
    sizes = {(s["num_seqs"], s["replay_size"]) for s in graphs["steps"]
             if s["kind"] == "decode"}
    assert sizes == {(4, 8), (2, 3), (1, 3)}, sizes
    mutant = runs["library_graphs_mutant"]
    assert mutant["mutation"] == "unpadded_replay"
    _check_workload(mutant)
    assert _tokens_differ(stock, mutant), "a replay over stale padding went unnoticed"
