"""The model registry: lazy targets, overrides and their provenance, the interface check."""

from __future__ import annotations

import functools
import json
import logging
import sys

import pytest
import torch

from pluginhost import ModelRegistry, hookimpl
from pluginhost.errors import ModelClassError, PluginHookError, UnknownArchitectureError
from pluginhost.host import PluginHost
from pluginhost.registry import ArchitectureRegistry
from pluginhost.selection import PluginSelection
from pluginhost.testing import RegistersModel


def collect(*plugins, load_installed=False) -> ArchitectureRegistry:
    return PluginHost(plugins=plugins, load_installed=load_installed).collect_models()


def test_builtin_opt_is_registered_lazily(monkeypatch):
    # Through monkeypatch, so the module (and its classes) other tests imported is back afterwards: a
    # module left re-imported makes `type(model) is OPTForCausalLM` false in every later test file.
    import builtin_models

    monkeypatch.delitem(sys.modules, "builtin_models.opt", raising=False)
    monkeypatch.delattr(builtin_models, "opt", raising=False)
    registry = collect()
    entry = registry.get("OPTForCausalLM")
    assert entry.implementation == "builtin_models.opt:OPTForCausalLM"
    assert entry.registered_by.name == "builtin_models"
    assert "builtin_models.opt" not in sys.modules  # listed, not imported
    cls = registry.resolve("OPTForCausalLM")
    assert cls.__name__ == "OPTForCausalLM" and "builtin_models.opt" in sys.modules


def test_overriding_a_builtin_is_logged_with_both_sources(caplog):
    with caplog.at_level(logging.INFO, logger="pluginhost"):
        registry = collect(RegistersModel("OPTForCausalLM", "my_pkg.model:MyOPT"))
    entry = registry.get("OPTForCausalLM")
    assert entry.implementation == "my_pkg.model:MyOPT"
    assert entry.registered_by.name == "RegistersModel"
    assert [o.registered_by.name for o in entry.overrides] == ["builtin_models"]
    assert caplog.text.count("my_pkg.model:MyOPT (plugin 'RegistersModel') replaces builtin_models.opt") == 1


def test_two_installed_plugins_registering_one_architecture_later_name_wins(install_plugin, caplog):
    code = (
        "from pluginhost import hookimpl\n"
        "@hookimpl\n"
        "def register_models(registry):\n"
        "    registry.register_model('Shared', '{0}_impl:Model')\n"
    )
    install_plugin("bbb", code.format("bbb"), dist="bbb-dist")
    install_plugin("aaa", code.format("aaa"), dist="aaa-dist")
    with caplog.at_level(logging.WARNING, logger="pluginhost"):
        entry = PluginHost().collect_models().get("Shared")
    assert entry.registered_by.name == "bbb"  # alphabetical order: bbb runs after aaa
    assert entry.registered_by.distribution == "bbb-dist" and entry.registered_by.version == "1.0"
    assert [o.registered_by.name for o in entry.overrides] == ["aaa"]
    assert (
        "plugin 'bbb' (distribution bbb-dist 1.0)" in caplog.text
        and "plugin 'aaa' (distribution aaa-dist 1.0)" in caplog.text
    )


HOOK_REGISTERS = (
    "from pluginhost import hookimpl\n"
    "@hookimpl\n"
    "def register_models(registry):\n"
    "    registry.register_model('Shared', '{0}_impl:Model')\n"
)
FUNCTION_REGISTERS = (
    "from pluginhost import ModelRegistry\n"
    "def register():\n"
    "    ModelRegistry.register_model('Shared', '{0}_impl:Model')\n"
)


@pytest.mark.parametrize("first_style, second_style", [("function", "hook"), ("hook", "function")])
def test_the_later_name_wins_however_each_plugin_registers(install_plugin, first_style, second_style):
    """A register() function (ModelRegistry) and a register_models hook take their plugins' places in order."""
    for name, style in (("aaa", first_style), ("zzz", second_style)):
        code = (FUNCTION_REGISTERS if style == "function" else HOOK_REGISTERS).format(name)
        install_plugin(name, code, dist=f"{name}-dist", target=f"{name}:register" if style == "function" else None)
    entry = PluginHost().collect_models().get("Shared")
    assert entry.implementation == "zzz_impl:Model"
    assert [o.registered_by.name for o in entry.overrides] == ["aaa"]


