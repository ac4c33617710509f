"""Plugin loading: discovery, selection, validation, failure policy, call order, isolation."""

from __future__ import annotations

import logging
import os
import re

import pytest

from pluginhost import LLM, EngineConfig, ModelRegistry, hookimpl
from pluginhost.errors import (
    ConfigError,
    PluginError,
    PluginHookError,
    PluginLoadError,
    PluginSelectionError,
    UnknownArchitectureError,
)
from pluginhost.host import PluginHost
from pluginhost.registry import BUILTIN_PLUGIN
from pluginhost.selection import PluginSelection

RECORDING_PLUGIN = """
from pluginhost import hookimpl
CALLS = []

@hookimpl
def modify_config(config):
    CALLS.append(__name__)
    config.seed = config.seed * 10 + {digit}
"""


def statuses(host: PluginHost) -> dict[str, str]:
    return {r.name: r.status for r in host.records}


def test_builtin_is_always_loaded_first():
    host = PluginHost(load_installed=False)
    records = host.load()
    assert [(r.name, r.status, r.kind) for r in records] == [("builtin_models", "builtin", "builtin")]
    assert records[0].hooks == ("register_models",)


def test_installed_plugin_is_discovered_with_its_distribution(install_plugin):
    install_plugin("alpha", RECORDING_PLUGIN.format(digit=1), dist="alpha-dist", version="2.3")
    record = {r.name: r for r in PluginHost().load()}["alpha"]
    assert (record.status, record.kind, record.distribution, record.version) == (
        "loaded",
        "installed",
        "alpha-dist",
        "2.3",
    )
    assert record.hooks == ("modify_config",)
    assert record.import_seconds is not None and record.import_seconds >= 0
    assert record.target == "alpha"


def test_hooks_run_builtin_then_installed_by_name_then_in_process_in_order(install_plugin):
    # Installed in non-alphabetical order on purpose: the order must not depend on it.
    install_plugin("zeta", RECORDING_PLUGIN.format(digit=3))
    install_plugin("alpha", RECORDING_PLUGIN.format(digit=1))
    install_plugin("mid", RECORDING_PLUGIN.format(digit=2))

    class InProcess:
        def __init__(self, digit):
            self.digit = digit

        @hookimpl
        def modify_config(self, config):
            config.seed = config.seed * 10 + self.digit

    host = PluginHost(plugins=[InProcess(4), InProcess(5)])
    config = EngineConfig(model="m", seed=0)
    host.call("modify_config", config=config)
    assert config.seed == 12345  # alpha, mid, zeta, then in-process in the given order
    assert [r.name for r in host.records] == ["builtin_models", "alpha", "mid", "zeta", "InProcess", "InProcess#2"]
    assert config.provenance["seed"] == "plugin:InProcess#2"


def test_loading_is_idempotent(install_plugin):
    install_plugin("alpha", RECORDING_PLUGIN.format(digit=1))
    host = PluginHost()
    first = host.load()
    assert host.load() == first
    config = EngineConfig(model="m")
    host.call("modify_config", config=config)
    assert config.seed == 1  # registered once, called once


def test_an_installed_plugin_also_passed_in_process_loads_once(install_plugin):
    """``LLM(path, plugins=[the_installed_module])``: the same object, registered (or run) once, not a clash."""
    import importlib

    install_plugin("alpha", RECORDING_PLUGIN.format(digit=1))
    install_plugin("beta", "CALLS = []\ndef register():\n    CALLS.append(1)\n", target="beta:register")
    alpha, beta = importlib.import_module("alpha"), importlib.import_module("beta")
    host = PluginHost(plugins=[alpha, beta.register])
    host.load()
    assert statuses(host) == {"builtin_models": "builtin", "alpha": "loaded", "beta": "loaded"}
    config = EngineConfig(model="m")
    host.call("modify_config", config=config)
    assert config.seed == 1 and beta.CALLS == [1]  # each called once
    # Not installed-and-selected: the same module passed in-process is an in-process plugin.
    alone = PluginHost(plugins=[alpha], load_installed=False)
    alone.load()
    assert statuses(alone) == {"builtin_models": "builtin", "alpha": "loaded"}
    assert alone.records[-1].kind == "in-process"


COUNTED_REGISTER = """
from pluginhost import ModelRegistry
CALLS = []

def register():
    CALLS.append(1)
    ModelRegistry.register_model("CountedArch", "counted_impl:Model")
"""


def test_a_register_function_is_called_once_per_process_and_its_registrations_replayed(install_plugin, monkeypatch):
    """vLLM calls a general plugin once per process: a second call would patch what the first patched again."""
    import importlib

    install_plugin("counted", COUNTED_REGISTER, target="counted:register")
    for _ in range(3):
        host = PluginHost()
        assert "CountedArch" in host.collect_models()
        assert next(r for r in host.records if r.name == "counted").hooks == ("register",)
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "counted")
    assert "CountedArch" not in PluginHost().collect_models()  # recorded with the plugin: not applied without it
    monkeypatch.delenv("PLUGINHOST_DISABLED_PLUGINS")
    in_process = PluginHost(plugins=[importlib.import_module("counted").register], load_installed=False)
    assert "CountedArch" in in_process.collect_models()  # the same function, passed in-process: replayed too
    assert importlib.import_module("counted").CALLS == [1]


