"""The vLLM-style plugin, tested with pluginhost's pytest fixtures (in-process, as a register() function)."""

from pluginhost_vllm_style import register

from pluginhost import SamplingParams

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
