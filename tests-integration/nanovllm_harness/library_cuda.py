"""nano-vllm on CUDA with its CUDA graphs, stock or with the library as its metadata path:
``python -m nanovllm_harness.library_cuda MODEL_DIR stock|library`` prints one JSON line
(the last of its output): :func:`stock_cpu.run_workload`'s result for the workload with its
preemption phase (near-greedy), plus ``prefill_steps`` / ``decode_steps`` (the engine's
``run`` calls), ``eager_forwards`` (the model's eager forwards: nano-vllm replays a
captured graph for every decode step, so only prefill steps run it eagerly), the captured
``graph_sizes`` and, for ``library``, the checking runner's ``steps`` (:mod:`library_cpu`).

None of the CPU patches (:func:`compat.patch_for_cpu`) is applied: the process is the fork
on a GPU as it ships (NCCL, pinned memory, ``torch.compile``, CUDA graphs,
``enforce_eager=False``), with only the flash-attn stand-in (no flash-attn wheel here) and
the rope wrapper (transformers 5). The KV cache takes :data:`GPU_MEMORY_UTILIZATION` of the
device's memory. Run one process at a time: the fork's NCCL store binds the first free
port from 2333.
"""

from __future__ import annotations

import json
import sys
from typing import Any

GPU_MEMORY_UTILIZATION = 0.1


def main(model_dir: str, runner: str) -> dict[str, Any]:
    import torch

    from nanovllm_harness import compat, stock_cpu
    from nanovllm_harness.flash_attn_standin import import_nanovllm

    if runner not in ("stock", "library"):
        raise ValueError(f"runner must be 'stock' or 'library', got {runner!r}")
    torch.manual_seed(stock_cpu.SEED)
    nanovllm = import_nanovllm()
    import nanovllm.models.qwen3 as qwen3

    compat.patch_rope(qwen3)
    if runner == "library":
        from nanovllm_harness.library_cpu import checking_runner_class
        from nanovllm_harness.library_runner import install

        # only Tensor.cuda counted: wrapping .to / .copy_ would put Python into the
        # torch.compile'd layers' traces
        install(checking_runner_class(counted=("cuda",)))
    counts = {"eager_forwards": 0, "prefill_steps": 0, "decode_steps": 0}

    def count_eager_forwards(llm: Any) -> None:
        runner = llm.model_runner
        model, run_step = runner.model, runner.run
        forward = model.forward  # the graphs, captured already, do not call it again

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts["eager_forwards"] += 1
            return forward(*args, **kwargs)

        def step(seqs: Any, is_prefill: bool) -> Any:  # what LLMEngine.step calls
            counts["prefill_steps" if is_prefill else "decode_steps"] += 1
            return run_step(seqs, is_prefill)

        model.forward = counted
        runner.run = step

    run = stock_cpu.run_workload(nanovllm, model_dir, preempt_phase=True,
                                 on_engine=count_eager_forwards, enforce_eager=False,
                                 gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    llm = run.pop("llm")
    run.update(counts)
    run["graph_sizes"] = sorted(getattr(llm.model_runner, "graphs", {}))
    if runner == "library":
        run["steps"] = llm.model_runner.steps
    return run


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
