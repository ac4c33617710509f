"""Where pluginhost keeps what it learns about this machine."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "user_cache_dir"]

CACHE_DIR_ENV = "PLUGINHOST_CACHE_DIR"


def user_cache_dir() -> Path:
    """``$PLUGINHOST_CACHE_DIR``, else ``$XDG_CACHE_HOME/pluginhost``, else ``~/.cache/pluginhost`` (not created)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pluginhost"
