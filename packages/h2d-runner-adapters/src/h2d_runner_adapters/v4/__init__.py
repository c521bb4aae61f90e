"""DeepSeek-V4/V4.1's room: its metadata producer and the kernels that first read it.

* :mod:`.metadata`: ``V41MetadataInputs``, the ``v41_metadata`` group and its producer;
* :mod:`.spans`: a step's request spans (``RequestSpan``, ``SpanColumns``);
* :mod:`.decode_steps`: the decode step indptrs and per-token expansion;
* :mod:`.step_indptrs`: prefill indptrs and indices, the indexer rectangle;
* :mod:`.window_rows`: where each request's window rings live in the KV row space.

The public names are exported by :mod:`h2d_runner_adapters` and
:mod:`h2d_runner_adapters.consumers`; this package imports nothing itself, so either may
import its modules first.
"""
