"""The plugin-writing guide's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-plugins.md"
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.DOTALL)
RUNNABLE = [block for block in BLOCKS if "ensure_demo_model" in block]


def test_every_hook_has_a_runnable_example():
    for hook in ("register_models", "modify_config", "pre_load", "post_load"):
        assert any(f"def {hook}(" in block for block in RUNNABLE), hook


@pytest.mark.parametrize("block", RUNNABLE, ids=[re.search(r"def (\w+)\(self", b).group(1) for b in RUNNABLE])
def test_guide_example_runs(block):
    exec(compile(block, str(GUIDE), "exec"), {"__name__": "guide_example"})
