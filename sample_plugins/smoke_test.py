"""What a plugin author's CI does: a fresh virtual environment, pluginhost and the
``mock_opt`` sample plugin installed from this working tree (as wheels, not
editable), then ``pluginhost plugins``, ``models`` and ``generate``, checked.

    python sample_plugins/smoke_test.py [--workdir DIR] [--full-install]

By default the new environment gets pluginhost and the plugin only, and sees
their dependencies (torch, transformers, ...) from the environment running
this script through a ``.pth`` file: offline, and seconds instead of minutes.
Plugins installed there are visible too, so the checks select the plugin
under test (``PLUGINHOST_PLUGINS=mock_opt``); ``--full-install`` needs no
selection.
``--full-install`` installs everything from the package index instead, the way
a fresh CI machine would (``torch==2.13.0``, the CPU build, is pinned).

Exits 0 when every check passes, 1 otherwise, printing each check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "sample_plugins" / "mock_opt"


def copy_sources(workdir: Path) -> tuple[Path, Path]:
    """Copies of pluginhost's and the plugin's sources: building writes next to them, not into the checkout."""
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*")
    host = workdir / "src" / "pluginhost"
    for name in ("pyproject.toml", "README.md"):
        host.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, host / name)
    for package in ("hookspecs", "pluginhost", "builtin_models"):
        shutil.copytree(ROOT / package, host / package, ignore=ignore, dirs_exist_ok=True)
    plugin = workdir / "src" / PLUGIN.name
    shutil.copytree(PLUGIN, plugin, ignore=ignore, dirs_exist_ok=True)
    return host, plugin


def make_env(workdir: Path, full_install: bool) -> Path:
    """Create the environment and install pluginhost and the plugin; return its bin directory."""
    host_src, plugin_src = copy_sources(workdir)
    env_dir = workdir / "venv"
    venv.EnvBuilder(with_pip=full_install, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    if full_install:
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, str(host_src), str(plugin_src)], check=True)
    else:
        purelib = Path(sysconfig.get_paths(vars={"base": env_dir, "platbase": env_dir})["purelib"])
        shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        (purelib / "_pluginhost_smoke_deps.pth").write_text("\n".join(sorted(shared)) + "\n")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                str(host_src),
                str(plugin_src),
            ],
            check=True,
        )
    return env_dir / "bin"


def pluginhost(bin_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "pluginhost"), *args], capture_output=True, text=True, env=env, timeout=600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where to create the environment (default: a temporary folder)")
    parser.add_argument("--full-install", action="store_true", help="install all dependencies from the index")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pluginhost-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)

    bin_dir = make_env(workdir, args.full_install)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLUGINHOST_") and k != "PYTHONPATH"}
    if not args.full_install:  # the shared packages may hold other plugins: select the one under test
        env["PLUGINHOST_PLUGINS"] = "mock_opt"
    failures = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""))

    listed = pluginhost(bin_dir, env, "plugins", "--json")
    check("pluginhost plugins exits 0", listed.returncode == 0, listed.stderr)
    plugins = {p["name"]: p for p in json.loads(listed.stdout or "[]")}
    mock = plugins.get("mock_opt", {})
    check(
        "mock_opt is loaded from its distribution",
        (mock.get("status"), mock.get("distribution"), mock.get("version"))
        == ("loaded", "pluginhost-mock-opt", "0.1.0"),
        json.dumps(mock),
    )
    check("it implements register_models", mock.get("hooks") == ["register_models"], json.dumps(mock))

    models_run = pluginhost(bin_dir, env, "models", "--json")
    check("pluginhost models exits 0", models_run.returncode == 0, models_run.stderr)
    models = {m["architecture"]: m for m in json.loads(models_run.stdout or "[]")}
    check(
        "MockOPTForCausalLM is registered by mock_opt",
        models.get("MockOPTForCausalLM", {}).get("registered_by") == "mock_opt",
        json.dumps(models),
    )
    opt = models.get("OPTForCausalLM", {})
    check("the builtin OPT is still there", opt.get("registered_by") == "builtin_models", json.dumps(opt))

    generated = pluginhost(
        bin_dir,
        env,
        "generate",
        "--prompt",
        "Hello",
        "--prompt",
        "plugins",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--model-architecture-override",
        "MockOPTForCausalLM",
        "--json",
    )
    check("pluginhost generate exits 0", generated.returncode == 0, generated.stderr)
    rows = json.loads(generated.stdout or "[]")
    check(
        "the mock predicts token 7 for every prompt",
        [r.get("token_ids") for r in rows] == [[7, 7, 7, 7]] * 2,
        json.dumps(rows),
    )
    demo = pluginhost(
        bin_dir, env, "generate", "--no-plugins", "--prompt", "A plugin is", "--max-tokens", "8", "--json"
    )
    check("generate on the shipped demo model exits 0", demo.returncode == 0, demo.stderr)
    text = (json.loads(demo.stdout or "[{}]")[0].get("text") or "").strip()
    check("the installed package carries the trained demo model: it writes words", len(text.split()) >= 3, text)
    disabled = pluginhost(bin_dir, env, "models", "--json", "--disable-plugin", "pluginhost-mock-opt")
    check(
        "--disable-plugin by distribution name removes it",
        "MockOPTForCausalLM" not in {m["architecture"] for m in json.loads(disabled.stdout or "[]")},
    )
    print(f"{'passed' if not failures else f'{failures} check(s) failed'} (environment: {workdir / 'venv'})")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