def test_vllm_style_register_function_is_called_attributed_and_wins(install_plugin):
    install_plugin(
        "vllm_style",
        "from pluginhost import ModelRegistry\n"
        "def register():\n"
        "    ModelRegistry.register_model('OPTForCausalLM', 'vllm_style_impl:Opt')\n",
        dist="vllm-style-plugin",
        target="vllm_style:register",
    )
    host = PluginHost()
    entry = host.collect_models().get("OPTForCausalLM")
    assert entry.implementation == "vllm_style_impl:Opt"
    assert (entry.registered_by.name, entry.registered_by.distribution) == ("vllm_style", "vllm-style-plugin")
    assert entry.overrides[0].registered_by.name == "builtin_models"
    record = next(r for r in host.records if r.name == "vllm_style")
    assert (record.status, record.hooks) == ("loaded", ("register",))


def test_import_time_registration_of_a_plugin_with_hooks_is_attributed_to_it(install_plugin):
    install_plugin(
        "eager",
        "from pluginhost import ModelRegistry, hookimpl\n"
        "ModelRegistry.register_model('EagerArch', 'eager_impl:M')\n"
        "@hookimpl\n"
        "def modify_config(config):\n"
        "    pass\n",
        dist="eager-dist",
    )
    entry = PluginHost().collect_models().get("EagerArch")
    assert (entry.registered_by.name, entry.registered_by.distribution) == ("eager", "eager-dist")


def test_vllm_style_registration_inside_a_hook_stays_in_that_engine():
    class VllmStyle:
        @hookimpl
        def register_models(self, registry):
            ModelRegistry.register_model("OnlyHere", "somewhere:Model")

    assert "OnlyHere" in collect(VllmStyle()).get_supported_archs()
    assert "OnlyHere" not in ModelRegistry.get_supported_archs()
    assert "OnlyHere" not in collect().get_supported_archs()


def test_the_vllm_guard_sees_what_the_engine_being_built_applies(install_plugin, monkeypatch):
    """Inside an engine, get_supported_archs() lists what that engine applies, not every registration so far."""
    install_plugin(
        "other",
        "from pluginhost import ModelRegistry\n"
        "def register():\n"
        "    ModelRegistry.register_model('Shared', 'other:M')\n"
        "    ModelRegistry.register_model('Hooked', 'other:Hooked')\n",
        target="other:register",
    )
    assert "Shared" in PluginHost().collect_models()  # the installed plugin registered them, process-wide
    assert {"Shared", "Hooked"} <= set(ModelRegistry.get_supported_archs())

    def guarded():  # a new function each time: a register() function is called once per process
        def register():
            if "Shared" not in ModelRegistry.get_supported_archs():
                ModelRegistry.register_model("Shared", "mine:M")

        return register

    class GuardedHook:
        @hookimpl
        def register_models(self, registry):
            if "Hooked" not in ModelRegistry:  # the other spelling of the guard
                ModelRegistry.register_model("Hooked", "mine:Hooked")

    alone = collect(guarded(), GuardedHook())  # without the installed plugin: both guards let their registration in
    assert alone.get("Shared").implementation == "mine:M" and alone.get("Hooked").implementation == "mine:Hooked"
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "other")  # installed, loaded earlier, and now disabled
    disabled = PluginHost(plugins=[guarded(), GuardedHook()]).collect_models()
    assert disabled.get("Shared").implementation == "mine:M" and disabled.get("Hooked").implementation == "mine:Hooked"


def test_the_implementation_called_last_wins_with_trylast_and_wrappers():
    """The hook's own order decides, as it does for every other hook: the merge once ranked by plugin order alone."""

    class Last:
        @hookimpl(trylast=True)
        def register_models(self, registry):
            registry.register_model("Shared", "last:M")

    class Wraps:
        @hookimpl(wrapper=True)
        def register_models(self, registry):
            result = yield
            registry.register_model("Shared", "wrapper:M")  # after every other implementation
            return result

    first = collect(Last(), RegistersModel("Shared", "plain:M")).get("Shared")
    assert first.implementation == "last:M"  # given first, called last: it was "plain:M"
    assert [o.implementation for o in first.overrides] == ["plain:M"]
    assert collect(Wraps(), RegistersModel("Shared", "plain:M")).get("Shared").implementation == "wrapper:M"

    # The builtins are overridden however a plugin's implementation is placed, before theirs too.
    class First:
        @hookimpl(tryfirst=True)
        def register_models(self, registry):
            registry.register_model("OPTForCausalLM", "first:OPT")

    assert collect(First()).get("OPTForCausalLM").implementation == "first:OPT"
    # Without trylast, the later plugin still wins.
    assert collect(RegistersModel("Shared", "a:M"), RegistersModel("Shared", "b:M")).get("Shared").implementation == (
        "b:M"
    )


