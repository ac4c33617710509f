"""pluginhost-vllm-style: a general plugin written the way vLLM plugins are.

It defines no hook at all: importing it (which pluginhost does when loading
installed plugins) calls ``ModelRegistry.register_model``, replacing the
builtin ``OPTForCausalLM`` for every OPT checkpoint, exactly as the seed
discussion suggested. pluginhost records the registration as this plugin's
and applies it only to engines where this plugin is loaded.

The replacement bans tokens: ids listed in the model config's
``banned_token_ids`` (set with ``--hf-overrides '{"banned_token_ids": [..]}'``)
are never generated.
"""

from pluginhost import ModelRegistry

ModelRegistry.register_model("OPTForCausalLM", "pluginhost_vllm_style.model:BannedTokensOPT")
