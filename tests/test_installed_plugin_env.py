"""A real plugin distribution, installed with pip into a fresh virtual environment.

Runs ``sample_plugins/smoke_test.py``: pluginhost and ``sample_plugins/mock_opt``
built and installed from this tree, then ``pluginhost plugins --json``,
``models --json`` and ``generate`` checked there, the way users meet plugins.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sample_plugin_installed_in_a_fresh_virtualenv(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample_plugins" / "smoke_test.py"), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mock_opt is loaded from its distribution" in result.stdout
    assert "FAIL" not in result.stdout
