"""``python -m pluginhost``: the same as the ``pluginhost`` command."""

from pluginhost.cli import run

run()
