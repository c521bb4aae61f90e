"""Fixtures shared by the adapter suites."""

from __future__ import annotations

import pytest
import torch

from h2d_runner_adapters.consumers._launch import interpreted
from h2d_runner_adapters.v4.step_indptrs import _step_indptrs_kernel


@pytest.fixture
def dev(device: str) -> torch.device:
    """The device of a consumer-kernel case: CPU only under Triton's interpreter, CUDA only
    with compiled kernels."""
    if device == "cpu" and not interpreted(_step_indptrs_kernel):
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1, set by "
                    "`nox -s tests`); this process compiles the kernels for CUDA")
    if device == "cuda" and interpreted(_step_indptrs_kernel):
        pytest.skip("CUDA cases need compiled kernels: unset TRITON_INTERPRET")
    return torch.device(device)