def test_a_hook_sees_the_architectures_earlier_plugins_registered_without_hooks(install_plugin):
    """The hook's registry answers ``in`` as ModelRegistry does there: a default registered only if absent."""
    install_plugin(
        "aaa_vllm",
        "from pluginhost import ModelRegistry\n"
        "def register():\n"
        "    ModelRegistry.register_model('MyArch', 'aaa_impl:Model')\n",
        target="aaa_vllm:register",
    )
    seen = {}

    class DefaultIfMissing:
        @hookimpl
        def register_models(self, registry):
            seen["in"], seen["listed"] = "MyArch" in registry, "MyArch" in registry.get_supported_archs()
            if "MyArch" not in registry:
                registry.register_model("MyArch", "fallback:Model")
            else:  # what is listed can be read too
                seen["got"] = registry.get("MyArch").implementation

    entry = PluginHost(plugins=[DefaultIfMissing()]).collect_models().get("MyArch")
    assert seen == {"in": True, "listed": True, "got": "aaa_impl:Model"}
    assert entry.implementation == "aaa_impl:Model"  # it was "fallback:Model", silently


def test_unknown_architecture_names_close_matches_and_how_to_list():
    with pytest.raises(UnknownArchitectureError) as info:
        collect().get("OPTForCausalLm")
    assert "Did you mean 'OPTForCausalLM'" in str(info.value)
    assert "pluginhost models" in str(info.value)
    with pytest.raises(UnknownArchitectureError, match=r"OPTModel is a model without its language-modelling head"):
        collect().get("OPTModel")  # it suggested 'GPT2LMHeadModel', by spelling


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon_here", "is not of the form"),
        (42, "expected a class or a 'package.module:ClassName' string"),
    ],
)
def test_malformed_registration_fails_in_the_hook_naming_the_plugin(target, message):
    with pytest.raises(PluginHookError, match=message) as info:
        collect(RegistersModel("Bad", target))
    assert info.value.plugin == "RegistersModel" and info.value.hook == "register_models"


class NotAModule:
    pass


class NoComputeLogits(torch.nn.Module):
    def forward(self, x):
        return x

    def load_weights(self, weights):
        return set()


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_module_abc:Model", "module 'no_such_module_abc' failed to import: ModuleNotFoundError"),
        ("tests.test_registry:Missing", "has no 'Missing'"),
        (NotAModule, "is not a torch.nn.Module subclass"),
        (NoComputeLogits, "does not implement compute_logits"),
        (torch.nn.Module, "does not implement forward, compute_logits, load_weights"),
    ],
)
def test_bad_model_targets_are_reported_at_resolution(target, message):
    registry = collect(RegistersModel("Bad", target))
    with pytest.raises(ModelClassError, match=message) as info:
        registry.resolve("Bad")
    assert "registered by plugin 'RegistersModel'" in str(info.value)


def test_registration_outside_plugins_is_attributed_to_the_calling_module():
    registry = ArchitectureRegistry()
    registry.register_model("Mine", "pkg:Mine")
    assert registry.get("Mine").registered_by.name == __name__


def test_import_time_registration_applies_only_where_its_plugin_is_loaded(install_plugin, monkeypatch):
    install_plugin(
        "global_reg",
        "from pluginhost import ModelRegistry\n"
        "def register():\n"
        "    ModelRegistry.register_model('GlobalArch', 'global_impl:M')\n",
        target="global_reg:register",
    )
    assert "GlobalArch" in PluginHost().collect_models()  # calls register(): the registration is process-wide
    assert "GlobalArch" in ModelRegistry.get_supported_archs()
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "global_reg")
    assert "GlobalArch" not in PluginHost().collect_models()
    assert "GlobalArch" not in PluginHost(load_installed=False).collect_models()


