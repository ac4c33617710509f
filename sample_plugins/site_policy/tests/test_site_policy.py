"""The site policy, tested with pluginhost's pytest fixtures."""

import pluginhost_site_policy
import pytest

from pluginhost import EngineConfig, SamplingParams
from pluginhost.errors import PluginHookError


def test_caps_batch_size_by_default(make_host):
    config = EngineConfig(model="m", max_num_seqs=64)
    make_host(pluginhost_site_policy).call("modify_config", config=config)
    assert config.max_num_seqs == 8
    assert config.provenance["max_num_seqs"] == "plugin:pluginhost_site_policy"


def test_caps_context_and_forces_dtype_from_the_environment(make_engine, monkeypatch):
    monkeypatch.setenv("PLUGINHOST_SITE_MAX_MODEL_LEN", "32")
    monkeypatch.setenv("PLUGINHOST_SITE_DTYPE", "bfloat16")
    llm = make_engine(pluginhost_site_policy)
    assert llm.max_model_len == 32 and llm.config.dtype == "bfloat16"
    assert llm.config.provenance["max_model_len"] == "plugin:pluginhost_site_policy"
    assert str(llm.model.lm_head.weight.dtype) == "torch.bfloat16"
    capped = llm.generate([[2] * 30], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert (len(capped.token_ids), capped.finish_reason) == (2, "length")  # ends at the capped context
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len=32"):
        llm.generate([[2] * 32], None)


def test_a_dtype_the_user_chose_already_stays_the_users(make_host, monkeypatch):
    # "half" is float16: the user's --dtype float16 was shown as set by the plugin, which changed nothing.
    monkeypatch.setenv("PLUGINHOST_SITE_DTYPE", "half")
    config = EngineConfig(model="m", dtype="float16")
    make_host(pluginhost_site_policy).call("modify_config", config=config)
    assert (config.dtype, config.provenance["dtype"]) == ("float16", "user")
    config = EngineConfig(model="m", dtype="float32")
    make_host(pluginhost_site_policy).call("modify_config", config=config)
    assert (config.dtype, config.provenance["dtype"]) == ("float16", "plugin:pluginhost_site_policy")


def test_a_context_cap_above_the_models_positions_leaves_its_length_be(make_engine, monkeypatch):
    # The cap became the length asked for: every model shorter than the cap failed to load.
    monkeypatch.setenv("PLUGINHOST_SITE_MAX_MODEL_LEN", "4096")
    llm = make_engine(pluginhost_site_policy)
    assert llm.max_model_len == 128 and llm.config.provenance["max_model_len"] == "default"


def test_leaves_smaller_settings_alone(make_host):
    config = EngineConfig(model="m", max_num_seqs=2)
    make_host(pluginhost_site_policy).call("modify_config", config=config)
    assert config.max_num_seqs == 2 and config.provenance["max_num_seqs"] == "user"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("PLUGINHOST_SITE_MAX_NUM_SEQS", "lots", "PLUGINHOST_SITE_MAX_NUM_SEQS='lots' must be a positive integer"),
        # A digit to str.isdigit, not to int(): it was int()'s own error, naming no variable.
        ("PLUGINHOST_SITE_MAX_NUM_SEQS", "²", "PLUGINHOST_SITE_MAX_NUM_SEQS='²' must be a positive integer"),
        (
            "PLUGINHOST_SITE_DTYPE",
            "float64",
            "PLUGINHOST_SITE_DTYPE=.float64.: dtype: 'float64' is not a dtype pluginhost runs",
        ),
    ],
)
def test_a_bad_variable_stops_the_engine_naming_the_plugin(make_host, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(PluginHookError, match=message) as info:
        make_host(pluginhost_site_policy).call("modify_config", config=EngineConfig(model="m"))
    assert info.value.plugin == "pluginhost_site_policy"
