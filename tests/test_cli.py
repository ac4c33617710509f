"""The listing and config commands: output, JSON, exit statuses, and no torch import."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from builtin_models import BUILTIN_ARCHITECTURES
from pluginhost.cli import main

GOOD_PLUGIN = """
from pluginhost import hookimpl

@hookimpl
def register_models(registry):
    registry.register_model("OPTForCausalLM", "good_impl:BetterOPT")
    registry.register_model("MockOPT", "good_impl:MockOPT")

@hookimpl
def modify_config(config):
    config.max_model_len = 64
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plugins_json_lists_builtin_loaded_blocked_and_failed(install_plugin, capsys, monkeypatch):
    install_plugin("good", GOOD_PLUGIN, dist="good-dist", version="1.2")
    install_plugin("off", "", dist="off-dist")
    install_plugin("broken", "raise ImportError('needs libfoo')\n", dist="broken-dist")
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "off")
    code, out, err = run(capsys, "plugins", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["builtin_models"]["status"] == "builtin"
    assert rows["good"] | {"import_seconds": None} == {
        "name": "good",
        "kind": "installed",
        "status": "loaded",
        "distribution": "good-dist",
        "version": "1.2",
        "hooks": ["modify_config", "register_models"],
        "reason": None,
        "import_seconds": None,
        "target": "good",
    }
    assert rows["good"]["import_seconds"] >= 0
    assert (rows["off"]["status"], rows["off"]["reason"]) == ("blocked", "disabled by PLUGINHOST_DISABLED_PLUGINS")
    assert rows["broken"]["status"] == "failed" and "ImportError: needs libfoo" in rows["broken"]["reason"]


def test_plugins_table_is_readable(install_plugin, capsys):
    install_plugin("good", GOOD_PLUGIN, dist="good-dist", version="1.2")
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "DISTRIBUTION", "VERSION", "HOOKS", "IMPORT", "REASON"]
    assert lines[2].split()[:5] == ["good", "loaded", "good-dist", "1.2", "modify_config,register_models"]


def test_models_json_shows_who_registered_what_and_overrides(install_plugin, capsys):
    install_plugin("good", GOOD_PLUGIN, dist="good-dist")
    code, out, _ = run(capsys, "models", "--json")
    assert code == 0
    rows = {r["architecture"]: r for r in json.loads(out)}
    assert rows["OPTForCausalLM"]["implementation"] == "good_impl:BetterOPT"
    assert rows["OPTForCausalLM"]["registered_by"] == "good"
    assert rows["OPTForCausalLM"]["overrides"] == [
        {"implementation": "builtin_models.opt:OPTForCausalLM", "registered_by": "builtin_models"}
    ]
    assert rows["MockOPT"]["registered_by"] == "good"


def test_selection_flags_work_on_listing_commands(install_plugin, capsys):
    install_plugin("good", GOOD_PLUGIN, dist="good-dist")
    for flags in (
        ["--no-plugins"],
        ["--disable-plugin", "good-dist"],
        ["--plugins", "good", "--disable-plugin", "good"],
    ):
        code, out, _ = run(capsys, "models", "--json", *flags)
        assert code == 0
        assert {r["architecture"] for r in json.loads(out)} == set(BUILTIN_ARCHITECTURES), flags


def test_models_says_what_the_fallback_serves_without_importing_transformers(capsys):
    code, out, _ = run(capsys, "models", "--json", "--no-plugins")
    assert code == 0
    rows = {r["architecture"]: r for r in json.loads(out)}
    serves = rows["TransformersForCausalLM"]["serves"]
    assert isinstance(serves, str) and "transformers can build" in serves and "models --fallback" in serves
    assert "serves" not in rows["OPTForCausalLM"]
    code, out, _ = run(capsys, "models", "--no-plugins")
    assert code == 0 and "TransformersForCausalLM serves every causal-LM architecture" in out


