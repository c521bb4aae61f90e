"""Whether nano-vllm is installed, as a test sees it."""

from __future__ import annotations

import importlib.util
import os


def require_nanovllm() -> None:
    """Skip the calling test when nano-vllm is not installed; fail it instead under
    ``H2D_REQUIRE_NANOVLLM=1`` (``nox -s tests`` installs it and sets that)."""
    import pytest

    if importlib.util.find_spec("nanovllm") is not None:
        return
    why = "nanovllm is not installed (pip install nano-vllm-fork==20260210 xxhash)"
    if os.environ.get("H2D_REQUIRE_NANOVLLM") == "1":
        pytest.fail(f"{why} and H2D_REQUIRE_NANOVLLM=1", pytrace=False)
    pytest.skip(f"{why}; H2D_REQUIRE_NANOVLLM=1 makes this a failure")
