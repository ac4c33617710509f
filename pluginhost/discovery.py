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


def owner_of_module(module: str, installed: list[InstalledPlugin] | None = None) -> InstalledPlugin | None:
    """The installed plugin whose package holds ``module`` (by its entry point's target), if any.

    Metadata only: nothing is imported. When several plugins share a package
    prefix (namespace packages), the one whose target shares the longest
    dotted prefix with ``module`` wins.
    """
    parts = module.split(".")
    best, best_len = None, 0
    for plugin in discover_installed() if installed is None else installed:
        target = _module_of(plugin).split(".")
        common = 0
        for a, b in zip(parts, target, strict=False):
            if a != b:
                break
            common += 1
        if common > best_len:
            best, best_len = plugin, common
    return best
