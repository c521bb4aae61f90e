"""Sampling's room: its producer (:mod:`.inputs`), its per-request rules, checked once
(:mod:`.rules`: temperature, top-k, top-p), and its kernels (:mod:`.sampler`, the
filters in :mod:`.filters`). The public names are exported by :mod:`h2d_runner_adapters`
and :mod:`h2d_runner_adapters.consumers`; this package imports nothing itself, so either
may import it first."""
