"""The package README's code runs as written (numpy only)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python block"
    for k, code in enumerate(blocks):
        exec(compile(code, f"{README.name}[block {k}]", "exec"), {"__name__": "readme"})
