"""Finding installed plugins: entry points of the ``pluginhost.plugins`` group.

Discovery reads package metadata only; nothing is imported here.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

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
    file: str | None = None,
) -> InstalledPlugin | None:
    """The installed plugin whose code ``module`` (loaded from ``file``) is, if any.

    Metadata only: nothing is imported. A target owns the module it names and the modules
    below it: ``pkg`` owns ``pkg`` and ``pkg.models``, ``pkg.extra`` owns neither ``pkg`` nor
    ``pkg.models``. Of several owners the deepest target wins, so one distribution with entry
    points ``pkg`` and ``pkg.extra`` credits ``pkg``'s own code to the first, whichever of them
    imported it. A module that no target owns but that sits in a plugin's top-level package
    (``pkg.models`` beside a single entry point ``pkg.plugin``) is that plugin's, unless ``file`` is
    known and its distribution, saying which files it installed, did not install it (a namespace
    package shared by distributions, a user's own module in it); of several such, ``prefer`` (a
    ``(name, distribution)``: the plugin the host is running) when it is one of them, else the one
    sharing the longest dotted prefix with ``module``. Any other ``file`` a plugin's distribution
    installed (``acme_models`` beside the entry point's ``acme_plugin``) is that plugin's.
    """
    parts = module.split(".")
    owner: InstalledPlugin | None = None
    neighbour: InstalledPlugin | None = None
    owner_depth = neighbour_depth = 0
    path = _resolved(file)
    for plugin in discover_installed() if installed is None else installed:
        target = _module_of(plugin).split(".")
        if parts[: len(target)] == target:
            if len(target) > owner_depth:
                owner, owner_depth = plugin, len(target)
            continue
        if target[0] != parts[0] or (path is not None and _installed(plugin, path, module) is False):
            continue
        if prefer is not None and (plugin.name, plugin.distribution) == prefer:
            neighbour, neighbour_depth = plugin, len(parts) + 1  # nothing beats the plugin being run
            continue
        common = next(
            (i for i, (a, b) in enumerate(zip(parts, target, strict=False)) if a != b), min(len(parts), len(target))
        )
        if common > neighbour_depth:
            neighbour, neighbour_depth = plugin, common
    if owner or neighbour or path is None:
        return owner or neighbour
    return _owner_by_distribution(path, module, installed, prefer)


def _resolved(file: str | None) -> Path | None:
    if file is None:
        return None
    try:
        return Path(file).resolve()
    except (OSError, ValueError):
        return None


def _owner_by_distribution(
    path: Path, module: str, installed: list[InstalledPlugin] | None, prefer: tuple[str, str | None] | None
) -> InstalledPlugin | None:
    """The plugin of the installed distribution that installed ``path``, when no entry point's package holds it.

    By the file, not the module's name: a user's own ``tests.my_models`` is not the code of a plugin whose
    distribution ships a package ``tests`` too, and a namespace package is split by what each ships. Of a
    distribution's several plugins: ``prefer`` when it is one of them, else the first by name.
    """
    plugins = discover_installed() if installed is None else installed
    for plugin in plugins:  # sorted by name
        if plugin.distribution is None or not _installed(plugin, path, module):
            continue
        if prefer is not None and prefer[1] == plugin.distribution:
            return next((p for p in plugins if (p.name, p.distribution) == prefer), plugin)
        return plugin
    return None


#: (distribution, version, location) -> the files it installed and the project folders of an editable install.
_FILES: dict[tuple[str, str | None, str], tuple[frozenset[Path], tuple[Path, ...]]] = {}


def _installed(plugin: InstalledPlugin, path: Path, module: str) -> bool | None:
    """Whether ``plugin``'s distribution installed ``path`` (module ``module``); None when it does not say which
    files it installed.

    Listed in its RECORD, or a module of the project folder of an editable install (which every build backend
    records in ``direct_url.json``; their RECORDs differ): one whose top-level package or module sits at the
    project's root or in its ``src`` folder. Not a script run from there (``__main__``), nor a module imported
    from another of its folders (``examples``, ``scripts``): a user's experiments are the user's. Of another
    folder of the project, the packages may be the plugin's (``package_dir={"": "lib"}``): None, unknown, so
    that a module beside the plugin's entry point is still its plugin's by name.
    """
    dist = plugin.entry_point.dist
    if dist is None:
        return None
    try:
        location = str(dist.locate_file(""))
    except NotImplementedError:  # a distribution not on the file system
        return None
    key = (plugin.distribution or "", plugin.version, location)  # a reinstalled distribution is read again
    found = _FILES.get(key)
    if found is None:
        found = _FILES[key] = _files_of(dist)
    files, projects = found
    if path in files or any(_in_project(path, module, project) for project in projects):
        return True
    if not files and not projects or any(path.is_relative_to(project) for project in projects):
        return None  # no list of files, or an editable project's other folder (``lib/``, a package_dir): unknown
    return False


def _in_project(path: Path, module: str, project: Path) -> bool:
    top = module.partition(".")[0]
    for root in (project, project / "src"):
        if path.is_relative_to(root) and path != root:
            first = path.relative_to(root).parts[0]
            if top in (first, inspect.getmodulename(first)):
                return True
    return False


def _files_of(dist: metadata.Distribution) -> tuple[frozenset[Path], tuple[Path, ...]]:
    files = set()
    for file in dist.files or ():
        if inspect.getmodulename(file.name) is not None:
            try:
                files.add(Path(str(dist.locate_file(file))).resolve())
            except (OSError, ValueError):
                continue
    projects: tuple[Path, ...] = ()
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        direct = {}
    url = direct.get("url") if isinstance(direct, dict) else None
    if isinstance(url, str) and url.startswith("file://") and (direct.get("dir_info") or {}).get("editable"):
        from urllib.request import url2pathname  # here: it imports http.client, which listing plugins needs not

        projects = (Path(url2pathname(urlparse(url).path)).resolve(),)
    return frozenset(files), projects
