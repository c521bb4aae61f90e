"""MRoPE's room: the planes a multimodal model's positions take (:mod:`.inputs`: their
declaration, checks and layout outputs) and the kernel that selects them (:mod:`.positions`).
The public names are exported by :mod:`h2d_runner_adapters`; this package imports nothing
itself."""
