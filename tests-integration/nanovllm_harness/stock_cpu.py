"""Stock nano-vllm on CPU: ``python -m nanovllm_harness.stock_cpu MODEL_DIR [--sampled]
[--preempt]`` (with ``tests-integration`` on ``PYTHONPATH``) prints one JSON line, the
workload's prompts and the tokens nano-vllm generated for them, as its last line of output.
:func:`setup_cpu` and :func:`run_workload` are its two halves (``library_cpu.py`` runs the
same workload through the library runner; ``library_cuda.py`` on a GPU).

Run it in a process of its own: :func:`compat.patch_for_cpu` changes torch for the whole
process. nano-vllm is imported with the flash-attn stand-in and its rope call wrapped;
nothing of nano-vllm is edited. The engine is stock ``LLM`` with ``enforce_eager=True``
(no CUDA graphs on CPU) and a KV cache of :data:`KV_BLOCKS` 256-token blocks, more than the
workload ever holds, so the scheduler never preempts (the fork's preemption path fails).

The model's dtype is the directory's (``model_dir.write_model_dir``); in float32 the
fork's RMSNorm needs :func:`compat.patch_rmsnorm_fp32`, which leaves bf16 alone. One
torch thread (the test may run two of these beside its own work on two cores).

The workload (:func:`workload`) is near-greedy: temperature 1e-5 (the fork refuses 0); its
sampler divides the probabilities by exponential noise clamped at 1e-10
(``layers/sampler.py`` line 113), which can overturn a logit gap only below about
26 x temperature, while exact ties go to any of the tied tokens (transformers' argmax takes
the lowest id). ``ignore_eos``; ``repetition_penalty`` 1.0 (the fork's inverted flag,
``engine/model_runner.py`` lines 321-322, then uploads the penalties, line 329, and reads
each back with ``.item()`` in ``run``, line 476: a host sync per sequence per step on a
GPU, harmless here; ``top_p`` has the same inverted flag, lines 318-319, inert while
``top_p`` is None).

* ``generate()`` over four prompts at once: ``A`` and ``B`` share their first 280 tokens,
  so ``B``'s first 256-token block is a prefix-cache hit on ``A``'s, allocated in the same
  scheduling pass and written by the same prefill step before its attention reads it;
  ``D`` (250 tokens) crosses into a second block while decoding (a KV page appended);
  ``C`` is short.
* then, through the engine's ``add_request``/``step``: ``E`` is prefilled alone and one
  step later ``F``, sharing ``E``'s first 256 tokens, arrives: its hit is on a block an
  earlier step wrote; the two then decode together.

Options (the library test runs both ways): ``--sampled`` gives each request its
:data:`SAMPLED` temperature, top-k and top-p (seeded: the fork's sampler draws from torch's
global generator); ``--preempt`` preempts ``E`` before staggered step :data:`PREEMPT_STEP`
(:func:`preempt`: what the fork's own preemption means to do), so ``E`` is prefilled again
under the same ``seq_id``, a prefix-cache hit on the block ``F`` still holds.

The JSON also lists every prefill's (request, length, cached tokens) as the runner saw
them, and the KV cache's block count.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

#: KV cache blocks (256 tokens each): the workload holds at most 6 at once
KV_BLOCKS = 16
BLOCK = 256
TEMPERATURE = 1e-5
SEED = 1234


def workload(vocab_size: int, eos_id: int) -> dict[str, Any]:
    """The requests by name: ``prompt`` (token ids, never ``eos_id``) and ``max_tokens``;
    ``batch`` (one ``generate()``) and ``staggered`` (``E``, then ``F`` a step later)."""
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.choice([t for t in range(1, vocab_size) if t != eos_id]) for _ in range(n)]

    shared, shared2 = tokens(280), tokens(270)
    prompts = {
        "A": (shared + tokens(20), 16), "B": (shared + tokens(10), 16),
        "C": (tokens(37), 24), "D": (tokens(250), 16),
        "E": (shared2 + tokens(5), 12), "F": (shared2 + tokens(25), 12),
    }
    return {"requests": {k: {"prompt": p, "max_tokens": n} for k, (p, n) in prompts.items()},
            "batch": ["A", "B", "C", "D"], "staggered": ["E", "F"]}


def setup_cpu(model_dir: str) -> Any:
    """The process's CPU patches, nano-vllm imported (flash-attn stand-in) and its quirks
    wrapped (:mod:`compat`); one torch thread, the global seed set. Returns ``nanovllm``."""
    from transformers import AutoConfig

    from nanovllm_harness import compat

    hf_config = AutoConfig.from_pretrained(model_dir)  # as nano-vllm's Config reads it
    compat.patch_for_cpu(KV_BLOCKS, compat.kv_block_bytes(hf_config, BLOCK))
    import torch

    from nanovllm_harness.flash_attn_standin import import_nanovllm

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    nanovllm = import_nanovllm()
    import nanovllm.layers.layernorm as layernorm
    import nanovllm.models.qwen3 as qwen3

    compat.patch_rope(qwen3)
    compat.patch_rmsnorm_fp32(layernorm)
    return nanovllm


#: the seeded-sampling variant (``sampled=True``): per request (temperature, top_k, top_p),
#: per-request filters in the batch, a uniform top-p of 1.0 when E decodes alone
SAMPLED: dict[str, tuple[float, int | None, float | None]] = {
    "A": (0.7, 20, 1.0), "B": (1.0, None, 0.8), "C": (1.3, 5, None), "D": (0.9, None, None),
    "E": (1.0, None, 1.0), "F": (0.6, 40, 0.9)}
#: the preemption phase (``preempt=True``): before this staggered step, E is preempted
#: (its pages freed, back to waiting) while F holds their shared first block, so its
#: re-prefill under the same seq_id is a prefix-cache hit on a new page list
PREEMPT_STEP, PREEMPTED = 3, "E"


def preempt(llm: Any, seq_id: int) -> None:
    """Preempt the running sequence ``seq_id`` as the scheduler's ``preempt`` means to
    (pages freed, back to the head of the waiting queue) and out of ``running``, which
    the fork's ``preempt`` leaves it in (``engine/scheduler.py``, ``preempt``)."""
    scheduler = llm.scheduler
    seq = next(s for s in scheduler.running if s.seq_id == seq_id)
    scheduler.preempt(seq)
    scheduler.running.remove(seq)


