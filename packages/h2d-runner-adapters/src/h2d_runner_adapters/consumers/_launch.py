"""Argument checks and grid helpers shared by the consumer launchers.

Checks read only tensor metadata (dtype, shape, device): never values, so they
cost no device synchronization.

The kernels themselves carry no Python type annotations (mypy is told to
ignore them): Triton reads parameter annotations as type specializations.
"""

from __future__ import annotations

import torch
import triton

from h2d_runner_adapters.consumers.errors import ConsumerArgumentError, ConsumerDeviceError


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

    Triton chooses the mode once, when the kernel is decorated: an interpreted
    kernel runs on CPU tensors only (CUDA tensors would be copied to the host and
    back), a compiled one on CUDA tensors only.
    """
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def _mode_probe(x):  # type: ignore[no-untyped-def]
    """Never launched: decorated beside every consumer kernel (they all import this
    module), its type says which mode Triton gave them."""
    pass


def consumers_fusable(device: str | torch.device) -> bool:
    """Whether first consumers can run inside publications on ``device`` (the adapters'
    ``fuse_*`` options): on CUDA, always; on CPU, only under Triton's interpreter
    (``TRITON_INTERPRET=1`` set before triton is imported), where the CPU arena runs the
    real kernels. Elsewhere a ``fuse_*`` option is refused with a DeclarationError."""
    return torch.device(device).type != "cpu" or interpreted(_mode_probe)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``max(n, 1)``."""
    return 1 << max(n - 1, 0).bit_length()


def bucket(n: int) -> int:
    """Grid rows for ``n`` live rows: the next power of two, so few grid shapes occur.

    Programs past ``n`` see their rows masked off and write nothing.
    """
    return next_power_of_two(n)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_count(func: str, name: str, value: object) -> int:
    """``value`` must be a Python int >= 0 (a host-side count: never a tensor)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConsumerArgumentError(
            f"{func}: {name} must be a Python int (a host-side count), got "
            f"{type(value).__name__}; pass the count the host already knows, never a GPU scalar"
        )
    if value < 0:
        raise ConsumerArgumentError(f"{func}: {name} must be >= 0, got {value}")
    return value


def check_tensor(
    func: str,
    name: str,
    tensor: object,
    *,
    dtype: torch.dtype,
    ndim: int,
    min_numel: int = 0,
    unit_stride: bool = True,
) -> torch.Tensor:
    """``tensor`` must be a torch tensor of ``dtype`` and rank ``ndim`` with >= ``min_numel``
    elements (rank 1) or rows (rank 2); with ``unit_stride`` its last dimension has stride 1."""
    if not isinstance(tensor, torch.Tensor):
        raise ConsumerArgumentError(
            f"{func}: {name} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if tensor.dtype != dtype:
        raise ConsumerArgumentError(
            f"{func}: {name} must have dtype {dtype}, got {tensor.dtype}; "
            f"allocate the buffer with dtype={dtype}"
        )
    if tensor.dim() != ndim:
        raise ConsumerArgumentError(
            f"{func}: {name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}"
        )
    if tensor.shape[0] < min_numel:
        what = "elements" if ndim == 1 else "rows"
        raise ConsumerArgumentError(
            f"{func}: {name} has {tensor.shape[0]} {what}, needs at least {min_numel}; "
            f"pass a larger buffer or a smaller count"
        )
    if unit_stride and tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ConsumerArgumentError(
            f"{func}: {name} must have stride 1 in its last dimension, got strides "
            f"{tuple(tensor.stride())}; pass a contiguous view"
        )
    return tensor


def check_devices(func: str, kernel: object, **tensors: torch.Tensor) -> torch.device:
    """All ``tensors`` share one device, and ``kernel``'s Triton mode can run on it."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        if other != device:
            raise ConsumerDeviceError(
                f"{func}: {name} is on {other} but {first_name} is on {device}; "
                "every tensor of one call must be on the same device"
            )
    if interpreted(kernel):
        if device.type != "cpu":
            raise ConsumerDeviceError(
                f"{func}: Triton runs in the interpreter (TRITON_INTERPRET=1) but the tensors "
                f"are on {device}; unset TRITON_INTERPRET before importing triton to run "
                "compiled kernels on the GPU"
            )
    elif device.type == "cpu":
        raise ConsumerDeviceError(
            f"{func}: the tensors are on the CPU but Triton compiles for the GPU; set "
            "TRITON_INTERPRET=1 before importing triton to run the kernels on CPU tensors"
        )
    return device
