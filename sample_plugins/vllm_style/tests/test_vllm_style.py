"""The vLLM-style plugin, tested with pluginhost's pytest fixtures."""

import importlib

from pluginhost import ModelRegistry, SamplingParams


def load_plugin():
    """Import the plugin as pluginhost would, attributing its import-time registration."""
    from pluginhost.attribution import PluginRef, acting_as

    with acting_as(PluginRef("vllm_style")):
        import pluginhost_vllm_style

        return importlib.reload(pluginhost_vllm_style)


def test_overrides_the_builtin_opt(make_engine):
    plugin = load_plugin()
    try:
        llm = make_engine(plugin)
        assert type(llm.model).__name__ == "BannedTokensOPT"
    finally:
        ModelRegistry._entries.pop("OPTForCausalLM", None)


def test_banned_tokens_are_never_generated(make_engine):
    plugin = load_plugin()
    try:
        free = make_engine(plugin).generate([[2, 5, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        banned = sorted(set(free[0].token_ids))
        llm = make_engine(plugin, hf_overrides={"banned_token_ids": banned})
        out = llm.generate([[2, 5, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert not set(out.token_ids) & set(banned)
    finally:
        ModelRegistry._entries.pop("OPTForCausalLM", None)
