"""Exceptions raised by the consumer launchers.

Every launcher checks all of its arguments (dtypes, ranks, sizes, devices and
the Triton mode) before it launches anything, so a rejected call writes nothing.
Messages name the argument, the rule it broke and what to do.
"""

from __future__ import annotations


class ConsumerArgumentError(ValueError):
    """A consumer launcher rejected an argument; nothing was launched or written."""


class ConsumerDeviceError(ConsumerArgumentError):
    """The tensors are on different devices, or on a device this Triton mode cannot run."""
