"""The library as nano-vllm's metadata path on CUDA, bf16, under nano-vllm's CUDA graphs.

The CPU test (``test_nanovllm_library.py``) on a GPU, as the fork ships there: stock
nano-vllm and the library runner (``nanovllm_harness/library_runner.py``, checked step by
step as on CPU) each run the workload with its preemption phase, near-greedy, in a
subprocess of its own (``nanovllm_harness/library_cuda.py``), one after the other, with
``enforce_eager=False``: every decode step replays one of nano-vllm's captured graphs (the
fork copies the step's context into its graph's static buffers, then replays), prefill
steps run eagerly. None of the harness's CPU patches is applied; only the flash-attn
stand-in and the rope wrapper.

The graph-native runner (``nanovllm_harness/library_graphs.py``, ``graphs``) runs the same
workload with its decode graphs captured over the library's destinations, at sizes that
pad every decode batch (``library_cpu.TEST_GRAPH_SIZES``).

Asserted: identical tokens request by request, stock against each library runner; every
run replayed a graph for every decode step (the model's eager forwards are the prefill
steps); one publication per prefill / decode step (1 DMA, 1 scatter, no direct copy);
every member nano-vllm reads equal to stock's upload of the same batch; no ``Tensor.cuda``
call in the library's ``prepare_*``. Between a profiled decode step's start and its replay
(``library_cuda.PreReplay``) the graph-native runner's device activity is exactly the
library's one host-to-device copy and one scatter kernel: no copy or fill before a replay.

Needs ``RUN_H2D_GPU_TESTS=1`` and a CUDA device (``@pytest.mark.gpu``), and nano-vllm
(skipped without it unless ``H2D_REQUIRE_NANOVLLM=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nanovllm_harness.library_cpu import MUTATION_ENV, TEST_GRAPH_SIZES
from nanovllm_harness.library_cuda import PROFILED_DECODE_STEPS
from nanovllm_harness.stock_cpu import BLOCK, PREEMPTED

HARNESS_ROOT = Path(__file__).parent
TIMEOUT_S = 900  # a torch.compile warm-up and graph captures per run


def _run(runner: str, model_dir: Path) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop(MUTATION_ENV, None)
    env.pop("TRITON_INTERPRET", None)  # the fork's Triton kernel and ours compiled
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HARNESS_ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "nanovllm_harness.library_cuda",
                           str(model_dir), runner],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{runner} nano-vllm on CUDA failed ({proc.returncode}):\n"
                    f"{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_library_runner_equals_stock_under_cuda_graphs(tmp_path: Path) -> None:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        pytest.fail("RUN_H2D_GPU_TESTS=1 but no CUDA device is visible", pytrace=False)
    if importlib.util.find_spec("nanovllm") is None:
        why = "nanovllm is not installed (pip install nano-vllm-fork==20260210 xxhash)"
        if os.environ.get("H2D_REQUIRE_NANOVLLM") == "1":
            pytest.fail(f"{why} and H2D_REQUIRE_NANOVLLM=1", pytrace=False)
        pytest.skip(why)
    from nanovllm_harness.model_dir import write_model_dir

    model_dir = write_model_dir(tmp_path / "qwen3", dtype="bfloat16")
    stock = _run("stock", model_dir)
    library = _run("library", model_dir)
    graphs = _run("graphs", model_dir)

    for run in (stock, library, graphs):
        assert run["dtype"] == "bfloat16"
        assert [(p["name"], p["cached"]) for p in run["prefills"]][-1] == (PREEMPTED, BLOCK)
        assert run["graph_sizes"], "no CUDA graph captured"
        # decode steps replayed graphs: the eager forwards are the prefill steps
        assert run["eager_forwards"] == run["prefill_steps"] == 4, run
        assert run["decode_steps"] > 20
        assert len(run["pre_replay"]) == len(PROFILED_DECODE_STEPS), run["pre_replay"]
        assert all(p["replayed"] for p in run["pre_replay"]), run["pre_replay"]
    for run in (library, graphs):
        _check_library_run(stock, run)
    assert graphs["graph_sizes"] == list(TEST_GRAPH_SIZES)
    sizes = {(s["num_seqs"], s["replay_size"]) for s in graphs["steps"]
             if s["kind"] == "decode"}
    assert sizes == {(4, 8), (2, 3), (1, 3)}, sizes
    # nothing between the publication and the replay: the DMA and the scatter only
    for p in graphs["pre_replay"]:
        assert (p["copies"], p["memsets"]) == ({"H2D": 1}, 0), (p, stock["pre_replay"])
        assert len(p["kernels"]) == 1 and "scatter" in p["kernels"][0], p
    # stock uploads, then copies into its graphs' five buffers (device-to-device copies,
    # or a copy kernel for a strided slice; the H200 shows 8 H2D, 4 D2D and 1 kernel)
    for p in stock["pre_replay"]:
        assert p["copies"].get("H2D", 0) >= 5, p
        assert p["copies"].get("D2D", 0) + len(p["kernels"]) >= 5, p


def _check_library_run(stock: dict[str, Any], library: dict[str, Any]) -> None:
    assert library["prefills"] == stock["prefills"]
    wrong = [name for name, req in stock["requests"].items()
             if req["tokens"] != library["requests"][name]["tokens"]]
    assert not wrong, {n: (stock["requests"][n]["tokens"], library["requests"][n]["tokens"])
                       for n in wrong}

    groups = {"prefill": "prefill_step", "decode": "decode_step"}
    problems = []
    for i, step in enumerate(library["steps"]):
        where = f"step {i} ({step['kind']}, seq_ids {step['seq_ids']})"
        problems += [f"{where}: {m['member']} differs: stock {m['stock']}, library "
                     f"{m['library']}" for m in step["mismatches"]]
        for group, c in step["counters"].items():
            want = (1, 1, 1, 0) if groups.get(step["kind"]) == group else (0, 0, 0, 0)
            got = (c["publications"], c["dmas"], c["scatters"], c["direct_copies"])
            if got != want:
                problems.append(f"{where}: {group} counters {c}, want {want}")
        if step["calls"].get("cuda"):
            problems.append(f"{where}: Tensor.cuda in the library's path: {step['calls']}")
    assert not problems, "\n".join(problems[:20])
    assert sum(s["kind"] == "decode" for s in library["steps"]) > 20
