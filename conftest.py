"""Workspace-wide pytest configuration shared by every package's tests.

Tests that take a ``device`` argument run once per available device kind:
``"cpu"`` always (Triton kernels run under ``TRITON_INTERPRET=1`` there) and
``"cuda"`` only when ``RUN_H2D_GPU_TESTS=1``. Asking for GPU tests on a machine
without CUDA is an error, never a silent skip. This module must not import torch
at import time: the block-tables suite runs without it.
"""

from __future__ import annotations

import os

import pytest


def gpu_tests_requested() -> bool:
    return os.environ.get("RUN_H2D_GPU_TESTS") == "1"


def _devices() -> list[str]:
    devices = ["cpu"]
    if gpu_tests_requested():
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(
                "RUN_H2D_GPU_TESTS=1 but torch.cuda.is_available() is False: "
                "run the GPU suites on a CUDA machine or unset the variable"
            )
        devices.append("cuda")
    return devices


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", _devices())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked ``gpu`` have no CPU half; they run only on the opt-in GPU run.
    if gpu_tests_requested():
        return
    skip = pytest.mark.skip(reason="GPU test: set RUN_H2D_GPU_TESTS=1 on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
