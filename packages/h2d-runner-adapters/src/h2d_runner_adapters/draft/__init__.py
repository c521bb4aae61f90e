"""Draft loops' room: the MHA draft loop (:mod:`.loop`), the per-step metadata kernel it
advances (:mod:`.step`), the draft-id gather (:mod:`.gather`) and the acceptance kernel
(:mod:`.acceptance`). The public names are exported by :mod:`h2d_runner_adapters` and
:mod:`h2d_runner_adapters.consumers`; this package imports nothing itself."""