def test_models_fallback_lists_the_architectures_no_registered_model_covers(install_plugin, capsys):
    code, out, _ = run(capsys, "models", "--json", "--fallback", "--no-plugins")
    assert code == 0
    serves = {r["architecture"]: r for r in json.loads(out)}["TransformersForCausalLM"]["serves"]
    assert {"GPTNeoXForCausalLM", "PhiForCausalLM", "FalconForCausalLM"} <= set(serves)
    assert "OPTForCausalLM" not in serves and serves == sorted(serves)
    install_plugin(
        "neox",
        "from pluginhost import hookimpl\n@hookimpl\ndef register_models(registry):\n"
        "    registry.register_model('GPTNeoXForCausalLM', 'neox_impl:NeoX')\n",
    )
    code, out, _ = run(capsys, "models", "--fallback")
    assert code == 0
    listed = out.split("architectures transformers can build:")[1].split()
    assert "PhiForCausalLM" in listed and "GPTNeoXForCausalLM" not in listed and "OPTForCausalLM" not in listed


def test_models_lists_a_plugin_whose_hook_raises_as_failed(install_plugin, capsys):
    install_plugin("raiser", "from pluginhost import hookimpl\n@hookimpl\ndef register_models(registry):\n    1/0\n")
    code, out, err = run(capsys, "models")
    assert code == 0
    assert "OPTForCausalLM" in out and "1 plugin(s) failed to load" in err
    code, out, _ = run(capsys, "plugins", "--json")
    row = next(r for r in json.loads(out) if r["name"] == "raiser")
    assert row["status"] == "failed" and "ZeroDivisionError" in row["reason"]


def test_config_shows_the_settings_the_engine_runs_with_and_who_set_each(install_plugin, capsys, tiny_opt):
    # What pre_load changed was left out (max_num_seqs shown as 256 "default", the engine ran 3), and so were
    # the device and dtype the engine decides ("auto").
    plugin = """
        from pluginhost import hookimpl

        @hookimpl
        def register_models(registry):
            registry.register_model("OPTForCausalLM", "builtin_models.opt:OPTForCausalLM")

        @hookimpl
        def modify_config(config):
            config.max_model_len = 64

        @hookimpl
        def pre_load(config, model_class):
            config.max_num_seqs = 3
        """
    install_plugin("good", plugin)
    code, out, err = run(capsys, "config", "--model", str(tiny_opt), "--dtype", "float32", "--json")
    assert code == 0, err
    data = json.loads(out)
    from pluginhost import LLM

    engine = LLM(str(tiny_opt), dtype="float32")
    assert data["config"] == engine.config.model_dump(mode="json")
    assert data["provenance"] == engine.config.provenance
    assert data["config"]["max_model_len"] == 64 and data["provenance"]["max_model_len"] == "plugin:good"
    assert data["config"]["max_num_seqs"] == 3 and data["provenance"]["max_num_seqs"] == "plugin:good"
    assert data["config"]["device"] == "cpu" and data["provenance"]["dtype"] == "user"
    assert data["provenance"]["seed"] == "default"
    assert data["architecture"] == "OPTForCausalLM" and data["registered_by"] == "good"


def test_every_engine_setting_an_operator_needs_has_its_flag(capsys, tiny_opt):
    # The weights error advised --allow-external-weights, which the CLI did not take; nor could a server's operator
    # raise max_logprobs or the prefill budget.
    flags = [
        "--allow-external-weights",
        "--refuse-nonfinite-weights",
        "--max-logprobs",
        "5",
        "--kv-cache-dtype",
        "bfloat16",
    ]
    code, out, err = run(capsys, "config", "--model", str(tiny_opt), *flags, "--max-num-batched-tokens", "64", "--json")
    assert code == 0, err
    data = json.loads(out)
    given = {
        "allow_external_weights": True,
        "refuse_nonfinite_weights": True,
        "max_logprobs": 5,
        "kv_cache_dtype": "bfloat16",
    }
    assert {k: data["config"][k] for k in [*given, "max_num_batched_tokens"]} == {**given, "max_num_batched_tokens": 64}
    assert all(data["provenance"][k] == "user" for k in [*given, "max_num_batched_tokens"])
    code, _, err = run(capsys, "config", "--model", str(tiny_opt), "--max-logprobs", "-2")
    assert code == 2 and "--max-logprobs: Input should be greater than or equal to -1 (got -2)" in err


