"""nano-vllm on CPU with the library as its metadata path, checked step by step:
``python -m nanovllm_harness.library_cpu MODEL_DIR [--sampled] [--preempt] [--graphs]``
prints one JSON line (the last of its output): what :func:`stock_cpu.main` prints for the
same workload, plus ``steps``, one record per ``prepare_*`` call the engine made.

The engine constructs :class:`CheckingRunner`, the library runner
(:mod:`library_runner`) that for every step of the workload first runs the parent's (stock)
``prepare_*`` on the same scheduled sequences, keeps what stock uploads and hands to
``set_context``, then runs the library's, whose context the model reads. Each record holds:

* ``mismatches``: every member where the library's view differs from stock's upload, on
  its valid prefix (block tables: each row's pages; stock pads with -1, the library's
  table with 0 -- checked, and reported apart as ``padding``), the host ints and the
  None-ness of optional members included;
* ``counters``: the step group's publication counters over the library's call
  (``publications``, ``dmas``, ``scatters``, ``direct_copies``), and every other group's
  publications (none);
* ``calls``: ``Tensor.cuda``, ``Tensor.to`` and ``Tensor.copy_`` calls made during the
  library's call (on CPU the one DMA is a ``copy_``);
* ``replay_size`` (decode steps): the graph-native runner's graph size for the step (the
  requests it published, padding included), else None.

``--graphs`` runs the graph-native runner (:mod:`library_graphs`): each decode step
publishes padded to a graph size, and the model reads the padded destinations (on CPU the
graph's body runs in place of a replay).

``H2D_NANOVLLM_MUTATION`` (read here only; see ``tests-integration/
test_nanovllm_library.py``): ``stale_lineage`` builds the runner's
:class:`library_runner.SequenceLineages` with ``stale_on_rewrite=True`` (a sequence whose
page list was re-allocated keeps its old lineage); ``unpadded_replay`` (with ``--graphs``)
publishes each decode step unpadded while the replay still reads the padded size.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

MUTATION_ENV = "H2D_NANOVLLM_MUTATION"
#: what MUTATION_ENV may name ("": none)
MUTATIONS = ("", "stale_lineage", "unpadded_replay")

#: Tensor methods counted while the library's prepare runs
COUNTED = ("cuda", "to", "copy_")


class _Calls:
    """Counts :data:`COUNTED` calls while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.counts: Counter[str] = Counter()

    def install(self, names: tuple[str, ...]) -> None:
        import torch

        for name in names:
            original = getattr(torch.Tensor, name)

            def counted(self_: Any, *a: Any, _name: str = name, _original: Any = original,
                        **k: Any) -> Any:
                if self.active:
                    self.counts[_name] += 1
                return _original(self_, *a, **k)

            setattr(torch.Tensor, name, counted)


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return False
        a, b = a.cpu(), b.cpu()
        if a.dtype.is_floating_point or b.dtype.is_floating_point:
            return a.dtype == b.dtype and torch.equal(a, b)
        return torch.equal(a.long(), b.long())
    return type(a) is type(b) and a == b


