"""Who is acting right now: the plugin whose code is running, if any.

The host sets the current plugin while it imports a plugin and while it runs
one of its hook implementations. Registrations and configuration changes read
it, so ``pluginhost models`` and ``pluginhost config`` can say which plugin did
what, and errors can name the plugin at fault.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["PluginRef", "acting_as", "current_plugin"]


@dataclass(frozen=True)
class PluginRef:
    """A plugin's identity: its name and, for installed plugins, its distribution."""

    name: str
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        """``plugin 'name' (distribution dist 1.0)``, for messages."""
        if self.distribution:
            return f"plugin {self.name!r} (distribution {self.distribution} {self.version or '?'})"
        return f"plugin {self.name!r}"


_current: ContextVar[PluginRef | None] = ContextVar("pluginhost_current_plugin", default=None)


def current_plugin() -> PluginRef | None:
    """The plugin whose code is running, or ``None`` outside plugin code."""
    return _current.get()


@contextmanager
def acting_as(plugin: PluginRef | None) -> Iterator[None]:
    """Attribute everything done inside the block to ``plugin``."""
    token = _current.set(plugin)
    try:
        yield
    finally:
        _current.reset(token)
