"""Fixtures for the h2d-core suites (helpers live in core_helpers.py)."""

from __future__ import annotations

from types import ModuleType

import core_helpers
import pytest


@pytest.fixture
def h() -> ModuleType:
    """The shared helpers (tests cannot import conftest under importlib import mode)."""
    return core_helpers
