"""The architectures that ship with pluginhost, registered as a plugin.

This module is itself a plugin, loaded by every engine before any installed
one, and it uses the same ``register_models`` hook as everybody else: a plugin
that registers one of these names replaces the builtin. Targets are lazy
strings, so listing models does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookspecs import hookimpl

if TYPE_CHECKING:
    from pluginhost.registry import ArchitectureRegistry

__all__ = ["BUILTIN_ARCHITECTURES", "register_models"]

#: Architecture name -> lazy implementation. ``TransformersForCausalLM`` is the fallback that serves
#: any architecture transformers' ``AutoModelForCausalLM`` can build (``EngineConfig.model_impl``).
BUILTIN_ARCHITECTURES = {
    "OPTForCausalLM": "builtin_models.opt:OPTForCausalLM",
    "LlamaForCausalLM": "builtin_models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "builtin_models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "builtin_models.llama:Qwen2ForCausalLM",
    "GPT2LMHeadModel": "builtin_models.gpt2:GPT2LMHeadModel",
    "TransformersForCausalLM": "builtin_models.transformers_fallback:TransformersForCausalLM",
}


@hookimpl
def register_models(registry: ArchitectureRegistry) -> None:
    for architecture, implementation in BUILTIN_ARCHITECTURES.items():
        registry.register_model(architecture, implementation)
