"""Engram's room: the producer (:mod:`.inputs`: the cursor rules and candidates, stated in
the layout's generic vocabulary) and its kernels (:mod:`.cursors`: the tentative writes and
the cursors' commit). The public names are exported by :mod:`h2d_runner_adapters`; this
package imports nothing itself."""
