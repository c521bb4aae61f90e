"""The main job (``benchmarks/decode_bench.py``) runs every family and way, and its copy
classification goes by memory kinds, not labels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from h2d_kernels import copy_kind

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "kind"), [
    ("Memcpy HtoD (Pinned -> Device)", "H2D"),
    ("Memcpy HtoD (Pageable -> Device)", "H2D"),
    # a mislabelled pinned upload (the ROCm case the spec warns about) is still H2D
    ("Memcpy DtoD (Pinned -> Device)", "H2D"),
    ("Memcpy DtoH (Device -> Pinned)", "D2H"),
    ("Memcpy DtoD (Device -> Device)", "D2D"),
    ("Memcpy HtoD", "H2D"),
    ("Memcpy PtoP (Device -> Device)", "D2D"),
    ("Memcpy HtoH (Pinned -> Pageable)", "other:host-to-host"),
    # an end the runtime could not name: the label decides
    ("Memcpy HtoD (Unknown -> Device)", "H2D"),
    ("Memcpy DtoD (Pinned -> Unknown)", "D2D"),
    ("Memcpy HtoD (Managed -> Device)", "H2D"),
    ("void h2d_scatter_kernel<int>(...)", None),
])
def test_copies_are_classified_by_memory_kind(name: str, kind: str | None) -> None:
    assert copy_kind(name) == kind


def _main_job(out: Path, *extra: str) -> tuple[list[dict[str, Any]], str]:
    """The main job on CPU (batch size 2, one round of two steps per way): its result
    rows and its stdout."""
    env = {**os.environ, "H2D_BENCH_FORCE_CPU": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_bench.py"), "--out",
           str(out), "--batch-sizes", "2", "--rounds", "1", "--chunk", "2",
           "--warmup", "1", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "decode_bench.json").read_text())["results"], done.stdout


def test_main_job_runs_every_family_and_way(tmp_path: Path) -> None:
    results, stdout = _main_job(tmp_path)
    got = {(r["family"], r["way"]) for r in results}
    assert got == {(f, w) for f in ("mha", "v41", "mtp", "gdn")
                   for w in ("packed", "direct", "atom")}
    for r in results:
        assert r["host_us_p50"] > 0 and r["ms_per_output_token"] > 0
        assert r["steps"] == 2  # one round of two steps per way
        if r["way"] == "packed":
            per = r["library_per_step"]
            groups = 2 if r["family"] == "v41" else 1
            assert per["dmas"] == groups and per["scatters"] == groups
        if r["way"] == "direct":
            assert r["library_per_step"]["dmas"] == 0
    assert "| bs | way |" in stdout
    # the library's MHA ways: the metadata by part, and the same step alone in this process
    for r in results:
        if r["family"] == "mha" and r["way"] != "atom":
            assert list(r["parts_us_p50"]) == ["begin", "producers", "publish", "finish",
                                               "consumers"]
            assert all(v > 0 for v in r["parts_us_p50"].values()), r["parts_us_p50"]
            assert r["isolated_us_p50"] > 0 and r["gc_us_per_step"] >= 0
        else:
            assert "parts_us_p50" not in r and "isolated_us_p50" not in r
    assert "mha: metadata host µs p50 by part, in the loop [alone]" in stdout
    # each per-size line names its metric
    sizes = [line for line in stdout.splitlines() if " bs=2: " in line]
    assert len(sizes) == 4 and all("metadata host µs per step (p50): packed " in line
                                   for line in sizes), sizes


def test_the_plot_leaves_out_ratios_a_cpu_run_cannot_compare() -> None:
    """On a CPU, the ATOM-style way of the families whose packed consumers run interpreted
    is not drawn (its caption says not comparable); on CUDA every way is."""
    from main_job_output import drawn_ways

    for fam in ("v41", "mtp", "gdn", "deepseek_v4"):
        assert drawn_ways(fam, cuda=False) == ["direct"]
        assert drawn_ways(fam, cuda=True) == ["direct", "atom"]
    assert drawn_ways("mha", cuda=False) == ["direct", "atom"]


def test_main_job_runs_deepseek_v4(tmp_path: Path) -> None:
    """The real DeepSeek-V4 family (transformers' model, the tiny CPU config) on every way:
    packed sends each of its two groups as one DMA + one scatter, direct none; every row
    has the metadata's share of the step's host work."""
    if os.environ.get("H2D_REQUIRE_TRANSFORMERS") != "1":
        pytest.importorskip("transformers")
    results, stdout = _main_job(tmp_path, "--families", "deepseek_v4")
    assert {r["way"] for r in results} == {"packed", "direct", "atom"}
    for r in results:
        assert r["family"] == "deepseek_v4" and r["steps"] == 2
        assert r["tokens_per_s"] > 0 and 0 < r["metadata_share_p50"] < 1
        per = r["library_per_step"]
        if r["way"] == "packed":
            assert per["dmas"] == 2 and per["scatters"] == 2 and per["direct_copies"] == 0
        if r["way"] == "direct":
            assert per["dmas"] == 0 and per["direct_copies"] > 0
    assert "deepseek_v4: transformers DeepseekV4ForCausalLM" in stdout


def test_main_job_runs_the_nanovllm_row(tmp_path: Path) -> None:
    """``--nanovllm``: the real-engine row (``nanovllm_bench.py``'s CPU smoke mode here)
    joins the job's JSON and prints its tables; each library runner publishes once per
    decode step."""
    from nanovllm_harness.availability import require_nanovllm

    require_nanovllm()
    _, stdout = _main_job(tmp_path, "--families", "mha", "--nanovllm")
    report = json.loads((tmp_path / "decode_bench.json").read_text())["nanovllm"]
    rows = report["summary"]["rows"]
    assert {(r["bs"], r["way"]) for r in rows} == {
        (2, way) for way in ("stock", "library", "graphs")}
    for r in rows:
        assert r["step_us_median"] > 0
        if r["way"] != "stock":
            assert r["library_decode_per_step"]["publications"] == 1
    assert "nano-vllm (a real engine): " in stdout and "way / stock" in stdout


@pytest.mark.parametrize("script", ["step_targets.py", "v41_step.py", "mtp_step.py"])
def test_step_benchmarks_run_every_way_on_cpu(tmp_path: Path, script: str) -> None:
    """The step benchmarks the docs cite run from a checkout, with every way, on CPU (the
    Triton interpreter): packed sends one DMA + one scatter per group."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--device", "cpu", "--out",
           str(tmp_path), "--batch-sizes", "2", "--rounds", "2", "--chunk", "2",
           "--context", "2048"]
    if script == "step_targets.py":
        cmd += ["--warmup", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())
    ways = {"step_targets.py": ("packed", "packed-eager", "direct", "atom", "mrv2"),
            "v41_step.py": ("packed", "launched", "direct", "atom"),
            "mtp_step.py": ("packed", "direct", "atom")}[script]
    for r in rows:
        assert all(len(r[f"{w}_us_chunks"]) == 2 for w in ways), r.keys()
    if script == "step_targets.py":
        assert rows[0]["packed_per_step"] == {"dmas": 1.0, "scatters": 1.0,
                                              "direct_copies": 0.0}
    assert "| bs |" in done.stdout and "[" in done.stdout  # the table with packed's spread
