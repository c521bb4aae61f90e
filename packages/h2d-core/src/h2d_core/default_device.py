"""The implicit CPU default: no ``DeviceContext`` on the torch-function mode stack.

``torch.set_default_device(dev)`` with any non-``None`` ``dev`` ("cpu" included) enters a
``torch.utils._device.DeviceContext``, a ``TorchFunctionMode``: while it is on the stack,
every Python-level torch call of a step (each ``copy_``, view, launch argument check)
dispatches through its ``__torch_function__``. Engines set a CUDA default while they build
the model, buffers and graphs; restoring ``"cpu"`` afterwards keeps the mode. Only
``set_default_device(None)`` leaves it, which is what :func:`restore_implicit_cpu_default`
does once, after GPU initialization::

    torch.set_default_device("cuda")      # model, buffers, graph capture ...
    runner = build_runner()
    restore_implicit_cpu_default()        # then serve: no DeviceContext per call
"""

from __future__ import annotations

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from .errors import DeviceContextError


def device_context_active() -> bool:
    """Whether a ``DeviceContext`` (``set_default_device`` or ``with torch.device(...)``)
    is on this thread's torch-function mode stack."""
    return any(isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())


def restore_implicit_cpu_default() -> None:
    """Leave the default-device mode: ``torch.set_default_device(None)``.

    Call it once after GPU initialization (model, buffers, graph capture), on the thread
    that runs the steps: device-less factories then allocate on the CPU, as the implicit
    default, and no torch call pays the mode's dispatch. Raises
    :class:`DeviceContextError` if a ``with torch.device(...)`` block (which this cannot
    leave) is still open.
    """
    torch.set_default_device(None)
    if device_context_active():
        raise DeviceContextError(
            "a torch.device(...) context is still active after set_default_device(None): "
            "it was entered with `with torch.device(...)`; run the steps outside that block"
        )