def run_workload(nanovllm: Any, model_dir: str, *, sampled: bool = False,
                 preempt_phase: bool = False, on_engine: Any = None,
                 **engine: Any) -> dict[str, Any]:
    """The workload through ``nanovllm.LLM`` (whatever ``ModelRunner`` the engine module
    names now), as the module docstring says; ``sampled``: :data:`SAMPLED`'s parameters
    instead of near-greedy; ``preempt_phase``: :data:`PREEMPT_STEP`'s preemption;
    ``on_engine(llm)``: called once the engine is built; ``engine``: further ``LLM``
    keywords. The result holds the engine under ``"llm"``."""
    import nanovllm.engine.llm_engine as llm_engine

    from nanovllm_harness.model_dir import CONFIG

    runner_class = llm_engine.ModelRunner
    prefills: list[dict[str, int]] = []
    prepare_prefill = runner_class.prepare_prefill

    def spy(self: Any, seqs: list[Any]) -> Any:  # records what the runner is given
        prefills.extend({"seq_id": s.seq_id, "len": len(s), "cached": s.num_cached_tokens}
                        for s in seqs if s.block_table)  # (warmup's have no blocks)
        return prepare_prefill(self, seqs)

    runner_class.prepare_prefill = spy

    work = workload(CONFIG["vocab_size"], CONFIG["eos_token_id"])
    reqs = work["requests"]
    options = dict(enforce_eager=True, max_model_len=1024, max_num_batched_tokens=2048,
                   max_num_seqs=8, kvcache_block_size=BLOCK)
    llm = nanovllm.LLM(model_dir, **{**options, **engine})
    if on_engine is not None:
        on_engine(llm)

    def params(name: str) -> Any:
        if sampled:
            temperature, top_k, top_p = SAMPLED[name]
            return nanovllm.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                           ignore_eos=True, max_tokens=reqs[name]["max_tokens"])
        return nanovllm.SamplingParams(temperature=TEMPERATURE, ignore_eos=True,
                                       max_tokens=reqs[name]["max_tokens"])

    seq_ids: dict[str, int] = {}
    outs = llm.generate([reqs[n]["prompt"] for n in work["batch"]],
                        [params(n) for n in work["batch"]], use_tqdm=False)
    for name, out, prefill in zip(work["batch"], outs, prefills, strict=True):
        reqs[name]["tokens"] = out["token_ids"]
        seq_ids[name] = prefill["seq_id"]  # generate() schedules them in order, one pass
    # staggered arrivals through the engine's own step loop: E before step 0, F before step 1
    first, *rest = work["staggered"]
    arrivals: dict[int, list[str]] = {0: [first], 1: rest}
    done: dict[int, list[int]] = {}
    step = 0
    while arrivals.get(step) or not llm.is_finished():
        for name in arrivals.get(step, []):
            llm.add_request(reqs[name]["prompt"], params(name))
            seq_ids[name] = llm.scheduler.waiting[-1].seq_id
        if preempt_phase and step == PREEMPT_STEP:
            preempt(llm, seq_ids[PREEMPTED])
        finished, _ = llm.step()
        done.update(dict(finished))
        step += 1
    for name in work["staggered"]:
        reqs[name]["tokens"] = done[seq_ids[name]]
    by_id = {seq_id: name for name, seq_id in seq_ids.items()}
    return {"requests": reqs, "batch": work["batch"], "staggered": work["staggered"],
            "dtype": str(llm.model_runner.dtype).removeprefix("torch."),
            "prefills": [{"name": by_id[p["seq_id"]], **p} for p in prefills],
            "kv_blocks": len(llm.scheduler.block_manager.blocks), "llm": llm}


def main(model_dir: str, *, sampled: bool = False, preempt_phase: bool = False
         ) -> dict[str, Any]:
    nanovllm = setup_cpu(model_dir)
    run = run_workload(nanovllm, model_dir, sampled=sampled, preempt_phase=preempt_phase)
    del run["llm"]
    return run


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], sampled="--sampled" in args,
                          preempt_phase="--preempt" in args)), flush=True)