def test_an_in_process_register_function_is_called_once_for_every_engine_passing_it():
    calls = []

    def register():
        calls.append(1)
        ModelRegistry.register_model("PassedArch", "passed_impl:Model")

    for _ in range(2):
        assert "PassedArch" in PluginHost(plugins=[register], load_installed=False).collect_models()
    assert calls == [1]
    assert "PassedArch" not in PluginHost(load_installed=False).collect_models()  # only where it is passed


def test_a_register_function_that_failed_is_called_again_until_it_succeeds_then_never(install_plugin):
    import importlib

    install_plugin(
        "flaky",
        "CALLS = []\nLICENSED = [False]\ndef register():\n    CALLS.append(1)\n    if not LICENSED[0]:\n"
        "        raise OSError('no licence')\n",
        target="flaky:register",
    )
    first = {r.name: r for r in PluginHost().load(strict=False)}["flaky"]
    assert first.status == "failed" and "failed: OSError: no licence" in first.reason
    importlib.import_module("flaky").LICENSED[0] = True  # the cause fixed, as the message asks, without a restart
    later = [{r.name: r for r in PluginHost().load(strict=False)}["flaky"] for _ in range(2)]
    assert [r.status for r in later] == ["loaded", "loaded"]
    assert importlib.import_module("flaky").CALLS == [1, 1]  # failed once, succeeded once: replayed after that


def test_an_installed_plugin_passed_in_process_and_broken_stops_the_engine_even_when_skipping(
    install_plugin, monkeypatch
):
    import importlib

    install_plugin("gamma", "from pluginhost import hookimpl\n@hookimpl\ndef no_such_hook(config):\n    pass\n")
    monkeypatch.setenv("PLUGINHOST_SKIP_BROKEN_PLUGINS", "1")
    with pytest.raises(PluginError, match="plugin 'gamma'.* is broken"):  # asked for by name: never skipped
        PluginHost(plugins=[importlib.import_module("gamma")]).load()


def test_two_engines_do_not_see_each_others_in_process_plugins():
    def plugin(arch):
        class P:
            @hookimpl
            def register_models(self, registry):
                registry.register_model(arch, f"{arch.lower()}_pkg:Model")

        return P()

    first = PluginHost(plugins=[plugin("First")], load_installed=False).collect_models()
    second = PluginHost(plugins=[plugin("Second")], load_installed=False).collect_models()
    assert "First" in first.get_supported_archs() and "Second" not in first.get_supported_archs()
    assert "Second" in second.get_supported_archs() and "First" not in second.get_supported_archs()


# -- selection ---------------------------------------------------------------------


@pytest.fixture
def three_plugins(install_plugin):
    install_plugin("alpha", RECORDING_PLUGIN.format(digit=1), dist="Alpha-Dist")
    install_plugin("beta", RECORDING_PLUGIN.format(digit=2), dist="beta-dist")
    install_plugin("gamma", RECORDING_PLUGIN.format(digit=3), dist="gamma-dist")


