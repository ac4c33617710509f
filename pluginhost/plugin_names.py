"""In-process plugins by name: how another process (a tensor-parallel rank) imports the very plugin objects.

Each process of a tensor-parallel engine loads its plugins itself. An installed plugin is found again through
its entry point; an in-process one (``LLM(plugins=[...])``) must be importable by name, a module or a top-level
object of a module or script, and ``importable_name`` says so in the engine's words when it is not: made inside
a function, made under the script's ``if __name__ == "__main__":`` block (which a spawned rank does not run), or
a module loaded from a file by path (which no other process finds by name).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types
from pathlib import Path

from pluginhost.attribution import is_main_guard, process_independent_name
from pluginhost.errors import ConfigError

__all__ = ["bound_only_when_run", "import_by_name", "importable_name", "in_process_name", "type_name"]


def importable_name(index: int, plugin: object) -> str:
    """``"module"`` or ``"module:qualified.name"`` that imports to ``plugin`` in another process."""
    main = sys.modules.get("__main__")
    main_is_a_file = getattr(main, "__file__", None) is not None  # spawned processes import the script again
    name: str | None = None
    if isinstance(plugin, types.ModuleType):
        name = plugin.__name__
    elif getattr(plugin, "__qualname__", None) and getattr(plugin, "__module__", None):
        if "<locals>" not in plugin.__qualname__:
            name = f"{plugin.__module__}:{plugin.__qualname__}"
    else:  # an instance: a module-level name bound to it, the script's last (it may only have imported it)
        modules = sorted(sys.modules.items(), key=lambda item: item[0] == "__main__")
        for module_name, module in modules:
            found = next((attr for attr, value in list(vars(module).items()) if value is plugin), None)
            if found is not None and module_name != "__mp_main__":
                name = f"{module_name}:{found}"
                break
    if name is not None and (not name.startswith("__main__") or main_is_a_file):
        attr = name.partition(":")[2].partition(".")[0]
        if name.startswith("__main__:") and attr in bound_only_when_run(main.__file__):  # type: ignore[union-attr]
            raise ConfigError(
                f"plugins[{index}] ({in_process_name(plugin)}) is made inside the script's `if __name__ == "
                '"__main__":` block, which the other processes of a tensor-parallel engine do not run when they '
                f"import the script to load it: define {attr!r} above that block, at the top level."
            )
        module_name = name.partition(":")[0]
        unfound = None if module_name == "__main__" else _not_found_by_name(module_name)
        if unfound is not None:
            raise ConfigError(
                f"plugins[{index}] ({in_process_name(plugin)}) cannot be loaded by the other processes of a "
                "tensor-parallel engine: each process loads its plugins itself, so an in-process plugin must be "
                f"importable by name, and {unfound}. Put its module on sys.path (PYTHONPATH), or install it as a "
                "plugin."
            )
        try:
            if import_by_name(name) is plugin:
                return name
        except Exception:  # noqa: BLE001, S110 - not importable: said below
            pass
    raise ConfigError(
        f"plugins[{index}] ({in_process_name(plugin)}) cannot be loaded by the other processes of a tensor-parallel "
        "engine: each process loads its plugins itself, so an in-process plugin must be importable by name (a "
        "module, or a class, function or object defined at the top level of a module or script, not inside a "
        "function). Move it to the top level of a module, or install it as a plugin."
    )


def bound_only_when_run(script: str) -> set[str]:
    """Names the script binds only in an ``if __name__ == "__main__":`` block (empty if it cannot be read)."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return set()

    def bound(statements: list[ast.stmt], skip_guard: bool) -> set[str]:
        names: set[str] = set()
        for node in statements:
            if skip_guard and is_main_guard(node):
                names |= bound(node.orelse, skip_guard)  # type: ignore[attr-defined]
                continue
            for child in ast.walk(node):
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    names.add(child.id)
                elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(child.name)
                elif isinstance(child, ast.Import | ast.ImportFrom):
                    names |= {(a.asname or a.name).partition(".")[0] for a in child.names}
        return names

    return bound(tree.body, skip_guard=False) - bound(tree.body, skip_guard=True)


def _not_found_by_name(module_name: str) -> str | None:
    """Why another process importing ``module_name`` would not get the module this one has; ``None`` if it would.

    ``sys.modules`` is not asked: a module loaded from a file by path (``importlib.util.spec_from_file_location``)
    and put there imports by name here, and in no other process. The import system's finders
    (``sys.meta_path``, over ``sys.path``; a spawned process gets this one's ``sys.path``) must find the same file.
    """
    module = sys.modules.get(module_name)
    if module is None:
        return None  # not imported yet: importing it by name tells
    parent = module_name.rpartition(".")[0]
    if parent:
        why = _not_found_by_name(parent)
        if why is not None:
            return why
    path = getattr(sys.modules.get(parent), "__path__", None) if parent else None
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            found = find_spec(module_name, path, None)
        except Exception:  # noqa: BLE001, S112 - a third-party finder may raise anything: ask the next one
            continue
        if found is not None:
            if spec is not None and found.origin == spec.origin:
                return None
            return f"importing {module_name!r} by name finds {found.origin or 'another module'}, not {origin}"
    where = f" (loaded from {origin} by path)" if origin else ""
    return f"module {module_name!r}{where} is not found by name on sys.path"


def type_name(plugin: object) -> str:
    """The plugin's type, named alike in every process (the script is ``__mp_main__`` where a rank imports it)."""
    return f"{process_independent_name(type(plugin).__module__)}.{type(plugin).__qualname__}"


def import_by_name(name: str) -> object:
    module_name, _, attrs = name.partition(":")
    target: object = importlib.import_module(module_name)
    for attr in filter(None, attrs.split(".")):
        target = getattr(target, attr)
    return target


def in_process_name(plugin: object) -> str:
    """A module's name, ``module:function`` for a function, else the object's class name.

    The same on every tensor-parallel rank: the script is ``__main__`` there too (``process_independent_name``).
    """
    if inspect.isroutine(plugin):
        qualname = getattr(plugin, "__qualname__", None) or repr(plugin)
        return f"{process_independent_name(getattr(plugin, '__module__', None) or '?')}:{qualname}"
    name = getattr(plugin, "__name__", None)
    if inspect.ismodule(plugin) and name:
        return process_independent_name(name)
    return name or type(plugin).__name__
