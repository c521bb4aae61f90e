"""A DeepSeek-V4.1-shaped decode runner: two groups, first consumers, a compressed stand-in.

What it is for now that the real model has an oracle (``deepseek_v4.py``, checked against
transformers' ``generate()`` in ``test_deepseek_v4_oracle.py``): the fast CPU fuzzing of
V4.1 metadata. Its stand-in costs next to nothing per step, so randomized populations
(ragged and rectangular query widths, forks, arrivals, finishes) run many steps in the
Triton interpreter, and its logits depend on every published byte, so backends and runs
are compared step by step; the real model's oracle is slower and checks correctness
against the model itself.

Per step::

    state.begin()
    TokenStepInputs.prepare(batch)              # token_inputs: one producer call
    V41MetadataInputs.begin_step(spans, block_tables=rows)   # v41_metadata
    state.publish("token_inputs"); state.publish("v41_metadata"); state.finish()
    token assembly; step indptr generation      # the two groups' first consumers
    compressed-attention stand-in (a CUDA graph per (padded size, width) on the GPU)

The stand-in reads every published member through the first consumers' outputs: token ids,
positions, token batch IDs, committed lengths, both state slots, the four plans (state-write
rows write a per-slot state pool, compression rows write a block-addressed compressed pool),
the per-token indptrs and committed counts, per-token block tables, the HCA index head and
``qo_indptr``. Padded rows are routed to dump rows. Its logits depend on all of them, so a
wrong or stale byte anywhere shows up as a logit difference between backends or runs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    TOKEN_INPUTS,
    V4_BLOCK,
    V41_METADATA,
    BatchColumns,
    RequestSpan,
    ScheduledBatch,
    SpanColumns,
    TokenStepInputs,
    V41MetadataInputs,
    V41Plan,
)


@dataclass(frozen=True)
class V41Config:
    max_reqs: int = 8
    max_tokens: int = 32
    max_blocks: int = 6
    num_blocks: int = 64
    num_state_slots: int = 16
    full_q: int = 4  # DSpark: 1 + 3 draft tokens
    vocab: int = 256
    hidden: int = 32
    window: int = 8
    index_topk: int = 4
    envelope_rows: int = 3
    graph_sizes: tuple[int, ...] = ()
    scatter: str = "auto"
    seed: int = 0


class V41Population:
    """Requests decoding 1..full_q tokens a step (ragged or rectangular), finishing and
    arriving, with append-lineage block tables of 256-token blocks and occasional forks."""

    def __init__(self, cfg: V41Config, seed: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.free_slots = list(range(cfg.num_state_slots))
        self.free_blocks = list(range(1, cfg.num_blocks))  # block 0: the runner's dummy
        self.reqs: list[dict] = []

    def _new(self) -> dict | None:
        ctx = self.rng.randint(1, 2 * V4_BLOCK)
        need = -(-(ctx + 64) // V4_BLOCK)
        if not self.free_slots or len(self.free_blocks) < need + 2:
            return None
        blocks = [self.free_blocks.pop() for _ in range(-(-ctx // V4_BLOCK))]
        return {"ctx": ctx, "table": BlockTable(blocks), "slot": self.free_slots.pop(),
                "left": self.rng.randint(5, 60)}

    def step(self) -> tuple[list[RequestSpan], list[BlockTable], np.ndarray]:
        cfg, rng = self.cfg, self.rng
        for r in [r for r in self.reqs if r["left"] <= 0]:  # finished: free its storage
            self.reqs.remove(r)
            self.free_slots.append(r["slot"])
            self.free_blocks.extend(r["table"])
        while len(self.reqs) < cfg.max_reqs and rng.random() < 0.6:
            new = self._new()
            if new is None:
                break
            self.reqs.append(new)
        ragged = rng.random() < 0.5
        q = rng.randint(1, cfg.full_q)
        spans, rows = [], []
        for r in self.reqs:
            width = rng.randint(1, q) if ragged else q
            r["ctx"] += width
            r["left"] -= 1
            while len(r["table"]) * V4_BLOCK < r["ctx"]:
                t = r["table"].lineage_copy()
                t.append_one(self.free_blocks.pop())
                r["table"] = t
            fork = rng.choice([s for s in range(cfg.num_state_slots)]) if rng.random() < 0.1 \
                else -1
            spans.append(RequestSpan(width, r["ctx"], r["slot"], fork))
            rows.append(r["table"])
        ids = np.array([rng.randrange(cfg.vocab) for _ in range(sum(s.num_tokens
                                                                    for s in spans))],
                       np.int32)
        return spans, rows, ids


class V41Runner:
    """Publication, first consumers and the stand-in for V4.1-shaped decode steps."""

    def __init__(self, cfg: V41Config, device: str | torch.device, backend: str) -> None:
        self.cfg = cfg
        dev = self.device = torch.device(device)
        st = self.state = H2DRunnerState(dev, backend=backend, num_slots=2,
                                         scatter=cfg.scatter)
        self.tok = TokenStepInputs(st, max_reqs=cfg.max_reqs, max_tokens=cfg.max_tokens)
        self.v4 = V41MetadataInputs(
            st, max_reqs=cfg.max_reqs, max_tokens=cfg.max_tokens,
            max_blocks_per_req=cfg.max_blocks, dummy_state_slot=cfg.num_state_slots,
            dummy_block=0, num_blocks=cfg.num_blocks, window=cfg.window,
            index_topk=cfg.index_topk, fp8=True, envelope_rows=cfg.envelope_rows,
            # packed: the first consumer runs inside the publication; direct: launched
            fuse_step_indptrs=True)
        st.bind()
        g = torch.Generator().manual_seed(cfg.seed)
        h = cfg.hidden
        self.emb = torch.randn(cfg.vocab, h, generator=g).to(dev)
        self.w_out = (torch.randn(h, cfg.vocab, generator=g) / h**0.5).to(dev)
        # + 1 dump row each: padded plan rows and padded requests land there
        self.state_pool = torch.zeros(cfg.num_state_slots + 2, h, device=dev)
        self.kv_pool = torch.zeros(cfg.num_blocks * cfg.envelope_rows + 1, h, device=dev)
        self.prev = torch.zeros(cfg.max_reqs, cfg.full_q, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(cfg.max_tokens, cfg.vocab, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        #: host ns of the last step's metadata work (begin..finish, less the source wait)
        self.host_metadata_ns = 0
        #: when set (CUDA): events around the first publication work .. the first consumers
        #: (with ``span_through_model``, .. the model's first kernel, run eagerly)
        self.span_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self.span_through_model = False
        #: the main job's ATOM-style baseline: when set, a step calls it (spans, page lists)
        #: instead of the library's publication and first consumers, and the stand-in runs
        #: over the destinations as last published (its values are not consumed)
        self.metadata_hook: Callable[[SpanColumns, list[list[int]]], int | None] | None = None
        self._last_plan: V41Plan | None = None

    # -- one step ------------------------------------------------------------------------
    def step(self, spans: list[RequestSpan] | SpanColumns, rows: list[BlockTable],
             ids: np.ndarray, padded: int | None, *,
             lists: list[list[int]] | None = None) -> torch.Tensor:
        """One step; ``lists`` (the rows as Python page lists) only for ``metadata_hook``."""
        sc = spans if isinstance(spans, SpanColumns) else SpanColumns.from_spans(spans)
        n = len(sc.query_lens)
        q = sc.query_lens
        cols = BatchColumns(
            query_lens=q, context_lens=sc.context_lens,
            temperatures=np.zeros(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=ids, num_drafts=np.maximum(q - 1, 0).astype(np.int32))
        st = self.state
        events = self.span_events
        hook = self.metadata_hook
        if hook is not None and self._last_plan is not None:
            page_lists = lists if lists is not None else [list(r) for r in rows]
            if events is not None:
                events[0].record()
            t0 = time.perf_counter_ns()
            waited = hook(sc, page_lists)  # ns it waited for a free source set: left out
            self.host_metadata_ns = time.perf_counter_ns() - t0 - (waited or 0)
            vp = self._last_plan
        else:
            t0 = time.perf_counter_ns()
            st.begin()
            tp = self.tok.prepare(ScheduledBatch((), False, V4_BLOCK, given_columns=cols),
                                  padded)
            vp = self.v4.begin_step(sc, block_tables=rows, padded=padded)
            if events is not None:
                events[0].record()
            st.publish(TOKEN_INPUTS)
            st.publish(V41_METADATA)
            st.finish()
            self.tok.tokens.assemble(tp.tokens, self.prev)
            self.v4.generate_step_indptrs(vp)
            # timed to the first consumers enqueued: the ATOM-style hook builds those arrays
            # on its host inside its timed region
            self.host_metadata_ns = time.perf_counter_ns() - t0 - st.last_source_wait_ns
            self._last_plan = vp
        if events is not None:
            if self.span_through_model:  # the stand-in's first kernel, eagerly
                ids_t = self.tok.tokens.input_ids.gpu[: vp.padded_tokens]
                self.emb.index_select(0, ids_t.long())
            events[1].record()
        key = (vp.padded_reqs, vp.max_query_len)
        if self.device.type == "cuda" and padded is not None:
            graph = self.graphs.get(key)
            if graph is None:
                pools = (self.state_pool.clone(), self.kv_pool.clone())
                self._forward(vp)  # warm up outside the capture, then undo its writes
                self.state_pool.copy_(pools[0])
                self.kv_pool.copy_(pools[1])
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._forward(vp)
                self.graphs[key] = graph
            graph.replay()
        else:
            self._forward(vp)
        return self.logits[: vp.num_tokens]

    def _forward(self, vp: V41Plan) -> None:
        """The compressed-attention stand-in over the fixed destinations (graph-safe)."""
        cfg, v4 = self.cfg, self.v4
        t = vp.padded_tokens
        p = vp.padded_reqs
        ids = self.tok.tokens.input_ids.gpu[:t].long()
        pos = v4.positions.gpu[:t]
        bid = v4.token_batch_ids.gpu[:t].long()
        real = bid >= 0
        b = bid.clamp(min=0)
        dump_slot = cfg.num_state_slots + 1
        slot_in = torch.where(real, v4.state_slot_in.gpu[:p].long()[b], dump_slot)
        slot_out = v4.state_slot_out.gpu[:p].long()
        ind = v4.step_indptrs
        swa = (ind.swa_indptr[1 : t + 1] - ind.swa_indptr[:t]).float()
        csa = (ind.csa_indptr[1 : t + 1] - ind.csa_indptr[:t]).float()
        hca_ptr = ind.hca_indptr[:t].long()
        hca_len = ind.hca_indptr[1 : t + 1].long() - hca_ptr
        assert v4.hca_indices is not None and v4.block_tables_per_token is not None
        first_cell = v4.hca_indices[hca_ptr.clamp(max=v4.hca_indices.numel() - 1)].long()
        kv_row = torch.where(real & (hca_len > 0) & (first_cell >= 0), first_cell,
                             self.kv_pool.shape[0] - 1)
        table0 = v4.block_tables_per_token[:t, 0].float()
        qo = (v4.qo_indptr.gpu[1 : t + 1] - v4.qo_indptr.gpu[:t]).float()  # type: ignore[union-attr]
        seq = v4.seq_lens.gpu[:p].float()[b]
        h = self.emb[ids]
        feat = (torch.remainder(pos, 97).float() * 0.01 + swa * 0.003 + csa * 0.002
                + ind.n_committed_per_token[:t].float() * 0.001 + table0 * 0.0005
                + seq * 1e-4 + qo * 0.01)
        h = h + feat[:, None] + 0.5 * self.state_pool[slot_in] + 0.25 * self.kv_pool[kv_row]
        h = torch.where(real[:, None], h, torch.zeros_like(h))
        for (r, _), cb, wb in zip(v4.ratios, v4.compress_plans, v4.write_plans, strict=True):
            w = wb.gpu[: p * min(vp.max_query_len, _window(v4, r))]
            live = w[:, 2] >= 0
            dst = torch.where(live, slot_out[w[:, 1].long().clamp(min=0)], dump_slot)
            # amax: exact and order-free, so duplicate destinations stay deterministic
            _amax_rows(self.state_pool, dst, h[w[:, 0].long().clamp(min=0)] * 0.1)
            c = cb.gpu[: p * -(-vp.max_query_len // r)]
            live = c[:, 2] >= 0
            blk = v4.block_tables.gpu[c[:, 1].long().clamp(min=0),
                                      (c[:, 2].long().clamp(min=0) // V4_BLOCK)]
            row = blk.long() * cfg.envelope_rows + (c[:, 2].long() // r) % cfg.envelope_rows
            dst = torch.where(live, row, self.kv_pool.shape[0] - 1)
            _amax_rows(self.kv_pool, dst, h[c[:, 0].long().clamp(min=0)] * 0.1)
        torch.matmul(h, self.w_out, out=self.logits[:t])


def _amax_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``pool[rows[i]] = max(pool[rows[i]], values[i])`` elementwise, duplicates included."""
    pool.scatter_reduce_(0, rows[:, None].expand(-1, pool.shape[1]), values, reduce="amax")


def _window(v4: V41MetadataInputs, ratio: int) -> int:
    return dict(v4.ratios)[ratio]
