"""The variant an engine would ship: nano-vllm's decode graphs captured over the library's
published destinations, so nothing runs between a step's publication and its replay.

Stock nano-vllm captures each decode graph over static buffers of its own, then before
every replay copies the step's tensors into them: input ids, positions, slot mapping,
context lengths and block tables, with two fills and a zero to clear the padded part
(``ModelRunner.run_model``). Here the graphs read the destinations the library publishes
into (``TokenInputs.input_ids``, ``MhaDecodeInputs.positions`` / ``slot_mapping`` /
``context_lens`` / ``block_tables``), and each decode step publishes padded to its graph's
batch size: ``DecodeStepInputs.prepare(batch, padded)`` writes the padded requests as
graph padding (slot -1, context length 0, an empty table row, position 0; see
``h2d_runner_adapters.mha_decode``). A replay reads nothing stale and needs no copy::

    P = runner.padded_size(n)           # the smallest captured size >= n (None: eager)
    step.prepare(batch, P); publish     # ONE DMA + ONE scatter, P requests
    graphs[P].replay()                  # reads the destinations; logits of the first n

The graphs are captured after the library state is bound (nano-vllm's ``__init__``
captures before a subclass can build it, so its capture is deferred here), at
nano-vllm's sizes (1, 2, 4, 8, then every 16) up to ``max_num_seqs`` (or 512), the
largest first, in one memory pool. A batch larger than the largest graph runs eagerly.

Where CUDA graphs cannot be captured (the CPU harness: ``enforce_eager``), ``replay`` runs
the captured body itself -- the model over the padded destinations of size ``P`` -- so the
CPU test checks the padded publication that a replay reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: the largest batch nano-vllm captures a decode graph for
MAX_GRAPH_BATCH = 512


def graph_sizes(max_reqs: int) -> list[int]:
    """nano-vllm's capture sizes (1, 2, 4, 8, then multiples of 16) up to ``max_reqs``
    (capped at :data:`MAX_GRAPH_BATCH`), and ``max_reqs`` itself where the list skips it."""
    top = min(max_reqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def graph_runner_class(base: type | None = None, sizes: tuple[int, ...] | None = None
                       ) -> type:
    """The graph-native runner over ``base`` (default: the library runner class),
    capturing at ``sizes`` (default: nano-vllm's, :func:`graph_sizes`; the tests pick
    sizes that pad their batches)."""
    from nanovllm.utils.context import reset_context, set_context

    from h2d_core import restore_implicit_cpu_default
    from nanovllm_harness.library_runner import library_runner_class

    library = base if base is not None else library_runner_class()

    class GraphNativeRunner(library):  # type: ignore[misc,valid-type]
        """The library runner whose decode graphs read the published destinations.

        ``publish_padded = False`` is a MUTATION for tests only: a step publishes its
        ``n`` requests and the replay of size ``P > n`` reads the padded rows' stale
        destinations (earlier steps' slots: their keys and values overwrite live KV)."""

        publish_padded = True

        def __init__(self, config: Any, rank: int, event: Any, **kwargs: Any) -> None:
            self._capture_deferred = True  # nano-vllm's __init__ captures: not yet
            #: (graph size, real requests) of the decode step prepared last
            self._replay: tuple[int, int] | None = None
            super().__init__(config, rank, event, **kwargs)
            self._capture_deferred = False
            self.graph_sizes = (graph_sizes(self.shape.max_reqs) if sizes is None
                                else sorted(s for s in sizes if s <= self.shape.max_reqs))
            hidden = config.hf_config.hidden_size
            #: the graphs' output rows (hidden states of the padded batch)
            self.graph_outputs = torch.zeros(self.graph_sizes[-1], hidden, dtype=self.dtype,
                                             device=self.h2d_device)
            #: size -> a captured graph (CUDA) or the body itself (no graphs: eager)
            self.graphs: dict[int, Any] = {}
            self.graph_pool = None
            self._capture()
            #: requests -> the smallest captured size holding them (made once, not per step)
            self._size_for = [next(s for s in self.graph_sizes if s >= n)
                              for n in range(self.graph_sizes[-1] + 1)]

        def capture_cudagraph(self) -> None:
            if not self._capture_deferred:
                super().capture_cudagraph()

        def _body(self, size: int) -> Callable[[], None]:
            """One padded decode forward over the destinations: what a graph captures."""
            d, ids, out = self.decode, self.tokens.input_ids.gpu[:size], self.graph_outputs
            positions = d.positions.gpu[:size]
            context = dict(slot_mapping=d.slot_mapping.gpu[:size],
                           context_lens=d.context_lens.gpu[:size],
                           block_tables=d.block_tables.gpu[:size])

            def body() -> None:
                set_context(False, **context)
                out[:size] = self.model(ids, positions)
                reset_context()

            return body

        def _capture(self) -> None:
            if self.enforce_eager or self.h2d_device.type != "cuda":
                self.graphs = {size: self._body(size) for size in self.graph_sizes}
                return
            dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)  # as nano-vllm's own capture runs
            try:
                with torch.inference_mode(), torch.device(self.h2d_device):
                    for size in reversed(self.graph_sizes):  # the largest first: one pool
                        body = self._body(size)
                        body()  # warm-up (the destinations hold no request: nothing read)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, self.graph_pool):
                            body()
                        if self.graph_pool is None:
                            self.graph_pool = graph.pool()
                        self.graphs[size] = graph
                        torch.cuda.synchronize()
            finally:
                torch.set_default_dtype(dtype)
            restore_implicit_cpu_default()

        def padded_size(self, n: int) -> int | None:
            size = self._size_for[n] if n < len(self._size_for) else None
            self._replay = None if size is None else (size, n)
            return size if self.publish_padded else None

        def prepare_prefill(self, seqs: list[Any]) -> Any:
            self._replay = None
            return super().prepare_prefill(seqs)

        @torch.inference_mode()  # as nano-vllm's own (else torch.compile traces autograd)
        def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      is_prefill: bool) -> torch.Tensor:
            replay, self._replay = self._replay, None
            if is_prefill or replay is None:  # prefill, warm-up, a batch past the graphs
                return self.model.compute_logits(self.model(input_ids, positions))
            size, n = replay
            graph = self.graphs[size]
            if isinstance(graph, torch.cuda.CUDAGraph):
                graph.replay()
            else:
                graph()
            return self.model.compute_logits(self.graph_outputs[:n])

    return GraphNativeRunner
