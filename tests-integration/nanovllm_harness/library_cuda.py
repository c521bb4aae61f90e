"""nano-vllm on CUDA with its CUDA graphs, stock or with the library as its metadata path:
``python -m nanovllm_harness.library_cuda MODEL_DIR stock|library|graphs`` prints one JSON
line (the last of its output): :func:`stock_cpu.run_workload`'s result for the workload with
its preemption phase (near-greedy), plus ``prefill_steps`` / ``decode_steps`` (the engine's
``run`` calls), ``eager_forwards`` (the model's eager forwards: a captured graph is
replayed for every decode step, so only prefill steps run it eagerly), the captured
``graph_sizes``, ``pre_replay`` and, for ``library`` / ``graphs``, the checking runner's
``steps`` (:mod:`library_cpu`). ``graphs`` is the graph-native runner
(:mod:`library_graphs`, capturing at ``library_cpu.TEST_GRAPH_SIZES`` so that every decode
batch pads).

``pre_replay``: for decode steps :data:`PROFILED_DECODE_STEPS`, run unchecked (the checking
runner's stock calls and comparisons off), the device activity that ``torch.profiler``
records from the step's start (``run``) to its graph's replay, with a device
synchronization at both ends: per step, the activity by kind (``memcpy HtoD``,
``memcpy DtoD``, ``memset``, ``kernel``) and by name. Stock's shows its uploads and the
copies into its graphs' buffers; the graph-native runner's only the library's DMA and
scatter.

None of the CPU patches (:func:`compat.patch_for_cpu`) is applied: the process is the fork
on a GPU as it ships (NCCL, pinned memory, ``torch.compile``, CUDA graphs,
``enforce_eager=False``), with only the flash-attn stand-in (no flash-attn wheel here) and
the rope wrapper (transformers 5). The KV cache takes :data:`GPU_MEMORY_UTILIZATION` of the
device's memory. Run one process at a time: the fork's NCCL store binds the first free
port from 2333.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

GPU_MEMORY_UTILIZATION = 0.1
#: the decode steps (1-based) whose activity before the replay is profiled
PROFILED_DECODE_STEPS = (8, 9)
RUNNERS = ("stock", "library", "graphs")


class PreReplay:
    """The device activity from a step's start to its graph's replay, per profiled step:
    ``copies`` by kind (``h2d_kernels.copy_kinds.classify_trace``, the GPU tests' and the
    main job's classifier), ``memsets`` and the ``kernels`` by name, read from the
    profiler's chrome trace (user annotations are neither)."""

    def __init__(self) -> None:
        self.profile: Any = None
        self.steps: list[dict[str, Any]] = []

    def start(self) -> None:
        import torch

        torch.cuda.synchronize()
        self.profile = torch.profiler.profile(activities=[
            torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        self.profile.__enter__()

    def stop(self, replayed: bool) -> None:
        import torch

        from h2d_kernels.copy_kinds import classify_trace

        profile, self.profile = self.profile, None
        if profile is None:
            return
        torch.cuda.synchronize()
        profile.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            profile.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        copies, _ = classify_trace(events)
        done = [e for e in events if e.get("ph") == "X"]
        self.steps.append({
            "replayed": replayed, "copies": dict(copies),
            "memsets": sum(e.get("cat") == "gpu_memset" for e in done),
            "kernels": [str(e.get("name")) for e in done if e.get("cat") == "kernel"]})


def main(model_dir: str, runner: str) -> dict[str, Any]:
    import torch

    from nanovllm_harness import compat, stock_cpu
    from nanovllm_harness.flash_attn_standin import import_nanovllm

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    torch.manual_seed(stock_cpu.SEED)
    nanovllm = import_nanovllm()
    import nanovllm.models.qwen3 as qwen3

    compat.patch_rope(qwen3)
    if runner != "stock":
        from nanovllm_harness.library_cpu import checking_runner_class
        from nanovllm_harness.library_runner import install

        # only Tensor.cuda counted: wrapping .to / .copy_ would put Python into the
        # torch.compile'd layers' traces
        install(checking_runner_class(counted=("cuda",), graphs=runner == "graphs"))
    counts = {"eager_forwards": 0, "prefill_steps": 0, "decode_steps": 0}
    pre_replay = PreReplay()
    replay = torch.cuda.CUDAGraph.replay

    def profiled_replay(graph: Any) -> Any:  # ends a profiled step's window
        pre_replay.stop(replayed=True)
        return replay(graph)

    torch.cuda.CUDAGraph.replay = profiled_replay  # type: ignore[method-assign]

    def count_eager_forwards(llm: Any) -> None:
        runner = llm.model_runner
        model, run_step = runner.model, runner.run
        forward = model.forward  # the graphs, captured already, do not call it again

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts["eager_forwards"] += 1
            return forward(*args, **kwargs)

        def step(seqs: Any, is_prefill: bool) -> Any:  # what LLMEngine.step calls
            counts["prefill_steps" if is_prefill else "decode_steps"] += 1
            if is_prefill or counts["decode_steps"] not in PROFILED_DECODE_STEPS:
                return run_step(seqs, is_prefill)
            runner.checking = False  # the library runners' switch (stock never reads it)
            pre_replay.start()
            try:
                return run_step(seqs, is_prefill)
            finally:
                pre_replay.stop(replayed=False)  # (a no-op after a replay)
                runner.checking = True

        model.forward = counted
        runner.run = step

    run = stock_cpu.run_workload(nanovllm, model_dir, preempt_phase=True,
                                 on_engine=count_eager_forwards, enforce_eager=False,
                                 gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    llm = run.pop("llm")
    run.update(counts)
    run["graph_sizes"] = sorted(getattr(llm.model_runner, "graphs", {}))
    run["pre_replay"] = pre_replay.steps
    if runner != "stock":
        run["steps"] = llm.model_runner.steps
    return run


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
