"""pluginhost-vllm-style: a general plugin written the way vLLM plugins are.

It defines no hook at all: its entry point names ``register``, a function
taking no arguments (vLLM's ``vllm.general_plugins`` shape), which calls
``ModelRegistry.register_model`` to replace the builtin ``OPTForCausalLM``
for every OPT checkpoint, exactly as the seed discussion suggested.
pluginhost calls it when it loads the plugin, records the registration as
this plugin's, and applies it only to engines where this plugin is selected.

The replacement bans tokens: ids listed in the model config's
``banned_token_ids`` (set with ``--hf-overrides '{"banned_token_ids": [..]}'``)
are never generated.
"""

from pluginhost import ModelRegistry

__all__ = ["register"]


def register():
    ModelRegistry.register_model("OPTForCausalLM", "pluginhost_vllm_style.model:BannedTokensOPT")