def test_env_allow_list_matches_entry_point_or_distribution_names(three_plugins, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_PLUGINS", " ALPHA_dist , gamma ")
    host = PluginHost()
    host.load()
    assert statuses(host) == {"builtin_models": "builtin", "alpha": "loaded", "beta": "blocked", "gamma": "loaded"}
    assert (
        "not in the allow-list (PLUGINHOST_PLUGINS=ALPHA_dist,gamma)"
        in {r.name: r for r in host.records}["beta"].reason
    )
    assert host.plugin_manager.is_blocked("beta")  # pluggy's own blocking


def test_empty_allow_list_loads_no_installed_plugin(three_plugins, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_PLUGINS", "")
    host = PluginHost()
    host.load()
    assert statuses(host) == {"builtin_models": "builtin", "alpha": "blocked", "beta": "blocked", "gamma": "blocked"}


def test_disabled_plugins_never_load(three_plugins, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "beta-dist")
    host = PluginHost()
    host.load()
    assert statuses(host)["beta"] == "blocked"
    assert {r.name: r for r in host.records}["beta"].reason == "disabled by PLUGINHOST_DISABLED_PLUGINS"


def test_cli_selection_takes_precedence_over_the_environment(three_plugins, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_PLUGINS", "alpha")
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "beta")
    selection = PluginSelection.from_env().with_cli(plugins="beta,gamma", disable=["gamma"])
    host = PluginHost(selection=selection)
    host.load()
    assert statuses(host) == {"builtin_models": "builtin", "alpha": "blocked", "beta": "loaded", "gamma": "blocked"}
    no_plugins = PluginHost(selection=PluginSelection.from_env().with_cli(no_plugins=True))
    no_plugins.load()
    assert {s for n, s in statuses(no_plugins).items() if n != "builtin_models"} == {"blocked"}


@pytest.mark.parametrize(("disabled", "chosen"), [("beta-dist", "beta"), ("beta", "beta-dist")])
def test_cli_choice_beats_an_environment_denial_by_the_other_kind_of_name(three_plugins, monkeypatch, disabled, chosen):
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", disabled)
    host = PluginHost(selection=PluginSelection.from_env().with_cli(plugins=chosen))
    host.load()
    assert statuses(host)["beta"] == "loaded"  # it stayed "disabled by PLUGINHOST_DISABLED_PLUGINS"


def test_installed_plugins_run_in_alphabetical_order_whatever_the_case(install_plugin):
    install_plugin("Zed", dist="zed-dist")
    install_plugin("alpha", dist="alpha-dist")
    assert [r.name for r in PluginHost().load(strict=False)][1:] == ["alpha", "Zed"]  # not code-point order


def test_a_skip_broken_switch_that_is_neither_on_nor_off_is_an_error(monkeypatch):
    monkeypatch.setenv("PLUGINHOST_SKIP_BROKEN_PLUGINS", "banana")
    with pytest.raises(ValueError, match=r"PLUGINHOST_SKIP_BROKEN_PLUGINS='banana' is neither on"):
        PluginHost().load()


def test_allow_list_naming_nothing_installed_lists_what_is(three_plugins, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_PLUGINS", "alpha,nope")
    with pytest.raises(PluginSelectionError) as info:
        PluginHost().load(strict=False)
    message = str(info.value)
    assert "'nope'" in message and "matches no installed plugin" in message
    assert "alpha (Alpha-Dist)" in message and "gamma (gamma-dist)" in message


def test_load_installed_false_skips_entry_points(three_plugins):
    host = PluginHost(load_installed=False)
    assert [r.name for r in host.load()] == ["builtin_models"]


# -- validation at load --------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (
            "@hookimpl\ndef registr_models(registry): pass\n",
            ["'registr_models', which is not a pluginhost hook", "did you mean 'register_models'"],
        ),
        (
            "@hookimpl\ndef pre_load(config, model_cls): pass\n",
            [
                "pre_load(config, model_cls)",
                "the spec is pre_load(config, model_class)",
                "unknown argument(s) model_cls",
            ],
        ),
        (
            "@hookimpl\ndef post_load(config, model=None): pass\n",
            ["gives parameter(s) model a default value", "post_load(config, model)"],
        ),
        (
            "@hookimpl(wrapper=True)\ndef modify_config(config):\n    return None\n",
            ["Declared as wrapper=True or hookwrapper=True but function is not a generator function"],
        ),
    ],
    ids=["unknown-hook", "wrong-argument", "default-value", "wrapper-not-generator"],
)
def test_plugins_that_do_not_match_the_specs_are_refused(install_plugin, code, expected):
    install_plugin("bad", "from pluginhost import hookimpl\n" + code, dist="bad-dist", version="0.7")
    with pytest.raises(PluginLoadError) as info:
        PluginHost().load()
    message = str(info.value)
    assert "plugin 'bad' (distribution bad-dist 0.7)" in message
    for fragment in expected:
        assert fragment in message
    assert "PLUGINHOST_DISABLED_PLUGINS=bad" in message and "PLUGINHOST_SKIP_BROKEN_PLUGINS=1" in message


def test_in_process_plugin_that_does_not_match_is_refused():
    class Wrong:
        @hookimpl
        def modify_config(self, cfg):
            pass

    with pytest.raises(PluginError, match=r"plugin 'Wrong'.*unknown argument\(s\) cfg.*LLM\(plugins=\.\.\.\)"):
        PluginHost(plugins=[Wrong()], load_installed=False).load()


# -- failure policy -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "cause"),
    [
        ("import not_a_real_module_xyz\n", "ModuleNotFoundError: No module named 'not_a_real_module_xyz'"),
        ("def broken(:\n", "SyntaxError: invalid syntax"),
        ("raise RuntimeError('no GPU license')\n", "RuntimeError: no GPU license"),
    ],
    ids=["import-error", "syntax-error", "raises"],
)
def test_plugin_failing_to_import_stops_the_engine(install_plugin, code, cause):
    install_plugin("broken", code, dist="broken-dist", version="3.1")
    with pytest.raises(PluginLoadError) as info:
        PluginHost().load()
    message = str(info.value)
    assert "plugin 'broken' (distribution broken-dist 3.1) is broken" in message
    assert cause in message
    assert "--disable-plugin broken" in message