def _describe(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return {"dtype": str(x.dtype), "shape": list(x.shape), "values": x.cpu().tolist()}
    return x


#: the graph-native runs' capture sizes: the workload's decode batches (4, 2, 1 requests)
#: each publish padded (to 8 or 3 requests)
TEST_GRAPH_SIZES = (3, 8)


def checking_runner_class(counted: tuple[str, ...] = COUNTED, *, graphs: bool = False
                          ) -> type:
    """The library runner checking each step against stock's ``prepare_*``, counting the
    ``counted`` tensor methods (process-wide wrappers) over the library's calls;
    ``graphs``: over the graph-native runner (:mod:`library_graphs`) capturing at
    :data:`TEST_GRAPH_SIZES`."""
    import nanovllm.engine.model_runner as stock
    import torch
    from nanovllm.utils.context import get_context

    from nanovllm_harness.library_runner import SequenceLineages, library_runner_class

    mutation = os.environ.get(MUTATION_ENV, "")
    if mutation not in MUTATIONS:
        raise ValueError(f"{MUTATION_ENV}={mutation!r}: known are {MUTATIONS[1:]}")
    if mutation == "unpadded_replay" and not graphs:
        raise ValueError(f"{MUTATION_ENV}=unpadded_replay needs --graphs")
    library = library_runner_class()
    if graphs:
        from nanovllm_harness.library_graphs import graph_runner_class

        library = graph_runner_class(library, TEST_GRAPH_SIZES)
        library.publish_padded = mutation != "unpadded_replay"
    calls = _Calls()
    calls.install(counted)

    class CheckingRunner(library):  # type: ignore[misc,valid-type]
        def __init__(self, config: Any, rank: int, event: Any) -> None:
            lineages = SequenceLineages(stale_on_rewrite=mutation == "stale_lineage")
            #: False: the library's path alone (no stock call, no record), for profiling
            self.checking = True
            super().__init__(config, rank, event, lineages=lineages)
            self.steps: list[dict[str, Any]] = []

        def _library(self, kind: str, seqs: list[Any], call: Any) -> tuple[Any, dict[str, Any]]:
            """Run the library's ``call()``, counting tensor calls and publications."""
            st = self.h2d_state
            groups = ("prefill_step", "decode_step")
            before = {g: st.counters(g).snapshot() for g in groups}
            calls.counts.clear()
            calls.active = True
            try:
                out = call()
            finally:
                calls.active = False
            delta = {g: (st.counters(g) - before[g]).as_dict() for g in groups}
            record = {"kind": kind, "num_seqs": len(seqs), "seq_ids": [s.seq_id for s in seqs],
                      "calls": dict(calls.counts), "counters": delta, "mismatches": [],
                      "padding": []}
            if kind == "decode":  # the graph-native runner's replay size (None: eager)
                record["replay_size"] = self._replay_size()
            self.steps.append(record)
            return out, record

        def _replay_size(self) -> int | None:
            replay = getattr(self, "_replay", None)
            return None if replay is None else int(replay[0])

        def _compare(self, record: dict[str, Any], name: str, want: Any, got: Any) -> None:
            if not _same(want, got):
                record["mismatches"].append({"member": name, "stock": _describe(want),
                                             "library": _describe(got)})

        def _compare_tables(self, record: dict[str, Any], seqs: list[Any], want: Any,
                            got: Any) -> None:
            if want is None or got is None or want.shape != got.shape:
                self._compare(record, "block_tables", want, got)
                return
            for i, s in enumerate(seqs):
                k = len(s.block_table)
                self._compare(record, f"block_tables[{i}, :{k}]", want[i, :k], got[i, :k])
                if k < want.shape[1]:
                    record["padding"].append({"row": i, "stock": want[i, k:].tolist(),
                                              "library": got[i, k:].tolist()})

        def _check_context(self, record: dict[str, Any], seqs: list[Any], want: Any,
                           got: Any) -> None:
            for field in ("is_prefill", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                          "max_seqlen_k", "slot_mapping", "context_lens"):
                self._compare(record, field, getattr(want, field), getattr(got, field))
            self._compare_tables(record, seqs, want.block_tables, got.block_tables)

        def _checked(self, kind: str, seqs: list[Any], stock_call: Any,
                     library_call: Any) -> Any:
            """Stock's ``prepare_*`` on ``seqs``, then the library's (whose result the model
            reads), their ids, positions and contexts compared."""
            want = stock_call(self, seqs)
            want_context = get_context()
            got, record = self._library(kind, seqs, lambda: library_call(seqs))
            self._compare(record, "input_ids", want[0], got[0])
            self._compare(record, "positions", want[1], got[1])
            self._check_context(record, seqs, want_context, get_context())
            return got

        def prepare_prefill(self, seqs: list[Any]) -> Any:
            library_call = super().prepare_prefill
            if not self.checking or not all(s.block_table for s in seqs):  # warm-up
                return library_call(seqs)
            return self._checked("prefill", seqs, stock.ModelRunner.prepare_prefill,
                                 library_call)

        def prepare_decode(self, seqs: list[Any]) -> Any:
            library_call = super().prepare_decode
            if not self.checking:
                return library_call(seqs)
            return self._checked("decode", seqs, stock.ModelRunner.prepare_decode,
                                 library_call)

        def prepare_sample(self, seqs: list[Any], is_cfg_batch: bool = False) -> Any:
            if not self.checking or self._step is None:  # not checked, the warm-up's
                return super().prepare_sample(seqs, is_cfg_batch)
            want = stock.ModelRunner.prepare_sample(self, seqs, is_cfg_batch)
            got, record = self._library(
                "sample", seqs,
                lambda: super(CheckingRunner, self).prepare_sample(seqs, is_cfg_batch))
            names = ("temperatures", "cfg_scales", "top_ks", "top_ps", "repetition_penalties")
            s = self.sampling
            published = {s.temperatures.gpu.data_ptr(): "published",
                         s.top_ks.gpu.data_ptr(): "published",
                         s.top_ps.gpu.data_ptr(): "published",
                         self._uniform_k.data_ptr(): "device fill",
                         self._uniform_p.data_ptr(): "device fill"}
            sources = record["sources"] = {}
            for name, w, g in zip(names, want, got, strict=True):
                self._compare(record, name, w, g)
                if isinstance(g, torch.Tensor):
                    sources[name] = published.get(g.data_ptr(), f"host ({g.device})")
            return got

    return CheckingRunner


def main(model_dir: str, *, sampled: bool = False, preempt_phase: bool = False,
         graphs: bool = False) -> dict[str, Any]:
    from nanovllm_harness import stock_cpu
    from nanovllm_harness.library_runner import install

    nanovllm = stock_cpu.setup_cpu(model_dir)
    install(checking_runner_class(graphs=graphs))
    run = stock_cpu.run_workload(nanovllm, model_dir, sampled=sampled,
                                 preempt_phase=preempt_phase)
    llm = run.pop("llm")
    run["steps"] = llm.model_runner.steps
    run["mutation"] = os.environ.get(MUTATION_ENV, "")
    return run


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], sampled="--sampled" in args,
                          preempt_phase="--preempt" in args, graphs="--graphs" in args)),
          flush=True)
