"""Lets the sample plugins' own tests run from a checkout, without installing them.

Each plugin's ``src/`` goes on ``sys.path``; the tests pass the plugin module
to pluginhost's ``make_engine``/``make_host`` fixtures, which need no entry
point. (Installed, the same tests run against the installed copy.)
"""

import sys
from pathlib import Path

for src in sorted(Path(__file__).parent.glob("*/src")):
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
