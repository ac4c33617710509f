"""The hooks are documented where users look, with the signatures the specs have."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pluggy

import hookspecs

README = Path(__file__).resolve().parents[1] / "README.md"


def spec_signatures() -> dict[str, str]:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return {
        name: f"{name}({', '.join(getattr(pm.hook, name).spec.argnames)})"
        for name in vars(pm.hook)
        if not name.startswith("_")
    }


def documented_signatures() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Hooks\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^### `((\w+)\(([^)]*)\))`$", section, flags=re.MULTILINE)
    return {name: signature for signature, name, _ in found}


def test_every_hook_is_documented_in_the_readme_with_its_signature():
    assert documented_signatures() == spec_signatures()


def test_the_contract_hooks_exist():
    assert set(spec_signatures()) == {
        "register_models",
        "modify_config",
        "pre_load",
        "post_load",
        "register_logits_processors",
        "on_request",
        "on_output",
        "record_stats",
        "register_routes",
    }


def test_every_spec_docstring_states_when_what_may_and_must_not_with_an_example():
    for name in spec_signatures():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        for part in ("Called", "May:", "Must not:", "Example::"):
            assert part in doc, f"{name}'s docstring lacks {part!r}"


def test_every_test_named_in_the_fault_table_exists():
    root = README.parent
    text = (root / "docs" / "faults.md").read_text(encoding="utf-8")
    references = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text))
    assert len(references) >= 20
    for path, name in sorted(references):
        source = (root / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {name}\(", source, flags=re.MULTILINE), f"{path}::{name} does not exist"