def test_config_table(capsys, tiny_opt):
    code, out, _ = run(capsys, "config", "--model", str(tiny_opt), "--hf-overrides", '{"dropout": 0}')
    assert code == 0
    assert any(line.split()[:1] == ["hf_overrides"] and line.endswith("user") for line in out.splitlines())
    assert "architecture: OPTForCausalLM -> builtin_models.opt:OPTForCausalLM (registered by builtin_models)" in out
    assert any(line.split() == ["max_model_len", "128", "default"] for line in out.splitlines())  # not null


def test_config_refuses_what_the_build_would_refuse_without_reading_weights(capsys, tiny_opt):
    code, _, err = run(capsys, "config", "--model", str(tiny_opt), "--max-model-len", "4096")
    assert code == 2 and "--max-model-len 4096 is more than the model's 128 positions (max_position_embeddings)" in err
    code, _, err = run(capsys, "config", "--model", str(tiny_opt), "--compile-decode", "--tensor-parallel-size", "2")
    assert code == 2 and "compile_decode cannot be combined with tensor parallelism" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["config", "--model", "/nonexistent/dir"], "does not exist"),
        (["config", "--model", ""], "Invalid engine settings: --model: the model path is empty"),  # pydantic's report
        (
            ["generate", "--model", "", "--prompt", "hi"],
            "--model: the model path is empty",
        ),  # " has no tokenizer files"
        (["config", "--model", "{tiny}", "--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than 0"),
        (["config", "--model", "{tiny}", "--hf-overrides", "{bad"], "--hf-overrides is not valid JSON"),
        (["config", "--model", "{tiny}", "--hf-overrides", "[1]"], "--hf-overrides must be a JSON object"),
        (
            ["generate", "--model", "{tiny}", "--prompt", "hi", "--hf-overrides", '{"vocab_size": "300"}'],
            "hf_overrides sets vocab_size to '300', which OPTConfig refuses (TypeError: Field 'vocab_size' expected",
        ),
        (["config", "--model", "{tiny}", "--hf-overrides", '{"num_hidden_layers": 2.0}'], "sets num_hidden_layers"),
        (["config", "--model", "{tiny}", "--hf-overrides", '{"architectures": "X"}'], "hf_overrides' 'architectures'"),
        (["config", "--model", "{tiny}", "--device", "tpu"], "unknown device 'tpu'"),
        (
            ["config", "--model", "{tiny}", "--model-architecture-override", "OPTForCausalLm"],
            "Did you mean 'OPTForCausalLM'",
        ),
        (["models", "--plugins", "nothing-like-this"], "matches no installed plugin"),
        (["plugins", "--plugins", " , "], "--plugins ' , ' names no plugin (an unset shell variable?)"),
        (["plugins", "--disable-plugin", ""], "--disable-plugin '' names no plugin (an unset shell variable?)"),
        (["plugins", "--disable-plugin", "builtin_models"], "pluginhost's own builtin architectures, which cannot"),
        (["generate", "--model", "{tiny}", "--prompt", "ok", "--prompt", "ab\udcff"], "--prompt 2 is not valid UTF-8"),
        (
            ["generate", "--model", "{tiny}", "--prompt", "ok", "--prompt", ""],
            "--prompt 2 is an empty string",
        ),  # "prompt 1"
        (["generate", "--model", "{tiny}", "--prompt", "ok", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["generate", "--model", "{tiny}", "--prompt", "ok", "--max-tokens", "0"], "--max-tokens must be an integer"),
    ],
)
def test_bad_input_exits_2_with_one_message_and_no_traceback(capsys, tiny_opt, argv, message):
    code, out, err = run(capsys, *[a.replace("{tiny}", str(tiny_opt)) for a in argv])
    assert code == 2
    assert message in err and err.startswith("error: ")
    assert "Traceback" not in err


