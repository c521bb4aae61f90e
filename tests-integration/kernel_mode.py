"""The Triton mode of this process decides which device's runner tests can run."""

from __future__ import annotations

import os

import pytest


def needs_kernels(device: str) -> None:
    """Skip ``device``'s case when this process's Triton mode cannot run its kernels:
    CPU tensors need the interpreter (``TRITON_INTERPRET=1``), CUDA needs it unset."""
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if device == "cpu" and not interp:
        pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1 (nox -s tests)")
    if device == "cuda" and interp:
        pytest.skip("CUDA runs need TRITON_INTERPRET unset")
