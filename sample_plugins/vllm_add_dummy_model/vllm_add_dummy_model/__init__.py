# Ported from vLLM's tests/plugins/vllm_add_dummy_model: only the import changed
# (vllm -> pluginhost). vLLM's version also registers MyGemma2Embedding and MyLlava, which build
# on vLLM-internal pooling and multimodal interfaces that pluginhost does not have
# (see docs/porting-from-vllm.md).

from pluginhost import ModelRegistry


def register():
    # Test directly passing the model
    from .my_opt import MyOPTForCausalLM

    if "MyOPTForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("MyOPTForCausalLM", MyOPTForCausalLM)