def test_generate_on_a_directory_that_is_no_model_says_config_json_is_missing_not_the_tokenizer(capsys, tmp_path):
    # It blamed the tokenizer files and advised copying them in; the Python API said config.json was missing.
    cache_repo = tmp_path / "models--facebook--opt-125m"  # the Hugging Face cache's folder, a common slip
    for folder in ("blobs", "refs", "snapshots/abc"):
        (cache_repo / folder).mkdir(parents=True)
    code, _, err = run(capsys, "generate", "--model", str(cache_repo), "--prompt", "Hi", "--no-plugins")
    assert code == 2 and "config.json is missing" in err and "tokenizer" not in err
    assert "a Hugging Face cache's folder of a model: pass one of its snapshots/<revision>" in err


def test_generate_on_a_model_name_a_plugin_maps_to_a_directory(install_plugin, capsys, tiny_opt, monkeypatch, tmp_path):
    # modify_config may set the model; the CLI's own checks of --model must not refuse the name first.
    install_plugin(
        "alias",
        f"from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n"
        f"    if config.model == 'tiny':\n        config.model = {str(tiny_opt)!r}\n",
    )
    monkeypatch.chdir(tmp_path)  # no directory named tiny here
    code, out, err = run(capsys, "generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "2", "--json")
    assert code == 0, err


def test_generate_decodes_with_its_flags_and_leaves_the_models_sampling_defaults_unread(capsys, tiny_opt, tmp_path):
    # It said it took generation_config.json's defaults, then decoded with its own flags; a file recommending what
    # sampling refuses stopped it.
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_opt, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1.0, "max_new_tokens": 2}))
    code, out, err = run(capsys, "generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "5", "--json")
    assert code == 0, err
    assert len(json.loads(out)[0]["token_ids"]) <= 5 and "generation_config.json" not in err
    code, _, err = run(capsys, "generate", "--model", str(model), "--prompt", "hi", "--generation-config", "auto")
    assert code == 2 and "recommends sampling defaults SamplingParams refuses" in err


def test_generate_with_generation_config_auto_samples_as_the_model_recommends_under_the_flags(
    capsys, tiny_opt, tmp_path
):
    # It said it took the file's defaults, then decoded with every flag's own default: the same tokens as without.
    import shutil

    from pluginhost import LLM, SamplingParams

    model = tmp_path / "model"
    shutil.copytree(tiny_opt, model)
    recommended = {"repetition_penalty": 5.0, "temperature": 0.7}
    (model / "generation_config.json").write_text(json.dumps(recommended))
    prompt = "a snow"
    common = ["generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "12", "--ignore-eos", "--json"]
    runs = {
        "flags alone": [],
        "greedy typed over the file": ["--generation-config", "auto", "--temperature", "0"],
        "the file's sampling": ["--generation-config", "auto", "--seed", "3"],
    }
    tokens = {}
    for name, extra in runs.items():
        code, out, err = run(capsys, *common, *extra)
        assert code == 0, err
        tokens[name] = json.loads(out)[0]["token_ids"]
    llm = LLM(str(model), load_installed_plugins=False, generation_config="vllm")
    asked = {
        "flags alone": {"temperature": 0},
        "greedy typed over the file": recommended | {"temperature": 0},
        "the file's sampling": recommended | {"seed": 3},
    }
    expected = {
        name: llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, **fields))[0].outputs[0].token_ids
        for name, fields in asked.items()
    }
    assert tokens == expected
    assert len({tuple(t) for t in expected.values()}) == 3  # the penalty and the temperature each change the tokens


def test_broken_plugin_stops_config_with_exit_2(install_plugin, capsys, tiny_opt):
    install_plugin("broken", "raise RuntimeError('boom')\n", dist="broken-dist", version="9")
    code, _, err = run(capsys, "config", "--model", str(tiny_opt))
    assert code == 2
    assert "plugin 'broken' (distribution broken-dist 9) is broken" in err and "RuntimeError: boom" in err