def test_skip_broken_turns_the_failure_into_a_warning(install_plugin, monkeypatch, caplog):
    install_plugin("broken", "raise ImportError('missing dependency foo')\n")
    install_plugin("fine", RECORDING_PLUGIN.format(digit=7))
    monkeypatch.setenv("PLUGINHOST_SKIP_BROKEN_PLUGINS", "1")
    host = PluginHost()
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        host.load()
    assert statuses(host) == {"builtin_models": "builtin", "broken": "failed", "fine": "loaded"}
    assert "skipping broken plugin 'broken'" in caplog.text
    config = EngineConfig(model="m")
    host.call("modify_config", config=config)
    assert config.seed == 7


def test_listing_never_fails_because_of_a_broken_plugin(install_plugin):
    site = install_plugin("broken", "import json\njson.loads('{')\n")
    host = PluginHost()
    records = {r.name: r for r in host.load(strict=False)}
    assert records["broken"].status == "failed"
    # Where: the plugin's own line, not importlib's nor json's.
    assert records["broken"].reason.startswith("import of broken failed: JSONDecodeError: Expecting property name")
    assert records["broken"].reason.endswith(f" (at {site / 'broken.py'}:2)")


def test_exception_in_a_hook_names_the_plugin_and_the_hook(install_plugin):
    install_plugin(
        "raiser", "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n    raise KeyError('x')\n"
    )
    host = PluginHost()
    with pytest.raises(PluginHookError) as info:
        host.call("modify_config", config=EngineConfig(model="m"))
    assert (info.value.plugin, info.value.hook) == ("raiser", "modify_config")
    assert (
        "plugin 'raiser' (distribution pluginhost-raiser 1.0) failed in its modify_config hook: KeyError: 'x'"
        in str(info.value)
    )


def test_invalid_value_assigned_by_a_plugin_names_the_plugin():
    class Bad:
        @hookimpl
        def modify_config(self, config):
            config.dtype = "float8"

    host = PluginHost(plugins=[Bad()], load_installed=False)
    with pytest.raises(PluginHookError, match=r"plugin 'Bad' failed in its modify_config hook: invalid value: dtype"):
        host.call("modify_config", config=EngineConfig(model="m"))


def test_two_plugins_with_the_same_entry_point_name_conflict(install_plugin):
    install_plugin("same", RECORDING_PLUGIN.format(digit=1), dist="first-dist", module="same_a")
    install_plugin("same", RECORDING_PLUGIN.format(digit=2), dist="second-dist", module="same_b")
    records = [r for r in PluginHost().load(strict=False) if r.name == "same"]
    # Deterministic: sorted by distribution, the first keeps the name and the second is refused.
    assert [(r.distribution, r.status) for r in records] == [("first-dist", "loaded"), ("second-dist", "failed")]
    assert "already taken by distribution first-dist" in records[1].reason


def test_a_name_clash_follows_the_selection_and_names_the_way_out(install_plugin, monkeypatch):
    install_plugin("same", RECORDING_PLUGIN.format(digit=1), dist="first-dist", module="same_a")
    install_plugin("same", RECORDING_PLUGIN.format(digit=2), dist="second-dist", module="same_b")
    install_plugin("builtin_models", RECORDING_PLUGIN.format(digit=3), dist="squatter-dist", module="same_c")
    with pytest.raises(PluginLoadError) as info:
        PluginHost().load()
    # The message's way out names the distribution: both clashing plugins share the entry-point name.
    assert "disable it with --disable-plugin second-dist or PLUGINHOST_DISABLED_PLUGINS=second-dist" in str(info.value)
    assert "disable it with --disable-plugin squatter-dist" in str(info.value)
    # Following it works: a plugin left out by the selection clashes with nothing, and the builtins still load.
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "second-dist,squatter-dist")
    host = PluginHost()
    records = {(r.name, r.distribution): r.status for r in host.load()}
    assert records[("same", "first-dist")] == "loaded" and records[("same", "second-dist")] == "blocked"
    assert records[("builtin_models", "squatter-dist")] == "blocked"
    assert "OPTForCausalLM" in host.collect_models()


def test_a_plugin_class_passed_in_process_is_refused_with_the_fix():
    class ShortContext:
        @hookimpl
        def modify_config(self, config):
            config.max_model_len = 64

    with pytest.raises(PluginError, match=r"register an instance of it \(LLM\(plugins=\[ShortContext\(\)\]\)"):
        PluginHost(plugins=[ShortContext], load_installed=False).load()


def test_an_unknown_architecture_names_the_plugins_the_selection_left_out(install_plugin, tiny_opt, monkeypatch):
    install_plugin(
        "good",
        "from pluginhost import hookimpl\n@hookimpl\ndef register_models(registry):\n"
        "    registry.register_model('GoodOPT', 'good_model:GoodOPT')\n",
        dist="good-dist",
    )
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "good")
    with pytest.raises(UnknownArchitectureError) as info:
        LLM(str(tiny_opt), model_architecture_override="GoodOPT")
    assert str(info.value).startswith("Architecture 'GoodOPT' is not registered.")
    assert str(info.value).endswith(
        "Installed plugins left out by the selection, one of which may register it: good (good-dist: disabled by "
        "PLUGINHOST_DISABLED_PLUGINS)."
    )


