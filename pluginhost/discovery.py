"""Finding installed plugins: entry points of the ``pluginhost.plugins`` group.

Discovery reads package metadata only; nothing is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

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
    return owner or neighbour
