"""Who is acting right now: the plugin whose code is running, if any.

Registrations and configuration changes ask ``current_plugin()``, so
``pluginhost models`` and ``pluginhost config`` can say which plugin did what;
errors raised in hooks are traced back to their plugin the same way.

Two sources, and nothing on the hot path of a hook call:

* while the host imports a plugin, it is the current plugin (``acting_as``);
* while the host dispatches a hook (``start_dispatch``), the running hook
  implementation is found on demand by walking the stack (or an exception's
  traceback) for the code of a registered implementation (``HookOwners``).
  Only an attribution event (an assignment, a registration, an error) pays
  for the walk; pluggy's dispatch runs untouched.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import CodeType, FrameType, TracebackType
from typing import Any

__all__ = [
    "HookOwners",
    "PluginRef",
    "acting_as",
    "current_plugin",
    "end_dispatch",
    "importing_plugin",
    "is_main_guard",
    "process_independent_name",
    "run_only_under_main_guard",
    "start_dispatch",
]

#: The name a process started by ``multiprocessing``'s spawn (a tensor-parallel rank) gives the script it imports.
SPAWNED_MAIN = "__mp_main__"


def process_independent_name(module: str) -> str:
    """``module``, with the script named ``__main__`` in every process.

    The process running a script knows it as ``__main__``; a spawned process (a tensor-parallel
    rank) imports the same script as ``__mp_main__``. Whatever the script registers or passes
    must be named alike on every rank, or the ranks' comparison sees two sources for one thing.
    """
    return "__main__" if module == SPAWNED_MAIN else module


def is_main_guard(node: ast.stmt) -> bool:
    """Whether ``node`` is ``if __name__ == "__main__":`` (either way round)."""
    test = node.test if isinstance(node, ast.If) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, *test.comparators]
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in sides) and any(
        isinstance(n, ast.Constant) and n.value == "__main__" for n in sides
    )


# Script file -> the line ranges of its top-level ``if __name__ == "__main__":`` blocks.
_GUARDS: dict[str, tuple[range, ...]] = {}


def run_only_under_main_guard(frame: FrameType | None) -> int | None:
    """The script's line running now, when it is in the script's ``if __name__ == "__main__":`` block; else ``None``.

    What that block does (directly or through functions it calls) happens in the process running the
    script only: a spawned tensor-parallel rank imports the script without running it. Found from the
    script's top-level frame on the stack from ``frame`` outwards, and the script's source.
    """
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
    ):
        frame = frame.f_back
    script = frame.f_code.co_filename if frame is not None else None
    if frame is None or script is None:
        return None
    guards = _GUARDS.get(script)
    if guards is None:
        try:
            with open(script, encoding="utf-8") as source:
                tree = ast.parse(source.read())
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):  # python -c, a REPL: no script to read
            tree = ast.Module(body=[], type_ignores=[])
        guards = _GUARDS[script] = tuple(
            range(node.lineno, (node.end_lineno or node.lineno) + 1) for node in tree.body if is_main_guard(node)
        )
    line = frame.f_lineno
    return line if any(line in guard for guard in guards) else None


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

    def remedy(self, *, by_distribution: bool = False) -> str:
        """How to get going again, for messages about this plugin's faults.

        ``by_distribution``: name it by its distribution (when another plugin has the same name).
        """
        if self.distribution:
            name = self.distribution if by_distribution else self.name
            flag, variable = f"--disable-plugin {name}", f"PLUGINHOST_DISABLED_PLUGINS={name}"
            return f"Fix or uninstall it, or disable it with {flag} or {variable}."
        return f"Fix {self.name}, or leave it out of the plugins passed to the engine (plugins=[...])."


class HookOwners:
    """Which plugin each registered hook implementation belongs to (one per host)."""

    def __init__(self) -> None:
        # Code object -> (bound instance or None, plugin). Methods of one class
        # share their code: the instance tells two in-process plugins apart.
        self._owners: dict[CodeType, list[tuple[object | None, PluginRef]]] = {}
        # Source file -> the plugins with hook implementations in it (several for in-process plugins
        # written side by side): code a plugin installs (a forward hook, a patched method) lives there too.
        self._files: dict[str, list[PluginRef]] = {}

    def add(self, function: Any, plugin: PluginRef) -> None:
        instance = getattr(function, "__self__", None)
        # A decorated hook (functools.wraps) also by the function it wraps: a decorator several plugins
        # share has one code object, the functions under it are each plugin's own.
        for each in {function, inspect.unwrap(function)}:
            code = getattr(getattr(each, "__func__", each), "__code__", None)
            if isinstance(code, CodeType):
                self._owners.setdefault(code, []).append((instance, plugin))
                plugins = self._files.setdefault(code.co_filename, [])
                if plugin not in plugins:
                    plugins.append(plugin)

    def plugins_of_file(self, filename: str) -> list[PluginRef]:
        """The plugins whose hook implementations are in ``filename`` (none for other files)."""
        return self._files.get(filename, [])

    def _owner(self, frame: FrameType) -> PluginRef | None:
        candidates = self._owners.get(frame.f_code)
        if not candidates:
            return None
        if len(candidates) > 1:
            this = frame.f_locals.get("self")
            for instance, plugin in candidates:
                if instance is this:
                    return plugin
        return candidates[-1][1]

    def in_stack(self, frame: FrameType | None) -> PluginRef | None:
        """The innermost hook implementation on the stack from ``frame`` outwards."""
        while frame is not None:
            owner = self._owner(frame)
            if owner is not None:
                return owner
            frame = frame.f_back
        return None

    def in_traceback(self, tb: TracebackType | None) -> PluginRef | None:
        """The innermost hook implementation in an exception's traceback."""
        found = None
        while tb is not None:
            found = self._owner(tb.tb_frame) or found
            tb = tb.tb_next
        return found


_importing: ContextVar[PluginRef | None] = ContextVar("pluginhost_importing", default=None)
_dispatching: ContextVar[HookOwners | None] = ContextVar("pluginhost_dispatching", default=None)


def current_plugin() -> PluginRef | None:
    """The plugin whose code is running, or ``None`` outside plugin code."""
    importing = _importing.get()
    if importing is not None:
        return importing
    owners = _dispatching.get()
    return owners.in_stack(sys._getframe(1)) if owners is not None else None


def importing_plugin() -> PluginRef | None:
    """The plugin being imported (or whose ``register()`` runs), if any: ``acting_as``'s plugin."""
    return _importing.get()


@contextmanager
def acting_as(plugin: PluginRef | None) -> Iterator[None]:
    """Attribute everything done inside the block (a plugin's import) to ``plugin``."""
    token = _importing.set(plugin)
    try:
        yield
    finally:
        _importing.reset(token)


def start_dispatch(owners: HookOwners) -> Token[HookOwners | None]:
    """From now on, hook implementations registered in ``owners`` are attributed to their plugins.

    A pair of calls rather than a context manager: this runs on every hook call.
    """
    return _dispatching.set(owners)


def end_dispatch(token: Token[HookOwners | None]) -> None:
    """Undo the ``start_dispatch`` that returned ``token``."""
    _dispatching.reset(token)
