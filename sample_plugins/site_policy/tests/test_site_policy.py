"""The site policy, tested with pluginhost's pytest fixtures."""

import pluginhost_site_policy
import pytest

from pluginhost import EngineConfig
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
    assert str(llm.model.lm_head.weight.dtype) == "torch.bfloat16"
    with pytest.raises(ValueError, match="more than max_model_len=32"):
        llm.generate([[2] * 30], None)


def test_leaves_smaller_settings_alone(make_host):
    config = EngineConfig(model="m", max_num_seqs=2)
    make_host(pluginhost_site_policy).call("modify_config", config=config)
    assert config.max_num_seqs == 2 and config.provenance["max_num_seqs"] == "user"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("PLUGINHOST_SITE_MAX_NUM_SEQS", "lots", "PLUGINHOST_SITE_MAX_NUM_SEQS='lots' must be a positive integer"),
        ("PLUGINHOST_SITE_DTYPE", "float64", "PLUGINHOST_SITE_DTYPE=.float64.: dtype: Input should be"),
    ],
)
def test_a_bad_variable_stops_the_engine_naming_the_plugin(make_host, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(PluginHookError, match=message) as info:
        make_host(pluginhost_site_policy).call("modify_config", config=EngineConfig(model="m"))
    assert info.value.plugin == "pluginhost_site_policy"