def test_a_hook_returning_a_value_is_warned_about_once_naming_the_plugin(caplog):
    class ReturnsACopy:  # a porting slip: hooks change what they are given and return None
        @hookimpl
        def modify_config(self, config):
            return config.model_copy(update={"seed": 5})

    host = PluginHost(plugins=[ReturnsACopy()], load_installed=False)
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        for _ in range(2):
            host.call("modify_config", config=EngineConfig(model="m"))
    warnings = [r.getMessage() for r in caplog.records if "the value is ignored" in r.getMessage()]
    assert warnings == [
        "plugin 'ReturnsACopy' returned EngineConfig from its modify_config hook; the value is ignored: hooks change "
        "what they are given in place (the config, the model, the request) and return None"
    ]


def test_wrapper_implementations_work_and_are_attributed():
    class Plain:
        @hookimpl
        def modify_config(self, config):
            config.seed = 1

    class Wrapper:
        @hookimpl(wrapper=True)
        def modify_config(self, config):
            config.max_num_seqs = 3  # before every plain implementation
            result = yield
            config.seed += 10  # after them
            return result

    class Raising:
        @hookimpl(wrapper=True)
        def modify_config(self, config):
            yield
            raise RuntimeError("after the others")

    config = EngineConfig(model="m")
    PluginHost(plugins=[Wrapper(), Plain()], load_installed=False).call("modify_config", config=config)
    assert (config.seed, config.max_num_seqs) == (11, 3)
    assert config.provenance["seed"] == "plugin:Wrapper" and config.provenance["max_num_seqs"] == "plugin:Wrapper"
    with pytest.raises(PluginHookError, match="plugin 'Raising' failed in its modify_config hook: RuntimeError"):
        PluginHost(plugins=[Raising(), Plain()], load_installed=False).call("modify_config", config=config)


def test_tryfirst_trylast_and_specname_work_as_in_pluggy():
    order = []

    class Early:
        @hookimpl(trylast=True)
        def modify_config(self, config):
            order.append("trylast")

    class Late:
        @hookimpl(tryfirst=True)
        def modify_config(self, config):
            order.append("tryfirst")

    class Plain:
        @hookimpl
        def modify_config(self, config):
            order.append("plain")

    class Renamed:
        @hookimpl(specname="modify_config")
        def shrink_context(self, config):
            order.append("specname")
            config.max_model_len = 64

    config = EngineConfig(model="m")
    host = PluginHost(plugins=[Early(), Plain(), Renamed(), Late()], load_installed=False)
    host.call("modify_config", config=config)
    # Given first, Early still runs last; given last, Late still runs first; the rest in the order given.
    assert order == ["tryfirst", "plain", "specname", "trylast"]
    assert config.max_model_len == 64 and config.provenance["max_model_len"] == "plugin:Renamed"
    assert {r.name: r.hooks for r in host.records}["Renamed"] == ("modify_config",)


HALF_VALID_PLUGIN = """
from pluginhost import hookimpl

@hookimpl
def modify_config(config):
    config.seed = 99  # valid on its own: it must not run once the plugin is refused

@hookimpl
def pre_load(config, model_cls):  # wrong argument name: the plugin fails validation
    pass
"""


def test_a_plugin_failing_validation_leaves_none_of_its_hooks_behind(install_plugin, monkeypatch):
    install_plugin("half", HALF_VALID_PLUGIN)
    monkeypatch.setenv("PLUGINHOST_SKIP_BROKEN_PLUGINS", "1")
    host = PluginHost()
    config = EngineConfig(model="m")
    host.call("modify_config", config=config)
    assert statuses(host)["half"] == "failed"
    assert (config.seed, config.provenance["seed"]) == (0, "default")


@pytest.mark.slow
def test_the_lowest_pluggy_allowed_leaves_none_of_a_failed_plugins_hooks_behind(tmp_path):
    """pluggy < 1.7 half-registers a plugin that fails validation; the host must undo it there too."""
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    requirements = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    lowest = re.fullmatch(r"pluggy>=([\d.]+)(,.*)?", next(r for r in requirements if r.startswith("pluggy"))).group(1)
    old = tmp_path / "old-pluggy"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(old), f"pluggy=={lowest}"],
        check=True,
        timeout=300,
    )
    (tmp_path / "half.py").write_text(HALF_VALID_PLUGIN)
    info = tmp_path / "half_dist-1.0.dist-info"  # installed, as pip would leave it
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: half-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pluginhost.plugins]\nhalf = half\n")
    check = (
        "import pluggy\n"
        f"assert pluggy.__version__.startswith({lowest!r}), pluggy.__version__\n"
        "from pluginhost import EngineConfig\n"
        "from pluginhost.host import PluginHost\n"
        "host = PluginHost()\n"
        "config = EngineConfig(model='m')\n"
        "host.call('modify_config', config=config)\n"
        "record = next(r for r in host.records if r.name == 'half')\n"
        "assert record.status == 'failed' and 'model_cls' in record.reason, record\n"
        "assert config.seed == 0, config.seed\n"
        "print('ok', pluggy.__version__)\n"
    )
    env = {
        "PYTHONPATH": os.pathsep.join([str(old), str(tmp_path), *sys.path]),
        "PATH": os.environ["PATH"],
        "PLUGINHOST_SKIP_BROKEN_PLUGINS": "1",
    }
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")


