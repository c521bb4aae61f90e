"""The implicit CPU default: detecting and leaving the default-device mode."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from h2d_core import DeviceContextError, device_context_active, restore_implicit_cpu_default


@pytest.fixture(autouse=True)
def _leave_default() -> Iterator[None]:
    yield
    torch.set_default_device(None)


def test_cpu_default_is_still_a_mode_and_restoring_leaves_it() -> None:
    assert not device_context_active()
    torch.set_default_device("cpu")  # what an engine restores after GPU init
    assert device_context_active()
    restore_implicit_cpu_default()
    assert not device_context_active()
    assert torch.empty(1).device.type == "cpu"  # device-less factories: the CPU


def test_an_open_device_block_is_reported() -> None:
    with torch.device("cpu"), pytest.raises(DeviceContextError, match=r"with torch.device"):
        restore_implicit_cpu_default()
    assert not device_context_active()