def test_debug_adds_the_traceback_and_keeps_the_exit_status(capsys):
    code, _, err = run(capsys, "config", "--model", "/nonexistent/dir", "--debug")
    assert code == 2  # it was 1: the error escaped main()
    assert err.startswith("Traceback (most recent call last):")
    assert err.splitlines()[-1].startswith("error: Model directory '/nonexistent/dir' does not exist")


def test_debug_does_not_wait_for_a_thread_a_failing_plugin_left_running(install_plugin, run_pluginhost):
    install_plugin(
        "stuck",
        """
        import threading, time
        from pluginhost import hookimpl
        threading.Thread(target=time.sleep, args=(600,), name="heartbeat").start()  # not a daemon

        @hookimpl
        def modify_config(config):
            raise RuntimeError("boom")
        """,
    )
    result = run_pluginhost("config", "--debug", timeout=60)  # hung on the thread
    assert result.returncode == 2, result.stderr
    assert "Traceback" in result.stderr and "failed in its modify_config hook: RuntimeError: boom" in result.stderr
    assert "exiting without waiting for 1 thread(s) a plugin left running: heartbeat" in result.stderr


def test_internal_failure_exits_1(capsys, monkeypatch):
    import pluginhost.cli.commands as commands

    def explode(args, out):
        raise AttributeError("a bug")

    monkeypatch.setattr(commands, "list_plugins", explode)
    code, _, err = run(capsys, "plugins")
    assert code == 1 and "internal error: AttributeError: a bug" in err and "--debug" in err


def test_only_these_plugins_and_no_plugins_together_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["plugins", "--plugins", "a", "--no-plugins"])  # --plugins was silently ignored
    assert exit.value.code == 2
    assert "argument --no-plugins: not allowed with argument --plugins" in capsys.readouterr().err


