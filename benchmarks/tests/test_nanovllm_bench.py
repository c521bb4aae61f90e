"""The nano-vllm benchmark (``benchmarks/nanovllm_bench.py``) in its CPU smoke mode: the
harness's tiny model, batch sizes 1 and 2, three decode steps, one round (a stock child
and the two library children, each applying the harness's CPU patches in its own
process, eager, bf16). It must complete and report every way with positive figures, the
library ways' one publication (one DMA, one scatter) per decode step and per prefill,
stock's uploads as ``Tensor.cuda`` calls, and no device fill in the graph-native way.
And the counting pass's wrappers by themselves (no nano-vllm).

The smoke test skips when ``nanovllm`` is not installed, unless ``H2D_REQUIRE_NANOVLLM=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from nanovllm_harness.availability import require_nanovllm

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def test_nanovllm_bench_tiny_on_cpu(tmp_path: Path) -> None:
    require_nanovllm()
    out = tmp_path / "nanovllm_bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "nanovllm_bench.py"), "--tiny", "--cpu",
           "--batch-sizes", "1,2", "--decode-steps", "3", "--rounds", "1", "--json", str(out)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads(out.read_text())
    meta, summary, runs = report["meta"], report["summary"], report["runs"]
    assert meta["cuda"] is False and meta["dtype"] == "bfloat16"
    assert meta["order"] == ["0:stock", "0:library", "0:graphs"]
    assert meta["runner_classes"] == {"stock": "ModelRunner", "library": "LibraryModelRunner",
                                      "graphs": "GraphNativeRunner"}
    assert {(r["bs"], r["way"]) for r in summary["rows"]} == {
        (bs, way) for bs in (1, 2) for way in ("stock", "library", "graphs")}
    for run in runs:
        for x in run["results"]:
            assert x["decode_steps"] == 3 and len(x["step_us"]) == 3, x
            assert x["ttft_ms"] > 0 and x["decode_tok_s"] > 0
            assert min(x["step_us"] + x["prep_us"] + x["prepare_decode_us"]
                       + x["prepare_sample_us"]) > 0
            assert x["prepare_prefill_us"] > 0
    for row in summary["rows"]:
        for key in ("prep_us_median", "step_us_median", "decode_tok_s_median",
                    "ttft_ms_median", "prepare_decode_us_p90", "prepare_sample_us_p90"):
            assert row[key] > 0, (row["bs"], row["way"], key)
        if row["way"] != "stock":
            for per in (row["library_decode_per_step"], row["library_prefill"]):
                assert (per["publications"], per["dmas"], per["scatters"],
                        per["direct_copies"]) == (1, 1, 1, 0), per
            # no Tensor.cuda / .to / torch.tensor(device=cuda) upload in its path
            calls = row["h2d_calls_per_step"]
            assert not any(calls.get(k) for k in ("cuda", "to", "tensor")), calls
            assert row["h2d_copies_per_step"] >= 1
            if row["way"] == "graphs":  # nothing between the publication and the model
                assert row["device_fills_per_step"] == 0, calls
        else:
            assert row["library_decode_per_step"] is None
            # input ids, positions, slot mapping, context lengths, block tables,
            # temperatures, cfg scales: one .cuda() each
            assert row["h2d_calls_per_step"]["cuda"] == 7, row["h2d_calls_per_step"]
    assert {(r["bs"], r["way"]) for r in summary["ratios"]} == {
        (bs, way) for bs in (1, 2) for way in ("library", "graphs")}
    for r in summary["ratios"]:
        assert all(r[k]["median"] > 0 for k in ("prep_us", "step_us", "decode_tok_s",
                                                 "ttft_ms"))
    assert "| bs | way | prepare_decode+prepare_sample µs p50 |" in done.stdout
    assert "way / stock" in done.stdout and "device: CPU" in done.stdout


def test_counting_wrappers_count_inside_decode_steps_and_restore_torch() -> None:
    """The counting pass's wrappers (``Probe``): tensor calls inside a decode step's
    ``prepare_*`` / ``run_model`` are counted by kind, the library's ``publish`` apart;
    nothing is counted while timing or in a prefill; torch is left exactly as it was."""
    import torch
    from nanovllm_bench import Probe

    class State:
        def publish(self, group: str) -> None:
            torch.zeros(2).copy_(torch.ones(2))  # on CPU: host to "device"

    class Runner:
        def __init__(self) -> None:
            self.h2d_state = State()

        def prepare_prefill(self, seqs: list[int]) -> None:
            torch.zeros(2).fill_(1)

        def prepare_decode(self, seqs: list[int]) -> None:
            x = torch.zeros(3)
            x.fill_(1)
            x.zero_()
            x.to(torch.float64)  # a dtype change: no upload
            torch.tensor([1, 2])  # a host tensor: no upload
            self.h2d_state.publish("decode_step")
            with contextlib.suppress(AssertionError, RuntimeError):  # no CUDA: counted
                x.to("cuda", non_blocking=True)

        def prepare_sample(self, seqs: list[int]) -> None:
            torch.zeros(1).copy_(torch.ones(1))

        def run_model(self, *a: object) -> None:
            torch.zeros(4)[:2].fill_(-1)

    before = {n: torch.Tensor.__dict__.get(n) for n in ("cuda", "to", "copy_", "fill_",
                                                         "zero_")}
    factory = torch.tensor
    runner = Runner()
    probe = Probe(runner, "cpu")
    runner.prepare_decode([1])  # timing only
    assert not probe.counts and len(probe.ns["prepare_decode"]) == 1
    probe.counting = True
    runner.prepare_prefill([1, 2])  # a prefill: not counted
    runner.prepare_decode([1])
    runner.prepare_sample([1])
    runner.run_model()
    probe.counting = False
    assert dict(probe.counts) == {"fill_": 2, "zero_": 1, "to": 1, "copy_": 1,
                                  "in_publish:copy_": 1}
    assert probe.prefill_sizes == [2]
    assert {n: torch.Tensor.__dict__.get(n) for n in before} == before
    assert torch.tensor is factory and "publish" not in vars(runner.h2d_state)
