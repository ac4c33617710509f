"""Lets the sample plugins' own tests run from a checkout, without installing them.

Each plugin's modules, in its ``src/`` (or, for a flat layout like vLLM's, its
own folder), become importable; the tests pass the plugin module to
pluginhost's ``make_engine``/``make_host`` fixtures, which need no entry point.
(Installed, the same tests run against the installed copy.)

The folders are not put on ``sys.path``: ``pip install ./sample_plugins/NAME``
leaves ``NAME.egg-info`` metadata in them, and on ``sys.path`` that would make
every sample plugin look installed to ``importlib.metadata``, and so to the
tests of pluginhost itself that run in the same session. A finder placed after
the standard ones imports the modules alone.
"""

import importlib.machinery
import sys
from pathlib import Path


def _modules(folder: Path) -> dict[str, str]:
    """Top-level module name -> the folder it is in, for the packages and modules of ``folder``."""
    found = {}
    for entry in folder.iterdir():
        if entry.is_dir() and (entry / "__init__.py").is_file():
            found[entry.name] = str(folder)
        elif entry.suffix == ".py" and entry.stem != "setup":
            found[entry.stem] = str(folder)
    return found


class _SampleFinder:
    """Finds the sample plugins' top-level modules in their folders (and nothing else)."""

    def __init__(self, modules: dict[str, str]) -> None:
        self.modules = modules

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's finder protocol
        folder = self.modules.get(name)
        return importlib.machinery.PathFinder.find_spec(name, [folder]) if folder and path is None else None


_MODULES = {}
for plugin in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
    _MODULES.update(_modules(plugin / "src" if (plugin / "src").is_dir() else plugin))
if not any(isinstance(finder, _SampleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_SampleFinder(_MODULES))
