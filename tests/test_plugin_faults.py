"""Every fault an installed plugin can bring, through the CLI and through Python.

Each fault must give: exit status 2 (CLI) or a ``PluginhostError`` (Python); a
message naming the plugin, its distribution and version, the cause and the
remedy; no traceback without ``--debug``; and the same process must build a
correct engine right afterwards.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import pytest

from builtin_models.opt import OPTForCausalLM
from pluginhost import LLM, EngineConfig, SamplingParams
from pluginhost.cli import main
from pluginhost.errors import PluginhostError

HEADER = "from pluginhost import hookimpl\n"
MODEL_CLASSES = """
import torch
from builtin_models.opt import OPTForCausalLM

class LoadsWrongNames(OPTForCausalLM):  # a ported model's name mapping gone wrong
    def load_weights(self, weights):
        raise KeyError('model.decoder.embed_positions.weight')

class NotAModule:
    pass

class NoComputeLogits(torch.nn.Module):
    def forward(self, input_ids, positions, cache_rows=None, mask=None):
        return input_ids

    def load_weights(self, weights):
        return set()
"""


def registers(target: str, extra: str = "") -> str:
    return (
        HEADER
        + extra
        + f"\n@hookimpl\ndef register_models(registry):\n    registry.register_model('OPTForCausalLM', {target})\n"
    )


def raises_in(hook: str, args: str) -> str:
    return HEADER + f"\n@hookimpl\ndef {hook}({args}):\n    raise RuntimeError('refused by policy')\n"


@dataclass(frozen=True)
class Fault:
    code: str
    cause: str


FAULTS = {
    "ImportError at import": Fault("import not_a_real_dependency_xyz\n", "No module named 'not_a_real_dependency_xyz'"),
    "SyntaxError": Fault("def broken(:\n    pass\n", "SyntaxError: invalid syntax"),
    "exception at import": Fault(
        "raise RuntimeError('licence server unreachable')\n", "RuntimeError: licence server unreachable"
    ),
    "unknown hook": Fault(
        HEADER + "@hookimpl\ndef post_loadd(model):\n    pass\n", "'post_loadd', which is not a pluginhost hook"
    ),
    "wrong argument name": Fault(HEADER + "@hookimpl\ndef modify_config(cfg):\n    pass\n", "unknown argument(s) cfg"),
    "argument with a default": Fault(
        HEADER + "@hookimpl\ndef pre_load(config, model_class=None):\n    pass\n", "default value"
    ),
    "raises in register_models": Fault(
        raises_in("register_models", "registry"), "register_models hook: RuntimeError: refused by policy"
    ),
    "raises in modify_config": Fault(
        raises_in("modify_config", "config"), "modify_config hook: RuntimeError: refused by policy"
    ),
    "raises in pre_load": Fault(
        raises_in("pre_load", "config, model_class"), "pre_load hook: RuntimeError: refused by policy"
    ),
    "raises in post_load": Fault(raises_in("post_load", "model"), "post_load hook: RuntimeError: refused by policy"),
    "target without a colon": Fault(registers("'faulty.OPT'"), 'is not of the form "package.module:ClassName"'),
    "target in a missing module": Fault(
        registers("'faulty_missing_module:OPT'"), "module 'faulty_missing_module' failed to import"
    ),
    "target naming a missing class": Fault(registers("'faulty:Missing'"), "module 'faulty' has no 'Missing'"),
    "target that is not an nn.Module": Fault(
        registers("NotAModule", MODEL_CLASSES), "is not a torch.nn.Module subclass"
    ),
    "target without compute_logits": Fault(
        registers("NoComputeLogits", MODEL_CLASSES), "does not implement compute_logits"
    ),
    # Reported as pluginhost's own bug ("internal error ... please report it", exit 1), naming no plugin.
    "load_weights raises": Fault(
        registers("LoadsWrongNames", MODEL_CLASSES),
        "faulty:LoadsWrongNames.load_weights for architecture 'OPTForCausalLM' (registered by plugin 'faulty' "
        "(distribution faulty-dist 0.3.1)) failed: KeyError: 'model.decoder.embed_positions.weight'",
    ),
    # Both were taken, and the engine built as before: float32, while its config said bfloat16.
    "pre_load changes a setting already acted on": Fault(
        HEADER + "@hookimpl\ndef pre_load(config):\n    config.dtype = 'bfloat16'\n",
        "changed dtype in pre_load ('float32' -> 'bfloat16'), after the engine had acted on it",
    ),
    "post_load changes hf_overrides in place": Fault(
        HEADER + "@hookimpl\ndef post_load(config):\n    config.hf_overrides['vocab_size'] = 8\n",
        "changed hf_overrides in post_load ({} -> {'vocab_size': 8})",
    ),
    "modify_config assigns an invalid value": Fault(
        HEADER + "@hookimpl\ndef modify_config(config):\n    config.max_model_len = -5\n",
        "invalid value: max_model_len: Input should be greater than 0",
    ),
    "sys.exit at import": Fault("import sys\nsys.exit('no licence')\n", "SystemExit: no licence"),
    "sys.exit in post_load": Fault(
        HEADER + "import sys\n@hookimpl\ndef post_load(model):\n    sys.exit(0)\n", "post_load hook: SystemExit: 0"
    ),
    "BaseException in pre_load": Fault(
        HEADER
        + "class Halt(BaseException):\n    pass\n"
        + "@hookimpl\ndef pre_load(config, model_class):\n    raise Halt('stop')\n",
        "pre_load hook: Halt: stop",
    ),
    "modify_config assigns an unknown field": Fault(
        HEADER + "@hookimpl\ndef modify_config(config):\n    config.max_len = 5\n",
        "max_len: unknown setting",
    ),
    "dir() of the plugin raises": Fault(
        "def __dir__():\n    raise RuntimeError('no listing')\n",
        "reading its plugin object for hook implementations failed: RuntimeError: no listing",
    ),
}

IDENTITY = "plugin 'faulty' (distribution faulty-dist 0.3.1)"
REMEDY = "--disable-plugin faulty"


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_plugin_fault_through_the_cli(install_plugin, capsys, tiny_opt, fault):
    install_plugin("faulty", FAULTS[fault].code, dist="faulty-dist", version="0.3.1")
    code = main(["generate", "--model", str(tiny_opt), "--prompt", "Hello", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    for part in (IDENTITY, FAULTS[fault].cause, REMEDY):
        assert part in err, f"{part!r} missing from: {err}"
    # Disabling the plugin, as the message says, gets the user going again.
    assert main(["generate", "--model", str(tiny_opt), "--prompt", "Hello", "--max-tokens", "2", *REMEDY.split()]) == 0


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def clean_output(tiny_opt):
    """What an engine with no plugin at all generates, before any fault was installed."""
    return LLM(str(tiny_opt), load_installed_plugins=False).generate([[2, 9, 40]], GREEDY)[0]


@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_plugin_fault_in_python_then_a_correct_engine(install_plugin, monkeypatch, tiny_opt, clean_output, fault):
    install_plugin("faulty", FAULTS[fault].code, dist="faulty-dist", version="0.3.1")
    with pytest.raises(PluginhostError) as info:
        LLM(str(tiny_opt))
    assert IDENTITY in str(info.value) and FAULTS[fault].cause in str(info.value)
    # The same process, the plugin disabled as the message says: an engine exactly like a clean one.
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "faulty")
    llm = LLM(str(tiny_opt))
    assert type(llm.model) is OPTForCausalLM
    assert llm.config.provenance == {
        name: "user" if name == "model" else "default" for name in EngineConfig.model_fields
    }
    out = llm.generate([[2, 9, 40]], GREEDY)[0]
    assert out.token_ids == clean_output.token_ids and out.logprobs == clean_output.logprobs


def test_debug_shows_the_traceback_of_a_plugin_fault(install_plugin, tiny_opt, capsys):
    install_plugin("faulty", FAULTS["raises in pre_load"].code, dist="faulty-dist", version="0.3.1")
    code = main(["generate", "--model", str(tiny_opt), "--prompt", "Hello", "--debug"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and "refused by policy" in err


def test_two_plugins_registering_one_architecture_is_deterministic_and_names_both(install_plugin, capsys, caplog):
    code = HEADER + "@hookimpl\ndef register_models(registry):\n    registry.register_model('Shared', '{0}:Model')\n"
    install_plugin("zeta", code.format("zeta_impl"), dist="zeta-dist", version="2.0")
    install_plugin("alpha", code.format("alpha_impl"), dist="alpha-dist", version="1.0")
    for _ in range(2):
        assert main(["models", "--json", "-v"]) == 0
        row = next(r for r in json.loads(capsys.readouterr().out) if r["architecture"] == "Shared")
        assert (row["implementation"], row["registered_by"]) == ("zeta_impl:Model", "zeta")
        assert row["overrides"] == [{"implementation": "alpha_impl:Model", "registered_by": "alpha"}]
    assert "plugin 'zeta' (distribution zeta-dist 2.0)" in caplog.text
    assert "plugin 'alpha' (distribution alpha-dist 1.0)" in caplog.text


def test_slow_plugin_import_time_is_visible(install_plugin, capsys):
    install_plugin("slow", "import time\ntime.sleep(0.3)\n" + raises_in("pre_load", "config"), dist="slow-dist")
    assert main(["plugins", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "slow")
    assert row["status"] == "loaded" and row["import_seconds"] >= 0.3
    sys.modules.pop("slow")  # a fresh process would import it again
    assert main(["plugins"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("slow "))
    assert " ms" in line and int(line.split(" ms")[0].split()[-1]) >= 300


def test_a_plugin_that_cannot_be_inspected_is_listed_as_failed(install_plugin, capsys):
    """``pluginhost plugins`` never fails because of a plugin: one whose dir() raises is listed with the reason."""
    install_plugin("faulty", FAULTS["dir() of the plugin raises"].code, dist="faulty-dist", version="0.3.1")
    assert main(["plugins", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "faulty")
    assert row["status"] == "failed" and FAULTS["dir() of the plugin raises"].cause in row["reason"]


def test_allow_list_naming_nothing_installed_exits_2_listing_what_is(install_plugin, capsys, monkeypatch):
    install_plugin("present", "", dist="present-dist")
    monkeypatch.setenv("PLUGINHOST_PLUGINS", "absent")
    assert main(["plugins"]) == 2
    err = capsys.readouterr().err
    assert "'absent', which matches no installed plugin" in err and "present (present-dist)" in err


def test_text_prompt_without_tokenizer_exits_2_before_the_model_loads(capsys, tiny_opt_no_tokenizer, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("pluginhost.engine.frontend.load_model", no_loading)
    assert main(["generate", "--model", str(tiny_opt_no_tokenizer), "--prompt", "Hello"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer files (tokenizer.json, " in err and "--prompt is text" in err
    assert "the model was loaded" not in err


NOISY = """
import os, sys
from pluginhost import hookimpl
print("noise at import")
os.write(1, b"noise below Python\\n")