def test_a_plugin_module_imported_by_other_code_first_still_registers_as_that_plugin(install_plugin, monkeypatch):
    """Importing a plugin's module (a test, an application) must not make its registrations global."""
    install_plugin(
        "leaky",
        "from pluginhost import ModelRegistry, hookimpl\n"
        "ModelRegistry.register_model('LeakyArch', 'leaky_impl:M')\n"
        "@hookimpl\n"
        "def modify_config(config):\n"
        "    pass\n",
        dist="leaky-dist",
    )
    import leaky  # noqa: F401 - imported by "user code", before any host loads it

    entry = ModelRegistry.get("LeakyArch")
    assert (entry.registered_by.name, entry.registered_by.distribution) == ("leaky", "leaky-dist")
    monkeypatch.setenv("PLUGINHOST_PLUGINS", "")
    assert "LeakyArch" not in PluginHost().collect_models()
    monkeypatch.delenv("PLUGINHOST_PLUGINS")
    assert "LeakyArch" in PluginHost().collect_models()


def test_a_registration_made_at_import_belongs_to_the_plugin_whose_module_makes_it(install_plugin, monkeypatch):
    """a_plug imports b_plug's module, which registers at import: b_plug's registration, gone when b_plug is off."""
    hook = "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n    pass\n"
    registers = "from pluginhost import ModelRegistry\nModelRegistry.register_model('BArch', 'b_plug:Model')\n"
    install_plugin("b_plug", hook + registers, dist="b-dist")
    install_plugin("a_plug", "import b_plug\n" + hook, dist="a-dist")
    entry = PluginHost().collect_models().get("BArch")
    assert (entry.registered_by.name, entry.registered_by.distribution) == ("b_plug", "b-dist")  # it said a_plug
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "b_plug")
    assert "BArch" not in PluginHost().collect_models().get_supported_archs()  # a_plug still imports b_plug


REGISTERS_AT_IMPORT = (
    "from pluginhost import ModelRegistry\nModelRegistry.register_model({!r}, 'builtin_models.opt:OPTForCausalLM')\n"
)


def test_a_distributions_code_beside_its_plugins_package_registers_as_its_plugin(install_plugin, monkeypatch, request):
    """Distribution acme-llm ships acme_plugin (the entry point acme) and acme_models, which registers at import.
    Of the namespace package ns, acme-llm ships ns.acme and another distribution (no plugin) ns.other."""
    register = "def register():\n    import acme_models\n"
    site = install_plugin("acme", register, dist="acme-llm", module="acme_plugin", target="acme_plugin:register")
    (site / "acme_models.py").write_text(REGISTERS_AT_IMPORT.format("AcmeArch"))
    (site / "ns").mkdir()
    (site / "ns" / "acme.py").write_text(REGISTERS_AT_IMPORT.format("AcmeNsArch"))
    (site / "ns" / "other.py").write_text(REGISTERS_AT_IMPORT.format("OtherNsArch"))
    (site / "acme_llm-1.0.dist-info" / "RECORD").write_text("acme_plugin.py,,\nacme_models.py,,\nns/acme.py,,\n")
    other = site / "other_dist-2.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: other-dist\nVersion: 2.0\n")
    (other / "RECORD").write_text("ns/other.py,,\n")
    modules = ("acme_models", "ns", "ns.acme", "ns.other")
    for module in modules:
        monkeypatch.delitem(sys.modules, module, raising=False)
    request.addfinalizer(lambda: [sys.modules.pop(module, None) for module in modules])  # imported again below
    import acme_models  # noqa: F401 - the user's script imports the distribution's code
    import ns.acme
    import ns.other  # noqa: F401

    def credited(architecture: str) -> tuple[str, str | None]:
        ref = ModelRegistry.get(architecture).registered_by
        return ref.name, ref.distribution

    assert credited("AcmeArch") == credited("AcmeNsArch") == ("acme", "acme-llm")  # was ("acme_models", None)
    assert credited("OtherNsArch") == ("ns.other", None)  # no installed plugin's code: the module's own
    assert {"AcmeArch", "AcmeNsArch", "OtherNsArch"} <= set(PluginHost().collect_models().get_supported_archs())
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "acme")
    applied = PluginHost().collect_models().get_supported_archs()
    assert "AcmeArch" not in applied and "AcmeNsArch" not in applied and "OtherNsArch" in applied


