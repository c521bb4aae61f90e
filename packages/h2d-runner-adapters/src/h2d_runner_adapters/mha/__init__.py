"""The MHA decode family's room: its producer (:mod:`.inputs`: positions, KV slots,
context lengths, the KV page prefix and the block table) and its first consumer beside it
(:mod:`.kv_indices`: the KV indices from the published table and prefix). The public
names are exported by :mod:`h2d_runner_adapters` and :mod:`h2d_runner_adapters.consumers`;
this package imports nothing itself, so either may import it first."""
