"""Boolean switches read from the environment."""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def env_flag(name: str, *, strict: bool = True) -> bool:
    """Whether environment variable ``name`` is set to a true value (1, true, yes, on; any case).

    Unset, empty or a false value (0, false, no, off) is off; anything else is a ``ValueError`` naming
    the variable, rather than a typo silently read as off (``strict=False``: off, for another
    program's variable).
    """
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE or not strict:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is neither on (1, true, yes, on) nor off (0, false, no, off)")