def test_a_module_is_credited_by_the_file_it_was_loaded_from(install_plugin, monkeypatch, request, tmp_path):
    """A user's own ``tests`` package is the user's even when a plugin's distribution ships one (by name it was the
    plugin's, and disabling the plugin dropped the user's architecture); an editable install's code is its plugin's,
    found by the project folder ``direct_url.json`` names (its RECORD lists no module: hatchling, flit, uv...)."""
    site = install_plugin(
        "acme", "def register():\n    pass\n", dist="acme-llm", module="acme_plugin", target="acme_plugin:register"
    )
    (site / "tests").mkdir()
    (site / "tests" / "__init__.py").write_text("")
    (site / "acme_llm-1.0.dist-info" / "RECORD").write_text("acme_plugin.py,,\ntests/__init__.py,,\n")
    mine = tmp_path / "project"
    (mine / "tests").mkdir(parents=True)
    (mine / "tests" / "__init__.py").write_text("")
    (mine / "tests" / "my_models.py").write_text(REGISTERS_AT_IMPORT.format("MyArch"))
    project = tmp_path / "editable"
    project.mkdir()
    (project / "beta_models.py").write_text(REGISTERS_AT_IMPORT.format("BetaArch"))
    install_plugin(
        "beta", "def register():\n    pass\n", dist="beta-llm", module="beta_plugin", target="beta_plugin:register"
    )
    info = site / "beta_llm-1.0.dist-info"
    (info / "RECORD").write_text("_beta_llm.pth,,\n")
    (info / "direct_url.json").write_text(f'{{"url": "{project.as_uri()}", "dir_info": {{"editable": true}}}}')
    monkeypatch.syspath_prepend(str(mine))
    monkeypatch.syspath_prepend(str(project))
    modules = ("tests", "tests.my_models", "beta_models")
    for module in modules:
        monkeypatch.delitem(sys.modules, module, raising=False)
    request.addfinalizer(lambda: [sys.modules.pop(module, None) for module in modules])
    import beta_models  # noqa: F401
    import tests.my_models  # noqa: F401

    assert ModelRegistry.get("MyArch").registered_by.name == "tests.my_models"  # was ("acme", "acme-llm")
    assert ModelRegistry.get("BetaArch").registered_by.distribution == "beta-llm"  # was the bare module's
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "acme,beta")
    applied = PluginHost().collect_models().get_supported_archs()
    assert "MyArch" in applied and "BetaArch" not in applied


def test_a_namespace_package_shared_by_distributions_is_credited_by_the_files_each_installed(
    install_plugin, monkeypatch, request, tmp_path
):
    """acmens-a (entry point acmens.plugin_a) and acmens-b (acmens.plugin_b, shipping acmens.b_models) share the
    namespace package acmens; the user's own acmens.mine is in neither. By name, both went to acmens_a, the first
    plugin in the package: disabling it dropped acmens-b's architecture and the user's, and disabling acmens-b did
    not drop its own."""
    site = tmp_path / "site-packages"
    (site / "acmens").mkdir()
    for name in ("a", "b"):
        install_plugin(
            f"acmens_{name}",
            "def register():\n    pass\n",
            dist=f"acmens-{name}",
            module=f"acmens/plugin_{name}",
            target=f"acmens.plugin_{name}:register",
        )
    (site / "acmens" / "b_models.py").write_text(REGISTERS_AT_IMPORT.format("ArchB"))
    (site / "acmens_a-1.0.dist-info" / "RECORD").write_text("acmens/plugin_a.py,,\n")
    (site / "acmens_b-1.0.dist-info" / "RECORD").write_text("acmens/plugin_b.py,,\nacmens/b_models.py,,\n")
    mine = tmp_path / "mine"
    (mine / "acmens").mkdir(parents=True)
    (mine / "acmens" / "mine.py").write_text(REGISTERS_AT_IMPORT.format("MineArch"))
    monkeypatch.syspath_prepend(str(mine))
    modules = ("acmens", "acmens.b_models", "acmens.mine", "acmens.plugin_a", "acmens.plugin_b")
    for module in modules:
        monkeypatch.delitem(sys.modules, module, raising=False)
    request.addfinalizer(lambda: [sys.modules.pop(module, None) for module in modules])
    import acmens.b_models  # noqa: F401 - the user's script imports a distribution's code, and its own
    import acmens.mine  # noqa: F401

    registered_by = ModelRegistry.get("ArchB").registered_by
    assert (registered_by.name, registered_by.distribution) == ("acmens_b", "acmens-b")
    assert ModelRegistry.get("MineArch").registered_by.name == "acmens.mine"
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "acmens_a")
    assert {"ArchB", "MineArch"} <= set(PluginHost().collect_models().get_supported_archs())
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "acmens_b")
    applied = PluginHost().collect_models().get_supported_archs()
    assert "ArchB" not in applied and "MineArch" in applied


