"""A small paged-attention runner that publishes its metadata the way an engine would.

Per step::

    state.begin()                                 # slot rotation (PP) waits for source reuse
    producers (decode: one fused DecodeStepInputs call; prefill: one PrefillStepInputs
               call)
    state.publish(<step group>)                   # one DMA + one scatter (packed backend)
    state.finish()                                # records completion, never waits
    token assembly -> KV-index generation / attention preparation   (first consumers: by
               default fused into the publication, so a decode step is one graph launch
               of DMA, scatter and both; unfused, one captured graph of both on padded
               decode steps)
    CUDA-graph replay (decode, padded; the graph also samples when no top-k/top-p filter
               is on) or eager forward (prefill, TBO, no graph)
    sampler (greedy rows corrected on the GPU, no readback; noise drawn only when a row
               samples)

Publication is enqueued on the consumer stream before graph replay; every destination the
graphs read is bound once at init. Two-batch overlap (``tbo=True`` decode steps) splits the
batch into two ubatches with their own decode buffers and block-table states: the first is
published with the token inputs, the second is prepared late, resuming the same epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from h2d_core import H2DRunnerState, restore_implicit_cpu_default
from h2d_runner_adapters import (
    DecodePlan,
    DecodeStepInputs,
    MhaDecodeInputs,
    PrefillInputs,
    PrefillPlan,
    PrefillStepInputs,
    SamplingInputs,
    SamplingPlan,
    ScheduledBatch,
    StepShape,
    TokenInputs,
    TokenPlan,
    consumers_fusable,
    fill_gumbel_noise_,
)
from h2d_runner_adapters.consumers import GREEDY_TEMPERATURE

from .atom_style import AtomStyleDecode
from .model import DecoderInputs, TinyDecoder, TinyDecoderConfig

DECODE_STEP = "decode_step"
PREFILL_STEP = "prefill_step"
TBO_STEP = "tbo_step"
#: the parts of a decode step's metadata, in order (:attr:`DecodeRunner.host_parts_ns`)
HOST_PARTS = ("begin", "producers", "publish", "finish", "consumers")


@dataclass(frozen=True)
class RunnerConfig:
    """Capacities and model shape of the runner."""

    max_reqs: int = 8
    max_tokens: int = 128
    max_pages_per_req: int = 16
    page_size: int = 16
    num_pages: int = 256
    vocab: int = 1000
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    graph_sizes: tuple[int, ...] = ()
    num_slots: int = 1
    seed: int = 0
    #: cycles of ``torch.cuda._sleep`` before each step's publication (delayed-reuse test)
    gpu_delay_cycles: int = 0
    #: packed scatter: "auto" (Triton on CUDA, the CPU reference on CPU) or "triton"
    #: (on CPU under TRITON_INTERPRET=1, so CI runs the kernel itself)
    scatter: str = "auto"
    #: token assembly and KV-index generation inside the decode and prefill publications
    #: (one launch per step; the direct backend launches them after it). None: wherever
    #: their kernels can run at publication (:func:`consumers_fusable`: CUDA, or CPU under
    #: TRITON_INTERPRET=1); False: launched after the publication (one captured graph of
    #: both on padded decode steps)
    fuse_consumers: bool | None = None


@dataclass
class StepResult:
    sampled: torch.Tensor  # int32 [n] on the device
    logits: torch.Tensor  # float32 [n, vocab] on the device
    decoder_inputs: DecoderInputs | None


class DecodeRunner:
    """Runs scheduled batches through publication, first consumers and the model."""

    def __init__(self, cfg: RunnerConfig, device: str | torch.device,
                 backend: str | None = None, *, tbo: bool = False,
                 model: Any = None) -> None:
        """``backend``: "packed", "direct" (the library's two backends) or "atom" (decode
        steps published the ATOM-style way, :mod:`.atom_style`, into the same
        destinations; prefill and TBO steps still go through the library, direct).
        ``model``: the decoder to run (``TinyDecoder``'s interface, e.g.
        :class:`~decode_runner.llama.LlamaPagedDecoder`); None builds the stand-in."""
        self.cfg = cfg
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        atom = backend == "atom"
        st = H2DRunnerState(self.device, num_slots=cfg.num_slots,
                            backend="direct" if atom else backend, scatter=cfg.scatter)
        self.state = st
        dev = self.device
        # previous step's sampled ids, one row per batch row: token assembly reads it (a
        # fused assembly reads this very tensor, so it exists before the declaration)
        self.sampled = torch.zeros(cfg.max_reqs, 1, dtype=torch.int32, device=dev)
        fuse = cfg.fuse_consumers
        #: whether the step's first consumers run inside its publication (see RunnerConfig)
        self.fuse_consumers = consumers_fusable(dev) if fuse is None else fuse
        self._declare(st, tbo)
        st.bind()
        #: fixed at bind: a decode step's publication runs both first consumers, so the
        #: step calls neither (their fused forms launch nothing; assemble builds a view)
        self._fused_both = self.consumers_in_publication

        self.model = model if model is not None else TinyDecoder(
            TinyDecoderConfig(vocab=cfg.vocab, hidden=cfg.hidden, layers=cfg.layers,
                              heads=cfg.heads, head_dim=cfg.head_dim, page_size=cfg.page_size,
                              num_pages=cfg.num_pages, dtype=cfg.dtype),
            self.device, seed=cfg.seed, max_pages=cfg.max_pages_per_req,
        )
        self.noise = torch.zeros(cfg.max_reqs, cfg.vocab, dtype=torch.float32, device=dev)
        self.generator = torch.Generator(device=dev)
        self.token_rows = torch.arange(cfg.max_reqs, dtype=torch.int32, device=dev)
        #: host ns of the last step's metadata preparation + publication (begin..finish,
        #: decode and prefill steps; the wait for source reuse left out)
        self.host_metadata_ns = 0
        #: the last decode step's metadata by part, host ns (the library's ways only):
        #: begin, producers, publish, finish, first consumers; the source wait left out
        self.host_parts_ns = [0] * len(HOST_PARTS)
        #: when set (CUDA), events around publication..first consumers of decode steps
        self.span_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        #: when set (CUDA, with ``span_events``), the step runs the model's first kernel
        #: (the embedding gather of the step's ids) eagerly before ``span_events[1]``
        self.span_through_model = False
        self.atom = AtomStyleDecode(self) if atom else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        #: per graph size, the first consumers (token assembly, KV-index generation)
        self.consumer_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_inputs: dict[int, DecoderInputs] = {}
        for p in cfg.graph_sizes:
            self.graph_inputs[p] = self._decode_inputs(self.decode, p, 0)
        if cuda and cfg.graph_sizes:
            self._capture()
        # GPU initialization is over: leave any default-device mode the engine set for it,
        # so no torch call of a step dispatches through a DeviceContext
        restore_implicit_cpu_default()

    #: producer groups (declared before ``_declare`` runs) that ride in both the decode and
    #: the prefill step, e.g. GDN state indices
    step_extra_groups: tuple[str, ...] = ()
    #: the groups a decode step publishes, in order
    publish_groups: tuple[str, ...] = (DECODE_STEP,)
    #: pad eager decode steps to the scheduler's graph size too (a CPU run then reads the
    #: padded rows the library publishes for a graph)
    pad_eager = False

    def _declare(self, st: H2DRunnerState, tbo: bool) -> None:
        """Declare the adapters and groups a step publishes (before ``bind()``): here the
        plain MHA step (sampling, token inputs, MHA decode as the fused ``decode_step``,
        plus ``step_extra_groups``), prefill as the fused ``prefill_step`` (the same token
        adapters, the same extra groups), TBO's ubatches. A runner for another model
        family overrides this, and nothing else of the setup."""
        cfg = self.cfg
        caps: dict[str, Any] = {"max_reqs": cfg.max_reqs, "max_tokens": cfg.max_tokens}
        self.sampling = SamplingInputs(st, cfg.max_reqs)
        self.tokens = TokenInputs(st, **caps)
        shape = self.step_shape
        self.decode = MhaDecodeInputs(st, shape, fuse_kv_indices=self.fuse_consumers)
        self.prefill = PrefillInputs(st, shape)
        token_groups = ["sampling", *self.tokens.producer_groups]
        if self.fuse_consumers:  # into every publication carrying decode_cu / kv_indptr
            self.tokens.fuse_assembly(self.sampled)
        # plain decode steps: one fused producer call (compiled when available), one group
        extra = self.step_extra_groups
        self.decode_step = DecodeStepInputs.from_adapters(
            self.sampling, self.tokens, self.decode, group=DECODE_STEP, extra_groups=extra)
        self.prefill_step = PrefillStepInputs.from_adapters(
            self.sampling, self.tokens, self.prefill, group=PREFILL_STEP, extra_groups=extra)
        self.ubatches: list[MhaDecodeInputs] = []
        if tbo:
            self.ubatches = [MhaDecodeInputs(st, shape, prefix=f"ub{i}_") for i in range(2)]
            st.combine(TBO_STEP, [*token_groups, self.ubatches[0].group])

    @property
    def step_shape(self) -> StepShape:
        """The capacities every paged adapter of the runner is declared with."""
        cfg = self.cfg
        return StepShape(max_reqs=cfg.max_reqs, max_tokens=cfg.max_tokens,
                         max_pages_per_req=cfg.max_pages_per_req, page_size=cfg.page_size,
                         num_pages=cfg.num_pages)

    # -- inputs over fixed destinations -----------------------------------------------------
    def _decode_inputs(self, d: MhaDecodeInputs, rows: int, first_token: int) -> DecoderInputs:
        return DecoderInputs(
            input_ids=self.tokens.input_ids.gpu[first_token:first_token + rows],
            positions=d.positions.gpu[:rows],
            slot_mapping=d.slot_mapping.gpu[:rows],
            token_request=self.token_rows[:rows],
            kv_indptr=d.kv_indptr.gpu[: rows + 1],
            kv_indices=d.kv_indices,
            context_lens=d.context_lens.gpu[:rows],
            # the step's query prefix bounds each token's keys (a later ubatch's rows are
            # offset in it: its keys stay bounded by positions)
            query_start=self.tokens.cu_seqlens_q.gpu[: rows + 1] if first_token == 0 else None,
        )

    @property
    def consumers_in_publication(self) -> bool:
        """Whether the decode publication runs both first consumers (token assembly and
        KV-index generation) itself: a step is then one launch, then the model's graph."""
        assembly = self.tokens.assembly_consumer
        kv = getattr(self.decode, "kv_indices_consumer", None)
        return assembly is not None and assembly.fused and kv is not None and kv.fused

    def _capture(self) -> None:
        d = self.decode
        # Capture over safe contents: no KV writes, no pages (the graph records; warm-up
        # runs eagerly once on these values).
        d.slot_mapping.gpu.fill_(-1)
        d.context_lens.gpu.zero_()
        d.kv_indptr.gpu.zero_()
        d.positions.gpu.zero_()
        # consumers fused into the publication: no graph of them; KV-index generation
        # fused: no capture table to publish for it (the first step publishes its rows
        # whole, the record naming nothing yet; a covered group alone is refused then)
        fused = self.consumers_in_publication
        kv = getattr(self.decode, "kv_indices_consumer", None)
        if kv is None or not kv.fused:
            self._prepare_capture_tables(max(self.graph_inputs))
        self.tokens.input_ids.gpu.zero_()
        self.tokens.decode_cu.gpu.zero_()
        self.tokens.decode_src.gpu.fill_(-1)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compile the kernels before any capture
            for p, inputs in self.graph_inputs.items():
                self._run_consumers(p)
                self._sample_rows(self.model(inputs), p)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = None
        for p in sorted(self.graph_inputs, reverse=True):
            if not fused:
                # The first consumers read only fixed destinations and host ints fixed by
                # the graph size, so a padded step replays them too: two Triton launches
                # (and their host work between publications) become one graph launch.
                cg = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cg, pool=pool):
                    self._run_consumers(p)
                pool = cg.pool()
                self.consumer_graphs[p] = cg
            # The model and the unfiltered sampler over the graph's rows: a padded decode
            # step with no top-k/top-p filter does no host work to sample (the Triton
            # launch and its checks would otherwise run between two publications).
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self.model(self.graph_inputs[p])
                self._sample_rows(out, p)
            pool = g.pool()
            self.graphs[p] = (g, out)
        torch.cuda.synchronize(self.device)
        self.sampled.zero_()  # the warm-up sampled garbage rows: no step has sampled yet

    def _prepare_capture_tables(self, rows: int) -> None:
        """Empty block-table rows for the largest captured size, published through the
        table's state: its record then says what the GPU holds, so the first step sends
        what differs instead of trusting a table written behind the state's back."""
        st = self.state
        st.begin()
        self.decode.tables.prepare_capture(rows)
        st.publish(self.decode.group)
        st.finish()

    def _sample_rows(self, logits: torch.Tensor, rows: int) -> None:
        """The sampler without filters over ``rows`` rows (greedy rows exact, the others
        from ``self.noise``), into ``self.sampled``."""
        self.sampling.sample(logits, SamplingPlan(rows, None, None, False, False),
                             self.noise[:rows], out=self.sampled.view(-1))

    def _run_consumers(self, rows: int) -> None:
        """Token assembly and KV-index generation of a one-token-per-request decode step
        padded to ``rows`` requests (what a graph of that size replays)."""
        self.tokens.assemble(TokenPlan(rows, rows, rows, rows, 0), self.sampled)
        self.decode.generate_kv_indices(DecodePlan(rows, rows, 1, rows, rows, 0, ""))

    # -- one step ---------------------------------------------------------------------------
    def step(self, batch: ScheduledBatch, *, tbo: bool = False) -> StepResult:
        moves = batch.extras.get("kv_page_moves", ())
        if moves:
            self.model.move_pages(moves)  # type: ignore[arg-type]
        if self.cfg.gpu_delay_cycles and self.device.type == "cuda":
            torch.cuda._sleep(self.cfg.gpu_delay_cycles)
        n = batch.num_reqs
        if not _all_greedy(batch):  # greedy rows never read the noise
            self.generator.manual_seed(self.cfg.seed * 1_000_003 + batch.step)
            fill_gumbel_noise_(self.noise[:n], self.generator)
        inputs: DecoderInputs | None
        sampled = False
        if batch.is_prefill:
            logits, inputs = self._prefill(batch)
        elif tbo:
            logits, inputs = self._decode_tbo(batch)
        else:
            logits, inputs, sampled = self._decode(batch)
        out = self.sampled.view(-1)
        if not sampled:
            self.sampling.sample(logits, self._sampling_plan, self.noise[:n], out=out)
        return StepResult(out[:n], logits[:n], inputs)

    def _decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, DecoderInputs, bool]:
        """Publish, run the first consumers and the model; True when the captured graph
        also sampled (an unfiltered plan), False when the caller must sample."""
        dplan = self.decode_metadata(batch)
        rows = dplan.padded_reqs
        events = self.span_events
        self._decoded(batch, dplan)
        if events is not None:
            if self.span_through_model:  # the model's first kernel, eagerly
                self.model.embed.index_select(0, self.tokens.input_ids.gpu[:rows].long())
            events[1].record()
        if rows in self.graphs:
            graph, out = self.graphs[rows]
            graph.replay()
            sp = self._sampling_plan
            unfiltered = (sp.top_k is None and sp.top_p is None and not sp.per_request_top_k
                          and not sp.per_request_top_p)
            return out, self.graph_inputs[rows], unfiltered
        inputs = self.graph_inputs.get(rows) or self._decode_inputs(self.decode, rows, 0)
        return self.model(inputs), inputs, False

    def decode_metadata(self, batch: ScheduledBatch) -> DecodePlan:
        """A decode step's metadata alone: publication and first consumers, no model (the
        step's first half; the main job also runs it by itself, as the isolated step).
        Sets :attr:`host_metadata_ns` and, on the library's ways, :attr:`host_parts_ns`."""
        st = self.state
        size = batch.padded_size
        # a captured size, or (pad_eager) the scheduler's graph size on an eager run
        padded = size if size in self.graph_inputs or (self.pad_eager and size) else None
        events = self.span_events
        parts = self.host_parts_ns
        if self.atom is not None:
            self.atom.sync_lists(batch)  # the scheduler's side: outside the timed region
            if events is not None:
                events[0].record()
            t0 = time.perf_counter_ns()
            self._sampling_plan, tplan, dplan = self.atom.publish(batch, padded)
            waited = self.atom.last_wait_ns
        else:
            t0 = time.perf_counter_ns()
            st.begin()
            waited = st.last_source_wait_ns
            t1 = time.perf_counter_ns()
            tplan, dplan = self._prepare_decode(batch, padded)
            if events is not None:
                events[0].record()
            t2 = time.perf_counter_ns()
            for group in self.publish_groups:
                st.publish(group)
            t3 = time.perf_counter_ns()
            st.finish()
            t4 = time.perf_counter_ns()
            parts[0], parts[1], parts[2], parts[3] = t1 - t0 - waited, t2 - t1, t3 - t2, t4 - t3
        t5 = time.perf_counter_ns()
        rows = dplan.padded_reqs
        consumers = self.consumer_graphs.get(rows)
        if self._fused_both:
            pass  # the publication ran both (the decoder reads the fixed destinations)
        elif consumers is not None and tplan.padded_tokens == rows:
            consumers.replay()
        else:
            self.tokens.assemble(tplan, self.sampled)
            self.decode.generate_kv_indices(dplan)
        # every way is timed to the same point, its first consumers enqueued; host work only:
        # the wait for source reuse (a GPU still busy with earlier steps) is reported apart
        t6 = time.perf_counter_ns()
        self.host_metadata_ns = t6 - t0 - waited
        parts[4] = t6 - t5
        return dplan

    def _prepare_decode(self, batch: ScheduledBatch, padded: int | None
                        ) -> tuple[TokenPlan, DecodePlan]:
        """The decode producers of the step (one fused call here; a family's runner has
        its own) and the sampling plan; returns the token and decode plans."""
        plan = self.decode_step.prepare(batch, padded)
        self._sampling_plan = plan.sampling
        return plan.tokens, plan.decode

    def _decoded(self, batch: ScheduledBatch, dplan: DecodePlan) -> None:
        """After a decode step's first consumers, before its model (a family's runner
        records what it checks there)."""

    def _prefill(self, batch: ScheduledBatch) -> tuple[torch.Tensor, DecoderInputs]:
        """One prefill chunk: its producers (:meth:`_prepare_prefill`) published as
        ``prefill_step``, token assembly and attention preparation, then the model over
        :meth:`_prefill_inputs`."""
        st = self.state
        t0 = time.perf_counter_ns()
        st.begin()
        tplan, pplan = self._prepare_prefill(batch)
        st.publish(PREFILL_STEP)
        st.finish()
        self.host_metadata_ns = time.perf_counter_ns() - t0 - st.last_source_wait_ns
        self.tokens.assemble(tplan, self.sampled)
        self._prepare_attention(pplan)
        inputs = self._prefill_inputs(batch, pplan)
        cu_q = self.tokens.cu_seqlens_q.gpu
        last = (cu_q[1 : pplan.num_reqs + 1] - 1).long()
        return self.model(inputs, logits_indices=last), inputs

    def _prepare_prefill(self, batch: ScheduledBatch) -> tuple[TokenPlan, PrefillPlan]:
        """The prefill producers of the step (one fused call here; a family's runner adds
        its own) and the sampling plan; returns the token and prefill plans."""
        plan = self.prefill_step.prepare(batch)
        self._sampling_plan = plan.sampling
        return plan.tokens, plan.prefill

    def _prepare_attention(self, pplan: PrefillPlan) -> None:
        """The prefill chunk's attention preparation (after its publication): KV-index
        generation from the step's published page prefix."""
        self.prefill.prepare_attention(pplan)

    def _prefill_inputs(self, batch: ScheduledBatch, pplan: PrefillPlan) -> DecoderInputs:
        """The model's inputs of a prefill chunk (a family's runner adds its members)."""
        return DecoderInputs(**self._prefill_fields(pplan))

    def _prefill_fields(self, pplan: PrefillPlan) -> dict[str, torch.Tensor]:
        """:class:`DecoderInputs`' fields over the published prefill destinations and the
        attention preparation's outputs."""
        pf, step = self.prefill, self.prefill_step
        t, n = pplan.num_tokens, pplan.num_reqs
        return {"input_ids": self.tokens.input_ids.gpu[:t], "positions": pf.positions.gpu[:t],
                "slot_mapping": pf.slot_mapping.gpu[:t],
                "token_request": step.token_request.gpu[:t],
                "kv_indptr": step.kv_indptr.gpu[: n + 1], "kv_indices": pf.kv_indices,
                "context_lens": pf.context_lens.gpu[:n],
                "query_start": self.tokens.cu_seqlens_q.gpu[: n + 1]}

    def _decode_tbo(self, batch: ScheduledBatch) -> tuple[torch.Tensor, None]:
        """Two ubatches: ub0 goes out with the token inputs; ub1 is prepared late."""
        st = self.state
        n = batch.num_reqs
        half = n // 2
        halves = [_slice_batch(batch, 0, half), _slice_batch(batch, half, n)]
        st.begin()
        self._sampling_plan = self.sampling.prepare(batch)
        tplan = self.tokens.prepare_ids(batch)
        self.tokens.prepare_query_prefix(batch)
        plans = [self.ubatches[0].prepare(halves[0])]
        st.publish(TBO_STEP)
        st.finish()
        self.tokens.assemble(tplan, self.sampled)
        self.ubatches[0].generate_kv_indices(plans[0])
        logits = [self.model(self._decode_inputs(self.ubatches[0], half, 0))]
        st.resume()  # late preparation of the second ubatch, same epoch
        plans.append(self.ubatches[1].prepare(halves[1]))
        st.publish(self.ubatches[1].group)
        st.finish()
        self.ubatches[1].generate_kv_indices(plans[1])
        logits.append(self.model(self._decode_inputs(self.ubatches[1], n - half, half)))
        return torch.cat(logits), None


def _all_greedy(batch: ScheduledBatch) -> bool:
    temps = batch.columns.temperatures
    return bool(temps.size) and float(temps.max()) <= GREEDY_TEMPERATURE


def _slice_batch(batch: ScheduledBatch, a: int, b: int) -> ScheduledBatch:
    cols = batch.columns
    q = cols.query_lens
    t0, t1 = int(q[:a].sum()), int(q[:b].sum())
    fields = {k: (v[t0:t1] if k == "token_ids" else v[a:b]) for k, v in vars(cols).items()}
    return ScheduledBatch((), batch.is_prefill, batch.page_size,
                          given_columns=type(cols)(**fields),
                          given_block_tables=list(batch.block_tables)[a:b], step=batch.step)
