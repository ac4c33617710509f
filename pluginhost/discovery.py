"""Finding installed plugins: entry points of the ``pluginhost.plugins`` group.

Discovery reads package metadata only; nothing is imported here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib import metadata
from pathlib import PurePosixPath

from hookspecs import ENTRY_POINT_GROUP

__all__ = ["InstalledPlugin", "discover_installed", "owner_of_module"]


@dataclass(frozen=True)
class InstalledPlugin:
    """An entry point in the ``pluginhost.plugins`` group."""

    #: The entry-point name, which is the plugin's name.
    name: str
    #: What it points to: ``"package.module"`` or ``"package.module:attribute"``.
    value: str
    distribution: str | None
    version: str | None
    entry_point: metadata.EntryPoint


def discover_installed() -> list[InstalledPlugin]:
    """Installed plugins sorted by name (then distribution), duplicates removed.

    The same distribution can appear twice when it is on ``sys.path`` twice;
    such copies are listed once. Two different distributions declaring the same
    entry-point name both stay in the list: the host reports the conflict.
    """
    found: dict[tuple[str, str, str | None], InstalledPlugin] = {}
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = entry_point.dist
        distribution = dist.metadata["Name"] if dist is not None else None
        version = dist.version if dist is not None else None
        key = (entry_point.name, entry_point.value, distribution)
        found.setdefault(
            key,
            InstalledPlugin(entry_point.name, entry_point.value, distribution, version, entry_point),
        )
    # Alphabetical as people read it ("alpha" before "Zed"), then exactly, so the order is always the same.
    return sorted(found.values(), key=lambda p: (p.name.casefold(), p.name, p.distribution or ""))


def _module_of(plugin: InstalledPlugin) -> str:
    return plugin.value.partition(":")[0].strip()


def owner_of_module(
    module: str,
    installed: list[InstalledPlugin] | None = None,
    *,
    prefer: tuple[str, str | None] | None = None,
) -> InstalledPlugin | None:
    """The installed plugin whose code ``module`` is (by its entry point's target), if any.

    Metadata only: nothing is imported. A target owns the module it names and the modules
    below it: ``pkg`` owns ``pkg`` and ``pkg.models``, ``pkg.extra`` owns neither ``pkg`` nor
    ``pkg.models``. Of several owners the deepest target wins, so one distribution with entry
    points ``pkg`` and ``pkg.extra`` credits ``pkg``'s own code to the first, whichever of them
    imported it. A module that no target owns but that sits in a plugin's top-level package
    (``pkg.models`` beside a single entry point ``pkg.plugin``) is that plugin's; of several such,
    ``prefer`` (a ``(name, distribution)``: the plugin the host is running) when it is one of them,
    else the one sharing the longest dotted prefix with ``module``, then by name.
    """
    parts = module.split(".")
    owner: InstalledPlugin | None = None
    neighbour: InstalledPlugin | None = None
    owner_depth = neighbour_depth = 0
    for plugin in discover_installed() if installed is None else installed:
        target = _module_of(plugin).split(".")
        if parts[: len(target)] == target:
            if len(target) > owner_depth:
                owner, owner_depth = plugin, len(target)
            continue
        if target[0] != parts[0]:
            continue
        if prefer is not None and (plugin.name, plugin.distribution) == prefer:
            neighbour, neighbour_depth = plugin, len(parts) + 1  # nothing beats the plugin being run
            continue
        common = next(
            (i for i, (a, b) in enumerate(zip(parts, target, strict=False)) if a != b), min(len(parts), len(target))
        )
        if common > neighbour_depth:
            neighbour, neighbour_depth = plugin, common
    return owner or neighbour or _owner_by_distribution(module, installed, prefer)


def _owner_by_distribution(
    module: str, installed: list[InstalledPlugin] | None, prefer: tuple[str, str | None] | None
) -> InstalledPlugin | None:
    """The plugin of the installed distribution that ships ``module``, when no entry point's package holds it.

    A distribution's code is its plugins' wherever it lives (``acme_models`` beside the entry point's
    ``acme_plugin``). Of a distribution's several plugins: ``prefer`` when it is one of them, else the
    first by name.
    """
    plugins = discover_installed() if installed is None else installed
    for plugin in plugins:  # sorted by name
        if plugin.distribution is None or not _ships(plugin, module):
            continue
        if prefer is not None and prefer[1] == plugin.distribution:
            return next((p for p in plugins if (p.name, p.distribution) == prefer), plugin)
        return plugin
    return None


#: (distribution, version, location) -> the dotted names of its modules (``_modules_of``).
_MODULES: dict[tuple[str, str | None, str], frozenset[str]] = {}


def _ships(plugin: InstalledPlugin, module: str) -> bool:
    """Whether ``module`` (or a package it is in) is one of the modules of ``plugin``'s distribution."""
    dist = plugin.entry_point.dist
    if dist is None:
        return False
    try:
        location = str(dist.locate_file(""))
    except NotImplementedError:  # a distribution not on the file system
        location = repr(dist)
    key = (plugin.distribution or "", plugin.version, location)  # a reinstalled distribution is read again
    shipped = _MODULES.get(key)
    if shipped is None:
        shipped = _MODULES[key] = _modules_of(dist)
    parts = module.split(".")
    return any(".".join(parts[:i]) in shipped for i in range(len(parts), 0, -1))


def _modules_of(dist: metadata.Distribution) -> frozenset[str]:
    """The dotted names of the modules a distribution installed, from its metadata.

    From its file list (RECORD), so that a namespace package (``ns.a`` from one distribution, ``ns.b``
    from another) is split by the modules each ships; ``top_level.txt`` names the packages an editable
    install keeps elsewhere (its RECORD lists no module under them).
    """
    modules: set[str] = set()
    for file in dist.files or ():
        path = PurePosixPath(str(file))
        stem = inspect.getmodulename(path.name)
        if stem is None or ".." in path.parts:
            continue
        dotted = [*path.parts[:-1], *([] if stem == "__init__" else [stem])]
        if dotted and all(part.isidentifier() for part in dotted):
            modules.add(".".join(dotted))
    top_level = (dist.read_text("top_level.txt") or "").split()
    modules.update(n for n in top_level if n.isidentifier() and not any(m.startswith(f"{n}.") for m in modules))
    return frozenset(modules)
