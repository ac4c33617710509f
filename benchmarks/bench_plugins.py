"""Plugin overhead: listing commands with 20 installed plugins, and hook dispatch.

* ``pluginhost plugins`` and ``pluginhost models`` with 20 installed plugin
  distributions (dist-info metadata on ``sys.path``, as pip leaves them): wall
  time of the whole command (target <= 0.3 s) and whether torch was imported
  (it must not be).
* Hook dispatch: ``modify_config`` with 20 plugins through the host (which
  attributes each call to its plugin) against the same 20 plugins in a bare
  pluggy ``PluginManager`` (target: within 10%).

    python benchmarks/bench_plugins.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

from common import machine

PLUGIN = """
from pluginhost import hookimpl

@hookimpl
def register_models(registry):
    registry.register_model("Bench{n}ForCausalLM", "bench_plugin_{n}.model:Model")

@hookimpl
def modify_config(config):
    config.seed
"""


def install_plugins(site: Path, count: int) -> None:
    for n in range(count):
        (site / f"bench_plugin_{n}.py").write_text(PLUGIN.replace("{n}", str(n)))
        info = site / f"bench_plugin_{n}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: bench-plugin-{n}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[pluginhost.plugins]\nbench_{n} = bench_plugin_{n}\n")


def time_command(site: Path, command: str, runs: int) -> tuple[float, bool, int]:
    """Median wall time of ``pluginhost COMMAND`` (a fresh interpreter each run), torch imported?, plugins seen."""
    script = (
        f"import sys; from pluginhost.cli import main; code = main([{command!r}, '--json']);"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr); raise SystemExit(code)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    times, torch_imported, listed = [], False, 0
    for _ in range(runs):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
        times.append(time.perf_counter() - start)
        torch_imported |= "TORCH True" in out.stderr
        rows = json.loads(out.stdout)
        listed = sum(1 for row in rows if (row.get("name") or row.get("architecture", "")).lower().startswith("bench"))
    return statistics.median(times), torch_imported, listed


def dispatch(count: int, runs: int) -> tuple[float, float]:
    """Seconds per ``modify_config`` call: through the host, and through bare pluggy."""
    import pluggy

    import hookspecs
    from pluginhost import EngineConfig, hookimpl
    from pluginhost.host import PluginHost

    def make(n: int) -> object:
        class Plugin:
            @hookimpl
            def modify_config(self, config):
                config.seed  # noqa: B018 - the lightest real work: read a field (hooks return nothing)

        Plugin.__name__ = f"plugin_{n}"
        return Plugin()

    plugins = [make(n) for n in range(count)]
    host = PluginHost(plugins=plugins, load_installed=False)
    host.load()
    bare = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    bare.add_hookspecs(hookspecs)
    for n, plugin in enumerate(plugins):
        bare.register(plugin, name=f"plugin_{n}")
    config = EngineConfig(model="m")
    number = 20000
    host_times, bare_times = [], []
    for _ in range(runs):
        host_times.append(timeit.timeit(lambda: host.call("modify_config", config=config), number=number) / number)
        bare_times.append(timeit.timeit(lambda: bare.hook.modify_config(config=config), number=number) / number)
    return statistics.median(host_times), statistics.median(bare_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--plugins", type=int, default=20)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        install_plugins(site, args.plugins)
        for command in ("plugins", "models"):
            seconds, torch_imported, listed = time_command(site, command, args.runs)
            print(
                f"pluginhost {command:<8} with {args.plugins} installed plugins: {seconds:.3f} s (target <= 0.3 s), "
                f"{listed} listed, torch imported: {'yes' if torch_imported else 'no'}"
            )
    host, bare = dispatch(args.plugins, args.runs)
    print(
        f"modify_config with {args.plugins} plugins: host {host * 1e6:.1f} us/call, "
        f"bare pluggy {bare * 1e6:.1f} us/call, host/pluggy {host / bare:.2f}x (target <= 1.10x)"
    )


if __name__ == "__main__":
    main()