@hookimpl
def register_models(registry):
    print("noise in register_models")

@hookimpl
def pre_load(config, model_class):
    print("noise in pre_load")
    sys.stdout.flush()
"""


@pytest.mark.parametrize(
    "argv",
    [["plugins", "--json"], ["models", "--json"], ["config", "--model", "{tiny}", "--json"], ["generate", "--json"]],
    ids=lambda argv: argv[0],
)
def test_a_plugin_printing_to_stdout_leaves_the_json_output_valid(install_plugin, run_pluginhost, tiny_opt, argv):
    install_plugin("noisy", NOISY, dist="noisy-dist")
    argv = [a.replace("{tiny}", str(tiny_opt)) for a in argv]
    if argv[0] == "generate":
        argv += ["--model", str(tiny_opt), "--prompt", "Hello", "--max-tokens", "2"]
    result = run_pluginhost(*argv)
    assert result.returncode == 0, result.stderr
    json.loads(result.stdout)  # nothing but the result
    assert "noise at import" in result.stderr and "noise below Python" in result.stderr


def test_a_plugin_printing_in_process_goes_to_stderr(install_plugin, capsys):
    install_plugin("noisy", NOISY, dist="noisy-dist")
    assert main(["models", "--json"]) == 0
    captured = capsys.readouterr()
    assert {row["architecture"] for row in json.loads(captured.out)} >= {"OPTForCausalLM"}
    assert "noise in register_models" in captured.err


LINGERING = (
    HEADER
    + """
import threading, time
from concurrent.futures import ThreadPoolExecutor
threading.Thread(target=time.sleep, args=(600,), name="licence-heartbeat").start()  # not a daemon
# An idle pool worker, as torch.compile's compile workers leave: not waited for, and not named.
POOL = ThreadPoolExecutor(1)
POOL.submit(int).result()

@hookimpl
def post_load(model):
    pass
"""
)


@pytest.mark.parametrize("argv", [["plugins"], ["models", "--json"], ["generate", "--max-tokens", "2"]])
def test_a_plugin_thread_does_not_keep_a_command_from_exiting(install_plugin, run_pluginhost, argv):
    install_plugin("lingering", LINGERING, dist="lingering-dist")
    if argv[0] == "generate":
        argv = [*argv, "--prompt", "Hello"]
    result = run_pluginhost(*argv, timeout=60)  # would wait 600 s for the thread
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "exiting without waiting for 1 thread(s) a plugin left running: licence-heartbeat" in result.stderr
