"""The plugin-writing guide's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "writing-plugins.md"
TEXT = GUIDE.read_text(encoding="utf-8")
SECTION_2 = TEXT.split("\n## 2.", 1)[1].split("\n## 3.", 1)[0]
RUNNABLE = re.findall(r"```python\n(.*?)```", SECTION_2, flags=re.DOTALL)


def test_every_hook_and_the_register_function_have_a_runnable_example():
    import hookspecs

    for hook in hookspecs.__all__:
        if hook not in ("BUILD_HOOKS", "ENTRY_POINT_GROUP", "PROJECT_NAME", "hookimpl", "hookspec"):
            assert any(f"def {hook}(" in block for block in RUNNABLE), hook
    assert any("def register():" in block for block in RUNNABLE)


def test_the_guide_says_which_examples_run():
    assert "Every Python example in section 2 runs as it" in TEXT
    outside = re.findall(r"```python\n(.*?)```", TEXT.replace(SECTION_2, ""), flags=re.DOTALL)
    assert all("ensure_demo_model" not in block for block in outside)  # a runnable example outside section 2


@pytest.mark.parametrize("block", RUNNABLE, ids=[re.search(r"def (\w+)\(", b).group(1) for b in RUNNABLE])
def test_guide_example_runs(block):
    exec(compile(block, str(GUIDE), "exec"), {"__name__": "guide_example"})
