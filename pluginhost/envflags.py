"""Boolean switches read from the environment."""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_TRUE = {"1", "true", "yes", "on"}


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value (1, true, yes, on; any case)."""
    return os.environ.get(name, "").strip().lower() in _TRUE