def test_scripts_and_examples_in_an_editable_plugins_project_folder_are_the_users(
    install_plugin, monkeypatch, request, tmp_path
):
    """Every file under an editable install's project folder was its plugin's: a script in its examples/ (or one
    imported from its scripts/) registering through ModelRegistry was dropped with the plugin not loaded."""
    project = tmp_path / "editable"
    (project / "src" / "gamma_models").mkdir(parents=True)
    (project / "src" / "gamma_models" / "__init__.py").write_text(REGISTERS_AT_IMPORT.format("GammaArch"))
    (project / "examples").mkdir()
    (project / "scripts").mkdir()
    (project / "scripts" / "experiment.py").write_text(REGISTERS_AT_IMPORT.format("ExperimentArch"))
    site = install_plugin(
        "gamma", "def register():\n    pass\n", dist="gamma-llm", module="gamma_plugin", target="gamma_plugin:register"
    )
    info = site / "gamma_llm-1.0.dist-info"
    (info / "RECORD").write_text("_gamma_llm.pth,,\n")
    (info / "direct_url.json").write_text(f'{{"url": "{project.as_uri()}", "dir_info": {{"editable": true}}}}')
    monkeypatch.syspath_prepend(str(project / "src"))
    monkeypatch.syspath_prepend(str(project / "scripts"))
    modules = ("gamma_models", "experiment")
    for module in modules:
        monkeypatch.delitem(sys.modules, module, raising=False)
    request.addfinalizer(lambda: [sys.modules.pop(module, None) for module in modules])
    import experiment  # noqa: F401
    import gamma_models  # noqa: F401

    script = project / "examples" / "run.py"  # `python examples/run.py`: the script is __main__
    exec(compile(REGISTERS_AT_IMPORT.format("ExampleArch"), str(script), "exec"), {"__name__": "__main__"})
    assert ModelRegistry.get("GammaArch").registered_by.distribution == "gamma-llm"  # the package is the plugin's
    assert ModelRegistry.get("ExperimentArch").registered_by.name == "experiment"  # was ("gamma", "gamma-llm")
    assert ModelRegistry.get("ExampleArch").registered_by.name == "__main__"
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "gamma")
    applied = PluginHost().collect_models().get_supported_archs()
    assert "GammaArch" not in applied and {"ExperimentArch", "ExampleArch"} <= set(applied)


def test_an_editable_plugins_package_in_another_folder_of_its_project_is_still_its_plugins(
    monkeypatch, request, tmp_path
):
    """setuptools' package_dir={"": "lib"} (poetry's `from`): the package beside the entry point is in lib/, neither
    the project's root nor src/; the module beside acme_lib.plugin is still the plugin's, by its package."""
    project = tmp_path / "acme-llm"
    package = project / "lib" / "acme_lib"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text("def register():\n    import acme_lib.models\n")
    (package / "models.py").write_text(REGISTERS_AT_IMPORT.format("AcmeLibArch"))
    site = tmp_path / "site"
    info = site / "acme_llm-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-llm\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pluginhost.plugins]\nacme = acme_lib.plugin:register\n")
    (info / "RECORD").write_text("__editable__.acme_llm-1.0.pth,,\n")
    (info / "direct_url.json").write_text(f'{{"url": "{project.as_uri()}", "dir_info": {{"editable": true}}}}')
    monkeypatch.syspath_prepend(str(project / "lib"))
    monkeypatch.syspath_prepend(str(site))
    modules = ("acme_lib", "acme_lib.models", "acme_lib.plugin")
    request.addfinalizer(lambda: [sys.modules.pop(module, None) for module in modules])
    import acme_lib.models  # noqa: F401 - the user's script imports the plugin's models

    registered_by = ModelRegistry.get("AcmeLibArch").registered_by
    assert (registered_by.name, registered_by.distribution) == ("acme", "acme-llm")
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "acme")
    assert "AcmeLibArch" not in PluginHost().collect_models().get_supported_archs()