@pytest.mark.parametrize(
    ("code", "target", "reason"),
    [
        ("X = 1\n", None, "is a module that holds no hook implementation"),
        ("def register(registry):\n    pass\n", "fn:register", "takes argument(s) registry"),
        ("def register():\n    raise RuntimeError('no licence')\n", "fn:register", "failed: RuntimeError: no licence"),
        (
            "class Thing:\n    pass\nTHING = Thing()\n",
            "fn:THING",
            "is an instance of Thing that holds no hook implementation",
        ),
        ("class Thing:\n    pass\n", "fn:Thing", "fn:Thing is the class Thing that holds no hook implementation"),
        (
            "from pluginhost.logits_processors import LogitsProcessor\nclass Dummy(LogitsProcessor):\n    pass\n",
            "fn:Dummy",
            "fn:Dummy is the logits processor class Dummy, not a plugin: add it from a register_logits_processors hook",
        ),
        (
            "from pluginhost import hookimpl\nclass Hooks:\n    @hookimpl\n    def modify_config(self, config):\n"
            "        pass\n",
            "fn:Hooks",
            "fn:Hooks is the class Hooks, whose hook implementations (modify_config) are methods: register an "
            "instance of it",
        ),
        ("async def register():\n    pass\n", "fn:register", "is async: plugin functions are called, not awaited"),
        (
            "X = 1\n",
            "my-plugin",
            "its entry point's value 'my-plugin' is not of the form 'package.module' or 'package.module:attribute' "
            "(dotted Python names), such as 'my_plugin' (import names use underscores)",
        ),
        (
            "class Odd:\n    def __dir__(self):\n        raise RuntimeError('no listing')\nODD = Odd()\n",
            "fn:ODD",
            "reading its plugin object for hook implementations failed: RuntimeError: no listing (at ",
        ),
        (
            "from pluginhost import hookimpl\n@hookimpl\ndef register_models(*, registry):\n    pass\n",
            None,
            "its register_models implementation takes registry as keyword-only parameters (after *), which pluggy "
            "never passes; the spec is register_models(registry)",
        ),
        (
            "from pluginhost import hookimpl\n@hookimpl\nasync def modify_config(config):\n    pass\n",
            None,
            "its modify_config implementation is async: hooks are called, not awaited; use def",
        ),
        (
            "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(**kwargs):\n"
            "    kwargs['config'].max_num_seqs = 3\n",
            None,
            "its modify_config implementation takes **kwargs, which pluggy leaves empty (it passes a hook's "
            "arguments only to parameters of their names), so it never gets config: write modify_config(config)",
        ),
        (
            "from pluginhost import hookimpl\n@hookimpl\ndef pre_load(*args):\n    pass\n",
            None,
            "its pre_load implementation takes *args, which pluggy leaves empty (it passes a hook's arguments only "
            "to parameters of their names), so it never gets config, model_class: write pre_load(config, model_class)",
        ),
    ],
    ids=[
        "module-without-hooks",
        "function-with-arguments",
        "function-raising",
        "object-without-hooks",
        "class-without-hooks",
        "logits-processor-entry-point",
        "class-instead-of-instance",
        "async-function",
        "hyphen-in-the-entry-point",
        "object-whose-dir-raises",
        "keyword-only-hook-argument",
        "async-hook",
        "hook-taking-its-argument-through-kwargs",
        "hook-taking-an-argument-through-args",
    ],
)
def test_an_entry_point_with_no_hook_implementation_is_a_broken_plugin(install_plugin, code, target, reason):
    install_plugin("fn", code, target=target)
    record = {r.name: r for r in PluginHost().load(strict=False)}["fn"]
    assert record.status == "failed" and reason in record.reason
    with pytest.raises(PluginLoadError, match=re.escape(reason)):
        PluginHost().load()


def test_an_in_process_plugin_named_like_a_blocked_installed_one_still_loads(install_plugin, monkeypatch):
    """The README's layout: my_plugin installed but disabled, the working copy passed in-process (it was dropped)."""
    install_plugin("my_plugin", "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n    pass\n")
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "my_plugin")
    import my_plugin

    host = PluginHost(plugins=[my_plugin])
    records = {r.name: r for r in host.load()}
    assert records["my_plugin"].status == "blocked"
    assert records["my_plugin (in-process)"].status == "loaded"
    assert host.plugin_manager.get_plugin("my_plugin (in-process)") is my_plugin  # its hooks run


