"""The mock OPT plugin, tested with pluginhost's pytest fixtures."""

import pluginhost_mock_opt
import pytest
from pluginhost_mock_opt.model import DEFAULT_TOKEN_ID, MockOPTForCausalLM

from hookspecs import BUILD_HOOKS
from pluginhost import SamplingParams
from pluginhost.errors import ModelClassError


def test_registers_its_architecture_lazily(make_host):
    entry = make_host(pluginhost_mock_opt).collect_models().get("MockOPTForCausalLM")
    assert entry.implementation == "pluginhost_mock_opt.model:MockOPTForCausalLM"
    assert entry.registered_by.name == "pluginhost_mock_opt"


def test_always_predicts_the_mock_token(make_engine, hook_recorder):
    llm = make_engine(pluginhost_mock_opt, model_architecture_override="MockOPTForCausalLM")
    assert isinstance(llm.model, MockOPTForCausalLM)
    outs = llm.generate(["Hello", [2, 100, 7]], SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True))
    assert [o.token_ids for o in outs] == [[DEFAULT_TOKEN_ID] * 4] * 2
    assert hook_recorder.names() == list(BUILD_HOOKS)
    assert hook_recorder.last("pre_load").kwargs["model_class"] is MockOPTForCausalLM


def test_the_token_comes_from_the_config(make_engine):
    llm = make_engine(
        pluginhost_mock_opt, model_architecture_override="MockOPTForCausalLM", hf_overrides={"mock_token_id": 42}
    )
    out = llm.generate([[2, 5]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == [42, 42, 42]


def test_without_the_override_the_builtin_runs(make_engine):
    llm = make_engine(pluginhost_mock_opt)
    assert type(llm.model).__name__ == "OPTForCausalLM"


@pytest.mark.parametrize("token", [99999, -1, "7", True])
def test_a_token_outside_the_vocabulary_is_refused_when_the_model_is_built(make_engine, token):
    # 99999 was taken, and every generation then failed with an IndexError.
    with pytest.raises(ModelClassError, match=r"mock_token_id must be a token id in \[0, \d+\)"):
        make_engine(
            pluginhost_mock_opt, model_architecture_override="MockOPTForCausalLM", hf_overrides={"mock_token_id": token}
        )