GUARDED_REGISTER = """
from pluginhost import ModelRegistry

def register():
    if "GuardedArch" not in ModelRegistry.get_supported_archs():  # vLLM's guard
        ModelRegistry.register_model("GuardedArch", "builtin_models.opt:OPTForCausalLM")
"""


@pytest.mark.parametrize("layout", ["defined in the module", "re-exported by the package"])
def test_a_guarded_register_the_script_called_itself_applies_where_it_is_passed_in_process(
    install_plugin, request, tmp_path, layout
):
    """The script calls the installed plugin's register() itself (as vLLM's tests do); an engine loading the plugin
    calls it again, and the guard registers nothing; passed in-process to an engine not loading the plugin, it was
    refused, advising exactly that: 'pass its register function in-process'. The entry point may name the function
    where the package's __init__ re-exports it (guarded_ext:register, defined in guarded_ext.impl)."""
    if layout == "defined in the module":
        install_plugin(
            "guarded", GUARDED_REGISTER, dist="guarded-dist", module="guarded_ext", target="guarded_ext:register"
        )
    else:
        package = tmp_path / "site-packages" / "guarded_ext"
        package.mkdir(parents=True)
        (package / "impl.py").write_text(GUARDED_REGISTER)
        (package / "__init__.py").write_text("from guarded_ext.impl import register\n")
        install_plugin("guarded", "", dist="guarded-dist", module="guarded_unused", target="guarded_ext:register")
    request.addfinalizer(lambda: [sys.modules.pop(m, None) for m in ("guarded_ext", "guarded_ext.impl")])
    import guarded_ext

    guarded_ext.register()
    assert "GuardedArch" in PluginHost().collect_models()  # the plugin loaded: its own code's registration applies
    assert "GuardedArch" not in PluginHost(load_installed=False).collect_models()
    assert "GuardedArch" in PluginHost(plugins=[guarded_ext.register], load_installed=False).collect_models()


def test_an_in_process_register_functions_registrations_are_listed_and_stay_with_its_engines(make_host, make_engine):
    """vLLM's ModelRegistry lists every registration made so far; the engines not passing the function lack it."""

    from builtin_models.opt import OPTForCausalLM

    class InProcessOPT(OPTForCausalLM):
        pass

    def register():
        ModelRegistry.register_model("InProcessOPT", InProcessOPT)

    assert "InProcessOPT" in PluginHost(plugins=[register], load_installed=False).collect_models()
    # Was: neither listed nor `in`, though the engine built it.
    assert "InProcessOPT" in ModelRegistry.get_supported_archs() and "InProcessOPT" in ModelRegistry
    assert ModelRegistry.get("InProcessOPT").registered_by.name.endswith("register")
    assert "InProcessOPT" not in PluginHost(load_installed=False).collect_models()
    # Listed, yet not this engine's: the error says why (it was a bare "not registered").
    with pytest.raises(ValueError, match=r"registered in this process by the in-process plugin '.*register', which"):
        make_engine(model_architecture_override="InProcessOPT")
    assert "InProcessOPT" not in make_host().collect_models()  # the test kit's engines too
    assert "InProcessOPT" in PluginHost(plugins=[register], load_installed=False).collect_models()  # replayed


@pytest.fixture
def install_package_plugins(install_plugin, tmp_path):
    """``install(package, {entry point: (module file, code, target)})``: one distribution, one package, several entry
    points (``install_plugin`` writes the files); the package's modules are forgotten after the test."""
    packages: list[str] = []

    def install(package: str, plugins: dict[str, tuple[str, str, str]]) -> None:
        (tmp_path / "site-packages" / package).mkdir()
        packages.append(package)
        for name, (module_file, code, target) in plugins.items():
            install_plugin(name, code, dist=package, module=f"{package}/{module_file}", target=target)

    yield install
    for module in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[module]


NO_OP_HOOK = "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n    pass\n"