def test_an_unknown_option_is_reported_with_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["plugins", "--bogus"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pluginhost plugins ") and "--disable-plugin NAME" in err  # it was the top level's
    assert "pluginhost plugins: error: unrecognized arguments: --bogus" in err


def test_no_command_prints_help_and_exits_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: pluginhost" in err


@pytest.mark.parametrize(
    "argv", [["plugins"], ["models"], ["models", "--json"], ["models", "--help"], ["--help"], ["generate", "--help"]]
)
def test_listing_and_help_import_neither_torch_nor_transformers(argv):
    script = textwrap.dedent(
        f"""
        import sys
        from pluginhost.cli import main
        try:
            code = main({argv!r})
        except SystemExit as exit:
            code = exit.code
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        print("HEAVY", heavy, "CODE", code)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "HEAVY [] CODE 0" in result.stdout, result.stdout + result.stderr


def test_python_dash_m_is_the_same_command():
    result = subprocess.run(
        [sys.executable, "-m", "pluginhost", "models", "--json"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert {row["architecture"] for row in json.loads(result.stdout)} == set(BUILTIN_ARCHITECTURES)


def test_disabling_the_builtins_from_the_environment_is_one_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "other,builtin-models")
    code, _, err = run(capsys, "models")
    assert code == 2 and "PLUGINHOST_DISABLED_PLUGINS names 'builtin_models'" in err
    monkeypatch.delenv("PLUGINHOST_DISABLED_PLUGINS")
    code, out, _ = run(capsys, "models", "--plugins", "builtin_models")  # naming them in an allow-list is fine
    assert code == 0 and "OPTForCausalLM" in out


def test_disabling_one_of_two_distributions_sharing_a_plugin_name_works_as_the_error_advises(
    install_plugin, capsys, monkeypatch, tiny_opt
):
    plugin = "from pluginhost import hookimpl\n@hookimpl\ndef modify_config(config):\n    pass\n"
    install_plugin("dup", plugin, dist="dupa-dist", module="dup_a")
    install_plugin("dup", plugin, dist="dupb-dist", module="dup_b")
    code, _, err = run(capsys, "config", "--model", str(tiny_opt), "--plugins", "dup")
    assert code == 2 and "the plugin name 'dup' is already taken" in err and "DISABLED_PLUGINS=dupb-dist" in err
    monkeypatch.setenv("PLUGINHOST_DISABLED_PLUGINS", "dupb-dist")
    code, _, err = run(capsys, "config", "--model", str(tiny_opt), "--plugins", "dup")
    assert code == 0, err  # --plugins dup chose dupb-dist too, by the name both declare: the same error
    code, out, _ = run(capsys, "plugins", "--json", "--plugins", "dup")
    statuses = {r["distribution"]: r["status"] for r in json.loads(out) if r["name"] == "dup"}
    assert statuses == {"dupa-dist": "loaded", "dupb-dist": "blocked"}


def test_a_disabled_name_matching_nothing_is_warned_about_as_it_was_given(run_pluginhost):
    result = run_pluginhost("plugins", "--no-plugins", env={"PLUGINHOST_DISABLED_PLUGINS": "My_Plugin"})
    assert result.returncode == 0, result.stderr
    warning = "'My_Plugin' is disabled (PLUGINHOST_DISABLED_PLUGINS) but no installed plugin has that name"
    assert warning in result.stderr


def test_undecodable_prompt_bytes_from_the_shell_exit_2(run_pluginhost):
    result = run_pluginhost("generate", "--prompt", b"caf\xe9", "--no-plugins")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "error: --prompt 1 is not valid UTF-8 (byte 0xe9 at character 3); pass the prompt as UTF-8 text, "
        "or check the terminal's or script's encoding\n"
    )


@pytest.mark.parametrize("where", ["closed pipe", "full disk"])
def test_output_that_cannot_be_written_exits_2_with_a_message(run_pluginhost, where):
    if where == "closed pipe":
        read_end, write_end = os.pipe()
        os.close(read_end)  # what `| head` does once it has its lines
        stdout, expected = write_end, "stdout was closed before the command finished"
    else:
        stdout, expected = os.open("/dev/full", os.O_WRONLY), "could not be written to stdout: No space left on device"
    try:
        result = run_pluginhost("models", "--no-plugins", stdout=stdout)
    finally:
        os.close(stdout)
    assert result.returncode == 2
    assert result.stderr.startswith("error: the output could not be written") and expected in result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


def test_a_command_started_with_stdout_closed_exits_2_as_a_closed_pipe_does(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of `pluginhost models >&-`
    code, _, err = run(capsys, "models", "--no-plugins")
    assert code == 2  # it was 1: "internal error: AssertionError"
    assert err.startswith("error: the output could not be written: stdout was closed before the command finished")


def test_an_unwritable_home_and_cache_do_not_stop_generation(run_pluginhost, tmp_path):
    nowhere = "/dev/null/cannot-exist"  # under a file: not even root can create it
    env = {"HOME": nowhere, "XDG_CACHE_HOME": nowhere, "HF_HOME": nowhere, "PLUGINHOST_CACHE_DIR": nowhere}
    result = run_pluginhost("generate", "--prompt", "A plugin is", "--max-tokens", "3", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)[0]["token_ids"]) == 3


def test_config_without_a_model_shows_the_demo_models(capsys):
    code, out, err = run(capsys, "config", "--json", "--no-plugins")
    assert code == 0, err
    data = json.loads(out)
    assert data["config"]["model"].endswith("demo_model") and data["config"]["max_model_len"] == 256
    assert data["provenance"]["model"] == "default"  # it said "user": nobody passed --model


def test_models_json_stays_json_and_still_says_on_stderr_that_plugins_failed(install_plugin, capsys):
    install_plugin("broken", "raise RuntimeError('boom')\n", dist="broken-dist")
    code, out, err = run(capsys, "models", "--json")
    assert code == 0 and json.loads(out)  # a script reading the JSON
    assert "1 plugin(s) failed to load; see `pluginhost plugins`." in err  # and one reading stderr learns of it


def test_a_plugins_refusal_keeps_its_own_numbers_while_the_engines_prompt_numbers_count_from_1(
    install_plugin, tiny_opt, capsys
):
    install_plugin(
        "picky",
        "from pluginhost import hookimpl\n"
        "@hookimpl\n"
        "def on_request(request):\n"
        "    raise ValueError('prompt 4096 tokens is the most this service takes')\n",
        dist="picky-dist",
    )
    code = main(["generate", "--model", str(tiny_opt), "--prompt", "Hi", "--plugins", "picky"])
    err = capsys.readouterr().err
    assert code == 2 and "prompt 4096 tokens is the most this service takes" in err and "--prompt 4097" not in err


def test_ctrl_c_while_torch_imports_stops_generate_with_130(signal_as_torch_imports_numpy):
    """The first second's Ctrl-C: torch's import swallowed it, and the output was printed (or a bogus error)."""
    argv = ["generate", "--prompt", "A plugin is", "--max-tokens", "2", "--no-plugins"]
    result = subprocess.run(
        [sys.executable, "-c", signal_as_torch_imports_numpy, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "SIGNAL": "SIGINT"},
    )
    assert result.returncode == 130, result.stderr
    assert result.stdout == "" and result.stderr == ""


@pytest.mark.parametrize("command", ["generate", "serve", "plugins", "models", "config"])
def test_help_lists_every_plugin_selection_flag_under_plugin_selection(capsys, command):
    """--plugins and --no-plugins were listed under "options:", apart from --disable-plugin and their heading."""
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    sections: dict[str, list[str]] = {}  # each heading of the help, and the flags listed under it
    heading = ""
    for line in capsys.readouterr().out.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            heading = line
        elif line.lstrip().startswith("-"):
            sections.setdefault(heading, []).append(line.split()[0])
    selection = [flags for heading, flags in sections.items() if heading.startswith("plugin selection (")]
    assert selection == [["--plugins", "--no-plugins", "--disable-plugin"]]
    assert sections["options:"][0] == "-h," and "--plugins" not in sections["options:"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-model-len", "4", "--prompt", "a b c d e f"],
            r"--prompt 1 has \d+ tokens, which leaves no room to generate within --max-model-len 4\. Shorten the "
            r"prompt\.",
        ),
        (
            ["--max-model-len", "4", "--prompt", "a prompt longer than four tokens"],
            r"--prompt 1 has 32 characters, more than --max-model-len 4 tokens can hold \(.*\)\. Shorten the prompt\.",
        ),
        (
            ["--max-model-len", "100000000", "--prompt", "hi"],
            r"--max-model-len 100000000 is more than the model's 128 positions \(max_position_embeddings\); lower it\.",
        ),
    ],
)
def test_messages_about_the_model_length_name_the_flag_that_set_it(capsys, tiny_opt, argv, message):
    """They said max_model_len=4, the engine's field, where the user had typed --max-model-len 4."""
    code, _, err = run(capsys, "generate", "--model", str(tiny_opt), "--no-plugins", *argv)
    assert code == 2
    assert re.fullmatch(f"error: {message}\n", err), err


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["serve", "--help"]])
def test_help_and_version_that_cannot_be_written_exit_2_with_a_message(run_pluginhost, capsys, argv):
    """``pluginhost --version > /dev/full`` exited 0 with nothing on stderr: argparse ignores the error."""
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        result = run_pluginhost(*argv, stdout=full)
    finally:
        os.close(full)
    assert result.returncode == 2
    assert result.stderr == (
        "error: the output could not be written to stdout: No space left on device; free space or write it elsewhere\n"
    )
    with pytest.raises(SystemExit) as exited:  # to a stdout that takes it, all of it as before
        main(argv)
    out = capsys.readouterr().out
    assert exited.value.code == 0 and out.startswith(("pluginhost ", "usage: pluginhost")) and out.endswith("\n")
    assert not out.endswith("\n\n")
