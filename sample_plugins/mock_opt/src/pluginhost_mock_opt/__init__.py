"""pluginhost-mock-opt: the seed discussion's mock OPT, as a pluginhost plugin.

Registers ``MockOPTForCausalLM``: the builtin OPT, except that it always
predicts one token (``mock_token_id`` in the HF config, default 7). Select it
with ``--model-architecture-override MockOPTForCausalLM``. The target is a lazy
string, so listing plugins and models does not import torch.
"""

from pluginhost import hookimpl

__all__ = ["ARCHITECTURE", "register_models"]

ARCHITECTURE = "MockOPTForCausalLM"


@hookimpl
def register_models(registry):
    registry.register_model(ARCHITECTURE, "pluginhost_mock_opt.model:MockOPTForCausalLM")
