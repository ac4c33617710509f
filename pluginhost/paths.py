"""Where pluginhost keeps what it learns about this machine."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "user_cache_dir"]

CACHE_DIR_ENV = "PLUGINHOST_CACHE_DIR"


def user_cache_dir() -> Path:
    """``$PLUGINHOST_CACHE_DIR``, else ``$XDG_CACHE_HOME/pluginhost``, else ``~/.cache/pluginhost`` (not created).

    A relative ``XDG_CACHE_HOME`` is ignored, as the XDG Base Directory specification requires (it would
    put the cache under whatever directory the command happens to run in).
    """
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "pluginhost"