def test_two_entry_points_in_one_package_credit_import_time_registrations_to_the_package_s_own(
    install_package_plugins,
):
    """twoeps_extra ("twoeps.extra") imports the package "twoeps" first: what twoeps/__init__ registers is
    twoeps_models', which names that package, so disabling twoeps_models (not twoeps_extra) removes it."""
    registers = "from pluginhost import ModelRegistry\nModelRegistry.register_model('TwoEpsOPT', 'twoeps.model:M')\n"
    install_package_plugins(
        "twoeps",
        {
            "twoeps_models": ("__init__", registers + NO_OP_HOOK, "twoeps"),
            "twoeps_extra": ("extra", NO_OP_HOOK, "twoeps.extra"),
        },
    )
    # twoeps_extra alone imports the package: the registration is there, but not twoeps_extra's.
    without_models = PluginHost(selection=PluginSelection().with_cli(disable=["twoeps_models"]))
    assert "TwoEpsOPT" not in without_models.collect_models()
    assert PluginHost().collect_models().get("TwoEpsOPT").registered_by.name == "twoeps_models"
    assert "TwoEpsOPT" in PluginHost(selection=PluginSelection().with_cli(disable=["twoeps_extra"])).collect_models()


def test_a_register_function_beside_a_second_entry_point_in_its_package_registers_as_its_own_plugin(
    install_package_plugins,
):
    """vLLM's shape: register_port_model = "portpkg:register" beside port_logitsprocs = "portpkg.lp_plugin"."""
    register = (
        "from pluginhost import ModelRegistry\n"
        "def register():\n"
        "    ModelRegistry.register_model('PortOPT', 'portpkg.model:M')\n"
    )
    install_package_plugins(
        "portpkg",
        {
            "register_port_model": ("__init__", register, "portpkg:register"),
            "port_logitsprocs": ("lp_plugin", NO_OP_HOOK, "portpkg.lp_plugin"),
        },
    )
    entry = PluginHost().collect_models().get("PortOPT")
    assert (entry.registered_by.name, entry.registered_by.distribution) == ("register_port_model", "portpkg")
    assert "PortOPT" in PluginHost(selection=PluginSelection().with_cli(disable=["port_logitsprocs"])).collect_models()
    assert (
        "PortOPT"
        not in PluginHost(selection=PluginSelection().with_cli(disable=["register_port_model"])).collect_models()
    )


def traced(function):
    """A decorator several plugins share (as a site's logging helper would be): one code object for all."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


class RegistersThroughADecorator:
    def __init__(self, architecture: str) -> None:
        self.architecture = architecture

    @hookimpl
    @traced
    def register_models(self, registry):
        if self.architecture == "fail":
            raise RuntimeError("this one fails")
        registry.register_model(self.architecture, "somewhere:Model")


def test_hooks_under_a_shared_decorator_are_attributed_to_their_own_plugins():
    first, second = RegistersThroughADecorator("FirstArch"), RegistersThroughADecorator("SecondArch")
    registry = collect(first, second)
    assert registry.get("FirstArch").registered_by.name == "RegistersThroughADecorator"
    assert registry.get("SecondArch").registered_by.name == "RegistersThroughADecorator#2"  # not both the last one
    with pytest.raises(PluginHookError) as info:
        collect(RegistersThroughADecorator("fail"), first)
    assert info.value.plugin == "RegistersThroughADecorator"  # the failing one, not the other


def test_the_builtins_stay_the_builtins_when_a_vllm_style_plugin_is_first_to_touch_the_registry(
    install_plugin, run_pluginhost
):
    """In a fresh process the builtins are registered when ModelRegistry is first used: by a plugin's register()."""
    install_plugin(
        "dummy",
        "from pluginhost import ModelRegistry\ndef register():\n    ModelRegistry.register_model('Dummy', 'd:M')\n",
        target="dummy:register",
    )
    result = run_pluginhost("models", "--json")
    assert result.returncode == 0, result.stderr
    registered_by = {e["architecture"]: e["registered_by"] for e in json.loads(result.stdout)}
    assert registered_by["OPTForCausalLM"] == "builtin_models" and registered_by["Dummy"] == "dummy"
    assert "replaces" not in result.stderr  # each builtin was credited to the plugin, replacing itself
