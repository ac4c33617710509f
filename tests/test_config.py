"""EngineConfig: validation on construction and assignment, and provenance."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pluginhost import EngineConfig, hookimpl
from pluginhost.config import describe_validation_error
from pluginhost.host import PluginHost


def test_defaults_and_user_values_are_told_apart():
    config = EngineConfig(model="dir", dtype="float16")
    assert config.provenance["model"] == "user"
    assert config.provenance["dtype"] == "user"
    assert config.provenance["seed"] == "default"
    config.seed = 3
    assert config.provenance["seed"] == "user"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "dtype",
            "fp8",
            "dtype: 'fp8' is not a dtype pluginhost runs: use 'auto', 'float32' (or 'float'), 'float16' (or",
        ),
        ("dtype", 16, "dtype: Input should be 'auto', 'float32', 'float16' or 'bfloat16'"),
        ("device", "tpu", "unknown device 'tpu'"),
        ("max_model_len", 0, "max_model_len: Input should be greater than 0"),
        ("model", " ", "the model path is empty"),
        ("model_architecture_override", "", "the architecture override is empty"),
    ],
)
def test_invalid_values_are_refused_on_construction_and_assignment(field, value, message):
    with pytest.raises(ValidationError) as info:
        EngineConfig(**{"model": "dir", field: value})
    assert message in describe_validation_error(info.value)
    config = EngineConfig(model="dir")
    before = getattr(config, field)
    with pytest.raises(ValidationError):
        setattr(config, field, value)
    assert getattr(config, field) == before


def test_unknown_fields_are_refused_with_the_known_ones_listed():
    with pytest.raises(ValidationError) as info:
        EngineConfig(model="dir", max_len=5)
    assert "max_len: unknown setting (known settings: model, model_architecture_override" in describe_validation_error(
        info.value
    )


def test_vllms_logits_processors_setting_is_refused_naming_the_hook(tiny_opt):
    """vLLM's examples pass LLM(model, logits_processors=[Cls]); pluginhost takes them from a plugin's hook."""
    from pluginhost import LLM
    from pluginhost.logits_processors import LogitsProcessor

    class Dummy(LogitsProcessor):
        def __init__(self, config, device):
            pass

        def apply(self, logits):
            return logits

        def is_argmax_invariant(self):
            return True

        def update_state(self, batch_update):
            pass

    with pytest.raises(ValueError) as info:
        LLM(str(tiny_opt), load_installed_plugins=False, logits_processors=[Dummy])
    message = str(info.value)
    assert "logits_processors: pluginhost adds logits processors from plugins" in message
    assert "register_logits_processors hook (registry.add(cls))" in message and "plugins=[plugin]" in message
    assert "unknown setting" not in message


@pytest.mark.parametrize(
    ("given", "dtype"), [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"), ("HALF", "float16")]
)
def test_vllms_dtype_spellings_and_torch_dtypes_are_accepted(given, dtype):
    import torch

    assert EngineConfig(model="m", dtype=given).dtype == dtype
    assert EngineConfig(model="m", dtype=getattr(torch, dtype)).dtype == dtype
    assert EngineConfig(model="m", dtype="BFloat16").dtype == "bfloat16"


def test_kv_cache_dtype_takes_vllms_bfloat16_and_refuses_fp8_saying_what_it_runs():
    import torch

    assert EngineConfig(model="m").kv_cache_dtype == "auto"
    assert EngineConfig(model="m", kv_cache_dtype="BFloat16").kv_cache_dtype == "bfloat16"
    assert EngineConfig(model="m", kv_cache_dtype=torch.bfloat16).kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError) as info:
        EngineConfig(model="m", kv_cache_dtype="fp8_e4m3")
    assert (
        "kv_cache_dtype: 'fp8_e4m3' is not a KV cache dtype pluginhost runs: use 'auto' (the model's dtype) or "
        "'bfloat16' (fp8 caches are not run)" in describe_validation_error(info.value)
    )


def test_cuda_devices_are_accepted_by_name():
    assert EngineConfig(model="d", device="cuda:1").device == "cuda:1"


def test_plugin_assignments_are_attributed_to_the_plugin():
    class SitePolicy:
        @hookimpl
        def modify_config(self, config):
            config.max_model_len = 64
            config.hf_overrides = {"dropout": 0.0}

    config = EngineConfig(model="dir", seed=5)
    PluginHost(plugins=[SitePolicy()], load_installed=False).call("modify_config", config=config)
    assert config.provenance == {name: "default" for name in EngineConfig.model_fields} | {
        "model": "user",
        "seed": "user",
        "hf_overrides": "plugin:SitePolicy",
        "max_model_len": "plugin:SitePolicy",
    }


def test_a_value_set_again_unchanged_keeps_its_source_unless_it_may_have_changed_in_place():
    class Policy:
        @hookimpl
        def modify_config(self, config):
            config.dtype = "half"  # the user's float16 already
            overrides = config.hf_overrides  # extended in place, then assigned back: a change all the same
            overrides["rope_theta"] = 1e6
            config.hf_overrides = overrides

    config = EngineConfig(model="dir", dtype="float16", hf_overrides={"dropout": 0.0})
    PluginHost(plugins=[Policy()], load_installed=False).call("modify_config", config=config)
    assert (config.provenance["dtype"], config.provenance["hf_overrides"]) == ("user", "plugin:Policy")


def test_a_built_engines_settings_are_read_only(tiny_opt):
    from pluginhost import LLM
    from pluginhost.errors import ConfigError

    llm = LLM(str(tiny_opt), load_installed_plugins=False, max_num_seqs=4)
    refused = r"EngineConfig.max_num_seqs cannot change once the engine is built \(it is 4\)"
    with pytest.raises(ConfigError, match=refused):
        llm.config.max_num_seqs = 1  # the scheduler would go on with 4, and llm.config would say 1
    assert llm.config.max_num_seqs == 4 and llm.engine.scheduler.max_num_seqs == 4
    copied = llm.config.model_copy()  # copy, change, build anew: a copy describes no engine yet
    copied.max_num_seqs = 2
    assert copied.max_num_seqs == 2 and llm.config.max_num_seqs == 4


@pytest.mark.parametrize("theta_first", [True, False])
def test_an_overridden_rope_theta_is_the_base_frequency_the_model_runs_with(tmp_path, greedy_tokens, theta_first):
    # transformers 5 reads the base frequency only from rope_parameters: an overridden rope_theta was set beside it,
    # read by nothing, silently; and vLLM's context-extension override (rope_theta with a yarn rope_scaling) ran yarn
    # at the checkpoint's base, while a warning said the key was "added for the model to read".
    from pluginhost.testing import make_tiny_model

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    path = make_tiny_model(
        tmp_path / "500", "llama", seed=1, rope_parameters={"rope_type": "default", "rope_theta": 500.0}
    )
    as_50 = make_tiny_model(tmp_path / "50", "llama", seed=1, rope_parameters={**yarn, "rope_theta": 50.0})
    overrides = (
        {"rope_theta": 50.0, "rope_scaling": yarn} if theta_first else {"rope_scaling": yarn, "rope_theta": 50.0}
    )
    tokens = greedy_tokens(path, hf_overrides=overrides)
    assert tokens == greedy_tokens(as_50) != greedy_tokens(path, hf_overrides={"rope_scaling": yarn})
    assert greedy_tokens(path, hf_overrides={"rope_theta": 50.0}) != greedy_tokens(path)


def test_an_overridden_rope_theta_on_rope_parameters_per_layer_type_is_refused_saying_what_to_give(tmp_path):
    # Written into every layer type, it differed from a checkpoint saying so: transformers gives config.json's
    # rope_theta to Gemma 3's full-attention layers only (its sliding ones keep rope_local_base_freq).
    from transformers import AutoConfig

    from pluginhost import LLM
    from pluginhost.errors import ConfigError

    config = AutoConfig.for_model(
        "gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=384, architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"per layer type \(full_attention, sliding_attention\).*rope_parameters"):
        LLM(str(tmp_path), load_installed_plugins=False, hf_overrides={"rope_theta": 5.0})


def test_a_built_engines_hf_overrides_are_read_only_and_what_the_user_gave_is_left_as_given(tmp_path, greedy_tokens):
    from pluginhost import LLM
    from pluginhost.errors import ConfigError
    from pluginhost.testing import make_tiny_model

    theta = 500.0  # not transformers' default: the checkpoint's own must be kept
    path = make_tiny_model(
        tmp_path / "llama", "llama", seed=1, rope_parameters={"rope_type": "default", "rope_theta": theta}
    )
    mine = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # vLLM's usual override: no rope_theta
    llm = LLM(str(path), load_installed_plugins=False, device="cpu", hf_overrides=mine)
    # transformers completes a rope dict in place: on a copy, never the user's; the base frequency is the config's
    assert mine == {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert llm.hf_config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": theta}
    complete = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": theta}}
    tokens = greedy_tokens(path, hf_overrides=mine)
    assert tokens == greedy_tokens(path, hf_overrides=complete) != greedy_tokens(path)
    refused = r"EngineConfig.hf_overrides cannot change once the engine is built"
    with pytest.raises(ConfigError, match=refused):
        llm.config.hf_overrides["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ConfigError, match=refused):
        llm.config.hf_overrides["rope_scaling"]["factor"] = 4.0  # the model would go on with 2
    with pytest.raises(ConfigError, match=refused):
        llm.config.hf_overrides.update(max_position_embeddings=8)
    assert llm.config.hf_overrides == mine
    for copied in (llm.config.model_copy(), llm.config.model_copy(deep=True)):  # a copy describes no engine yet
        copied.hf_overrides["rope_scaling"]["factor"] = 4.0
        assert copied.hf_overrides["rope_scaling"]["factor"] == 4.0
    assert llm.config.hf_overrides == mine


def test_absurd_sizes_are_refused_before_transformers_reads_the_config(tmp_path, run_pluginhost):
    """Qwen2's config builds a list of its layers' kinds while it is read: 10**10 layers never came back."""
    import json

    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**10}))
    result = run_pluginhost("config", "--model", str(tmp_path), "--no-plugins", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "num_hidden_layers is 10000000000, outside 1..4096" in result.stderr
    assert "Traceback" not in result.stderr


def test_hf_overrides_mend_a_size_too_large_in_config_json(tiny_opt, tmp_path, capsys):
    """The check before transformers reads the file counts the overrides, as the message advises them."""
    import json
    import shutil

    from pluginhost.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_opt, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**25}))
    assert main(["config", "--model", str(model), "--no-plugins"]) == 2
    assert "max_position_embeddings is 33554432, outside 1..16777216. Fix config.json (or --hf-overrides)" in (
        capsys.readouterr().err
    )
    mended = ["--hf-overrides", '{"max_position_embeddings": 64}', "--json"]
    assert main(["config", "--model", str(model), "--no-plugins", *mended]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["max_model_len"] == 64