def test_plugins_given_as_a_generator_are_all_loaded():
    class Hooks:
        @hookimpl
        def modify_config(self, config):
            pass

    host = PluginHost(plugins=(p for p in [Hooks()]), load_installed=False)
    assert [r.name for r in host.load()] == [BUILTIN_PLUGIN, "Hooks"]


def test_two_entry_points_naming_one_module_load_it_once_and_say_why_the_other_did_not(install_plugin):
    hooks = "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n    pass\n"
    install_plugin("newname", hooks, dist="alias-dist", module="shared_mod")
    install_plugin("oldname", hooks, dist="alias-dist", module="shared_mod")  # an old name kept working
    records = {r.name: r for r in PluginHost().load(strict=False)}
    (loaded,) = [name for name in ("newname", "oldname") if records[name].status == "loaded"]
    (other,) = {"newname", "oldname"} - {loaded}
    assert records[other].status == "failed"
    assert records[other].reason.startswith(f"it is the object plugin {loaded!r} already is (two entry points")


def test_a_hook_taking_extra_keyword_arguments_loads_and_runs():
    class Tolerant:
        @hookimpl
        def modify_config(self, config, **kwargs):  # pluggy passes the spec's arguments; **kwargs gets none
            config.max_num_seqs = 3

    host = PluginHost(plugins=[Tolerant()], load_installed=False)
    config = EngineConfig(model="m")
    host.call("modify_config", config=config)
    assert config.max_num_seqs == 3


@pytest.mark.parametrize(
    ("script", "only_when_run"),
    [
        ('plugin = 1\nif __name__ == "__main__":\n    made = 2\n', {"made"}),
        ('if "__main__" == __name__:\n    made = 2\n', {"made"}),
        ('if __name__ != "__main__":\n    imported = 2\n', set()),
        ('if __name__ == "__main__":\n    from my_plugins import plugin\n    made = plugin\n', {"plugin", "made"}),
    ],
)
def test_names_a_script_binds_only_under_its_main_guard(tmp_path, script, only_when_run):
    from pluginhost.plugin_names import bound_only_when_run

    path = tmp_path / "script.py"
    path.write_text(script)
    assert bound_only_when_run(str(path)) == only_when_run


MIXED_MODULE = (
    "from pluginhost import ModelRegistry, hookimpl\n"
    "def register():\n"
    "    ModelRegistry.register_model('MixedOPT', 'builtin_models.opt:OPTForCausalLM')\n"
    "@hookimpl\n"
    "def register_logits_processors(registry):\n"
    "    pass\n"
)


def test_a_module_plugin_s_register_function_that_nothing_calls_is_warned_about(install_plugin, caplog):
    """The entry point names the module: its hooks run, its register() does not, and the architecture goes missing."""
    install_plugin("mixed", MIXED_MODULE, dist="mixed-dist")
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        assert "MixedOPT" not in PluginHost().collect_models()
    assert "plugin 'mixed' (distribution mixed-dist 1.0): module mixed has a register() function" in caplog.text
    assert 'add an entry point for it beside this one, such as mixed_register = "mixed:register"' in caplog.text

    caplog.clear()
    install_plugin("mixed_register", dist="mixed-dist", target="mixed:register")  # the advice, followed
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        assert "MixedOPT" in PluginHost().collect_models()
    assert "register()" not in caplog.text


def test_an_in_process_module_plugin_s_register_function_that_nothing_calls_is_warned_about(install_plugin, caplog):
    install_plugin("mixed", MIXED_MODULE, dist="mixed-dist")
    import mixed

    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        PluginHost(plugins=[mixed], load_installed=False).load()
    assert "pass it too: plugins=[mixed, mixed.register]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        assert "MixedOPT" in PluginHost(plugins=[mixed, mixed.register], load_installed=False).collect_models()
    assert "register()" not in caplog.text


@pytest.mark.parametrize(
    "code",
    [
        # A module loading its attributes lazily (PEP 562): pluggy reads dir(), the host's checks must not import.
        "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n    pass\n"
        "def __getattr__(name):\n    import importlib\n    return importlib.import_module(f'{__name__}.{name}')\n",
        # A hook naming the argument it uses, and taking the rest in **kwargs: pluggy calls it with that one.
        "from pluginhost import hookimpl\n@hookimpl\ndef on_output(output, **kwargs):\n    pass\n",
    ],
    ids=["lazy-module-getattr", "some-arguments-and-kwargs"],
)
def test_legal_plugins_load_without_a_warning(install_plugin, caplog, code):
    # Both were refused as broken by the checks for a forgotten @hookimpl and for arguments lost in a star.
    install_plugin("legal", code)
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        record = {r.name: r for r in PluginHost().load(strict=False)}["legal"]
    assert (record.status, record.reason) == ("loaded", None)
    assert "legal" not in caplog.text


