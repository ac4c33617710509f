"""The vLLM-style plugin, tested with pluginhost's pytest fixtures (in-process, as a register() function)."""

import pytest
from pluginhost_vllm_style import register

from pluginhost import SamplingParams
from pluginhost.errors import ModelClassError

PROMPT = [[2, 5, 9]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_overrides_the_builtin_opt_only_where_it_is_given(make_engine):
    assert type(make_engine(register).model).__name__ == "BannedTokensOPT"
    assert type(make_engine().model).__name__ == "OPTForCausalLM"  # not leaked into an engine without it


def test_banned_tokens_are_never_generated(make_engine):
    free = make_engine().generate(PROMPT, GREEDY)[0].token_ids
    banned = sorted(set(free))
    out = make_engine(register, hf_overrides={"banned_token_ids": banned}).generate(PROMPT, GREEDY)[0]
    assert len(out.token_ids) == 6 and not set(out.token_ids) & set(banned)


@pytest.mark.parametrize("banned", [[99999], [-1], 5, ["x"]])
def test_banned_ids_outside_the_vocabulary_are_refused_when_the_model_is_built(make_engine, banned):
    # [99999] was taken, and every generation then failed with an IndexError.
    with pytest.raises(ModelClassError, match=r"banned_token_ids must be a list of token ids in \[0, \d+\)"):
        make_engine(register, hf_overrides={"banned_token_ids": banned})
