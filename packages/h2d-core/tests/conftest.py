"""Fixtures for the h2d-core suites (helpers live in core_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import core_helpers


@pytest.fixture
def h() -> ModuleType:
    """The shared helpers (tests cannot import conftest under importlib import mode)."""
    return core_helpers