def test_a_register_function_re_exported_by_the_module_plugin_beside_it_is_not_called_uncalled(install_plugin, caplog):
    # acme_models:register is an entry point of its own; acme imports it (``from .models import register``): the
    # advice to add an entry point for acme:register would have called it twice.
    install_plugin("acme_models", MIXED_MODULE, dist="acme-dist", target="acme_models:register")
    install_plugin("acme", "from acme_models import register, register_logits_processors\n", dist="acme-dist")
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        assert "MixedOPT" in PluginHost().collect_models()
    assert "register()" not in caplog.text


def test_a_function_named_as_a_hook_but_not_marked_is_warned_about(install_plugin, caplog):
    """It loads beside the plugin's marked hooks and would never run: the change it makes silently never happens."""

    class HalfMarked:
        @hookimpl
        def register_models(self, registry):
            pass

        def modify_config(self, config):  # @hookimpl forgotten
            config.max_num_seqs = 3

    install_plugin(
        "half",
        "from pluginhost import hookimpl\n"
        "@hookimpl\n"
        "def modify_config(config):\n"
        "    pass\n"
        "def post_load(config, model):\n"
        "    pass\n",
        dist="half-dist",
    )
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        PluginHost(plugins=[HalfMarked()]).load()
    assert (
        "plugin 'HalfMarked': modify_config() is named as the hook modify_config(config) but is not marked with "
        "@hookimpl, so it is never called: add @hookimpl above it" in caplog.text
    )
    assert "plugin 'half' (distribution half-dist 1.0): post_load() is named as the hook post_load(config, model)" in (
        caplog.text
    )
    assert caplog.text.count("is not marked with @hookimpl") == 2  # the builtins and the marked hooks: nothing


def test_plugins_one_switch_left_out_are_counted_not_listed_each_with_the_same_reason(
    install_plugin, tiny_opt, monkeypatch
):
    """--no-plugins leaves out every installed plugin: the unknown architecture's error counts them, once."""
    for name in ("alpha", "beta", "gamma"):
        install_plugin(name, RECORDING_PLUGIN.format(digit=1), dist=f"{name}-dist")
    host = PluginHost(selection=PluginSelection().with_cli(no_plugins=True))
    host.load()
    assert host.left_out_message() == (
        "3 installed plugins were left out by --no-plugins, one of which may register it (see `pluginhost plugins`)."
    )
    # A plugin left out by name is still named, with the decision.
    host = PluginHost(selection=PluginSelection(deny={"beta": "--disable-plugin"}).with_cli(no_plugins=True))
    host.load()
    assert host.left_out_message() == (
        "Installed plugins left out by the selection, one of which may register it: 2 installed plugins were left "
        "out by --no-plugins (see `pluginhost plugins`), beta (beta-dist: disabled by --disable-plugin)."
    )
    host = PluginHost(selection=PluginSelection().with_cli(plugins="alpha"))
    host.load()
    assert host.left_out_message() == (
        "Installed plugins left out by the selection, one of which may register it: beta (beta-dist: not in the "
        "allow-list (--plugins=alpha)), gamma (gamma-dist: not in the allow-list (--plugins=alpha))."
    )
    # Where a user meets it: building an engine for an architecture nothing loaded registers.
    monkeypatch.setenv("PLUGINHOST_PLUGINS", "")
    with pytest.raises(UnknownArchitectureError) as info:
        LLM(str(tiny_opt), model_architecture_override="SomeonesLM")
    assert str(info.value).endswith(
        "3 installed plugins were left out by PLUGINHOST_PLUGINS, one of which may "
        "register it (see `pluginhost plugins`)."
    )


HIDDEN_PLUGIN = """
from pluginhost import hookimpl

@hookimpl
def modify_config(config):
    pass
"""


def test_a_plugin_module_loaded_by_path_is_refused_for_tensor_parallelism_before_any_rank_starts(
    tmp_path, monkeypatch, tiny_opt
):
    """Loaded from a file by path, the module imports by name here (sys.modules holds it) and in no other process."""
    import importlib.util
    import sys

    (tmp_path / "elsewhere").mkdir()
    source = tmp_path / "elsewhere" / "hidden_plug.py"
    source.write_text(HIDDEN_PLUGIN)
    spec = importlib.util.spec_from_file_location("hidden_plug", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hidden_plug", module)
    spec.loader.exec_module(module)
    # Was: rank 1 failed to build with a bare "ModuleNotFoundError: No module named 'hidden_plug'".
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(hidden_plug\) cannot be loaded by the other processes") as e:
        LLM(str(tiny_opt), plugins=[module], load_installed_plugins=False, tensor_parallel_size=2)
    assert f"module 'hidden_plug' (loaded from {source} by path) is not found by name on sys.path" in str(e.value)
    # With its folder on sys.path, the other processes find that same file: it travels by name.
    monkeypatch.syspath_prepend(str(source.parent))
    assert PluginHost(plugins=[module], load_installed=False).replica_args()["plugins"] == ["hidden_plug"]
