"""Two-stage pipeline parallelism over NCCL: one rank (and GPU) per stage.

Each rank holds the whole model's weights but runs only its stage's layers (stage 0: the
embeddings and the first half; stage 1: the rest, the final norm and the logits), with its
own :class:`H2DRunnerState`, runner slots and block-table state. ``M`` microbatches are in
flight: step ``t`` serves microbatch ``t % M`` on runner slot ``t % M`` (the slots rotate,
so a slot's sources are rewritten only after its previous step's DMA read them). Per step::

    both ranks    begin(); DecodeStepInputs.prepare(batch); publish; finish()
                  (the same batch, prepared independently on each rank)
    stage 0       token assembly (deferred ids from the sampled ids stage 1 sent for this
                  microbatch's previous step), KV indices, its layers -> send hidden
    stage 1       KV indices, receive hidden, its layers, logits, greedy sample -> send ids

The host side (contexts, page appends) is deterministic and identical on both ranks; no
metadata crosses the ranks, only hidden states and sampled ids (device tensors).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from block_tables import BlockTable
from h2d_core import H2DRunnerState, restore_implicit_cpu_default
from h2d_runner_adapters import (
    DECODE_STEP,
    BatchColumns,
    DecodeStepInputs,
    ScheduledBatch,
    StepShape,
)

from .model import DecoderInputs, TinyDecoder, TinyDecoderConfig, greedy


@dataclass(frozen=True)
class PipelineConfig:
    microbatches: int = 2
    reqs_per_microbatch: int = 4
    steps: int = 200
    page_size: int = 16
    num_pages: int = 256
    max_pages_per_req: int = 16
    vocab: int = 512
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    head_dim: int = 16
    seed: int = 0


class Microbatch:
    """One microbatch's requests: contexts and page rows, advanced one token a step."""

    def __init__(self, cfg: PipelineConfig, index: int) -> None:
        n = cfg.reqs_per_microbatch
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed * 100 + index)
        self.prompts = rng.integers(0, cfg.vocab, n).astype(np.int32)
        self.ctx = np.zeros(n, np.int32)
        self.tables = [BlockTable() for _ in range(n)]
        self.first_page = index * n * cfg.max_pages_per_req
        self.started = False

    def next_batch(self) -> ScheduledBatch:
        cfg, n = self.cfg, self.prompts.size
        self.ctx += 1
        for i in range(n):
            if -(-int(self.ctx[i]) // cfg.page_size) > len(self.tables[i]):
                row = self.tables[i].lineage_copy()
                row.append_one(self.first_page + i * cfg.max_pages_per_req + len(row))
                self.tables[i] = row
        deferred = np.arange(n, dtype=np.int32) if self.started else np.full(n, -1, np.int32)
        cols = BatchColumns(
            query_lens=np.ones(n, np.int32), context_lens=self.ctx.copy(),
            temperatures=np.zeros(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=deferred,
            token_ids=self.prompts.copy(), num_drafts=np.zeros(n, np.int32))
        self.started = True
        return ScheduledBatch((), False, cfg.page_size, given_columns=cols,
                              given_block_tables=list(self.tables))


def run_stage(rank: int, cfg: PipelineConfig, backend: str) -> tuple[list[torch.Tensor], dict]:
    """Run ``cfg.steps`` steps as stage ``rank``; stage 1 returns its logits per step (on
    the CPU), both return their counters and the slots ``begin()`` chose."""
    dev = torch.device("cuda", rank)
    n, m_count = cfg.reqs_per_microbatch, cfg.microbatches
    state = H2DRunnerState(dev, backend=backend, num_slots=m_count)
    step = DecodeStepInputs(state,
                            StepShape(max_reqs=n, max_tokens=n,
                                      max_pages_per_req=cfg.max_pages_per_req,
                                      page_size=cfg.page_size, num_pages=cfg.num_pages))
    state.bind()
    model = TinyDecoder(TinyDecoderConfig(vocab=cfg.vocab, hidden=cfg.hidden, layers=cfg.layers,
                                          heads=cfg.heads, head_dim=cfg.head_dim,
                                          page_size=cfg.page_size, num_pages=cfg.num_pages),
                        dev, seed=cfg.seed, max_pages=cfg.max_pages_per_req)
    half = cfg.layers // 2
    layers = range(0, half) if rank == 0 else range(half, cfg.layers)
    micro = [Microbatch(cfg, k) for k in range(m_count)]
    # per microbatch: the sampled ids stage 1 sends back (token assembly's deferred source)
    sampled = [torch.zeros(n, 1, dtype=torch.int32, device=dev) for _ in range(m_count)]
    hidden = torch.zeros(n, cfg.hidden, dtype=torch.float32, device=dev)
    rows = torch.arange(n, dtype=torch.int32, device=dev)
    restore_implicit_cpu_default()
    logits_out: list[torch.Tensor] = []
    slots = []
    pending_recv: list[dist.Work | None] = [None] * m_count
    for t in range(cfg.steps):
        m = t % m_count
        batch = micro[m].next_batch()
        slots.append(state.begin())
        plan = step.prepare(batch)
        state.publish(DECODE_STEP)
        state.finish()
        dec = step.decode
        kv = dec.generate_kv_indices(plan.decode)
        if rank == 0:
            work = pending_recv[m]
            if work is not None:
                work.wait()  # this microbatch's previous ids (a stream wait, no host sync)
            ids = step.tokens.assemble(plan.tokens, sampled[m])
        else:
            ids = step.tokens.input_ids.gpu[:n]  # unused by stage 1's layers
        inputs = DecoderInputs(input_ids=ids, positions=dec.positions.gpu[:n],
                               slot_mapping=dec.slot_mapping.gpu[:n], token_request=rows,
                               kv_indptr=dec.kv_indptr.gpu[: n + 1], kv_indices=kv,
                               context_lens=dec.context_lens.gpu[:n])
        if rank == 0:
            h = model.run_layers(inputs, layers)
            dist.send(h.float().contiguous(), dst=1)
            pending_recv[m] = dist.irecv(sampled[m], src=1)
        else:
            dist.recv(hidden, src=0)
            h = model.run_layers(inputs, layers, hidden.to(model.config.dtype))
            logits = model.compute_logits(model.final_hidden(h))
            ids_out = greedy(logits).view(n, 1).contiguous()
            dist.send(ids_out, dst=0)
            logits_out.append(logits.cpu())
    for work in pending_recv:
        if work is not None:
            work.wait()
    torch.cuda.synchronize(dev)
    c = state.counters(DECODE_STEP)
    return logits_out, {"publications": c.publications, "dmas": c.dmas,
                        "scatters": c.scatters, "direct_copies": c.direct_copies,
                        "slots": slots}


def worker(rank: int, cfg: PipelineConfig, rendezvous: str, out_dir: str) -> None:
    """One rank of the two-GPU run: packed, then direct, in the same process; stage 1
    compares the logits bit for bit and writes the outcome to ``out_dir``."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=rendezvous, rank=rank, world_size=2)
    try:
        runs = {b: run_stage(rank, cfg, b) for b in ("packed", "direct")}
        report = {b: counters for b, (_, counters) in runs.items()}
        lines = [f"rank {rank} ({torch.cuda.get_device_name(rank)}), {cfg.steps} steps, "
                 f"{cfg.microbatches} microbatches of {cfg.reqs_per_microbatch} requests"]
        for b, counters in report.items():
            slots = counters.pop("slots")
            expected = [t % cfg.microbatches for t in range(cfg.steps)]
            lines.append(f"  {b}: {counters}; slots rotate per microbatch: "
                         f"{slots == expected}")
        if rank == 1:
            packed, direct = runs["packed"][0], runs["direct"][0]
            same = len(packed) == len(direct) == cfg.steps and all(
                torch.equal(a, b) for a, b in zip(packed, direct, strict=True))
            lines.append(f"  packed == direct logits, bit for bit, over {len(packed)} steps: "
                         f"{same}")
        Path(out_dir, f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def main() -> None:
    """``python -m decode_runner.pipeline OUT_DIR``: spawn the two ranks (two GPUs)."""
    import sys
    import tempfile

    import torch.multiprocessing as mp

    out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    os.makedirs(out_dir, exist_ok=True)
    rendezvous = f"file://{Path(out_dir).resolve()}/rendezvous"
    mp.spawn(worker, args=(PipelineConfig(), rendezvous, out_dir), nprocs=2, join=True)
    for rank in range(2):
        print(Path(out_dir, f"rank{rank}.txt").read_text(), end="")


if __name__ == "__main__":
    main()
