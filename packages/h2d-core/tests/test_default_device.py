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


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_binding_under_another_default_device_keeps_host_memory_on_the_cpu(
        backend: str) -> None:
    """Engines bind while a CUDA default device is set: every pinned source and arena is
    allocated on the CPU explicitly (here the default is "meta", which would leave them
    without storage)."""
    from h2d_core import H2DRunnerState

    torch.set_default_device("meta")
    st = H2DRunnerState("cpu", backend=backend, scatter="reference")
    a = st.buffer("a", (4,), torch.int32, group="g")
    b = st.buffer("b", (3,), torch.int64, group="g")
    st.bind()
    restore_implicit_cpu_default()
    st.begin()
    a.np[:2] = [7, 8]
    b.np[:1] = [9]
    st.set_count(a, 2)
    st.set_count(b, 1)
    st.publish("g")
    st.finish()
    assert a.gpu.device.type == "cpu" and a.gpu[:2].tolist() == [7, 8]
    assert b.gpu[:1].tolist() == [9]
