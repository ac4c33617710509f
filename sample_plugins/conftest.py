"""Lets the sample plugins' own tests run from a checkout, without installing them.

Each plugin's ``src/`` (or, for a flat layout like vLLM's, its own folder)
goes on ``sys.path``; the tests pass the plugin module to pluginhost's
``make_engine``/``make_host`` fixtures, which need no entry point.
(Installed, the same tests run against the installed copy.)
"""

import sys
from pathlib import Path

for plugin in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
    src = plugin / "src" if (plugin / "src").is_dir() else plugin
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
