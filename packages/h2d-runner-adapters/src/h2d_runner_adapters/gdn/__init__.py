"""GDN (Qwen3-Next) state slots' room: the producer (:mod:`.inputs`: each request's
recurrent-state slot, in the step's group) and its first consumer beside it (:mod:`.states`:
the states gathered by those slots). The public names are exported by
:mod:`h2d_runner_adapters`; this package imports nothing itself."""
