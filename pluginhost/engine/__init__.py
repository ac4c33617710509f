"""The engine: building the model, the loop that batches requests continuously, and its front-ends.

* ``LLM`` (offline, vLLM's API) and ``AsyncLLM`` (streaming, for servers);
* ``core``: the engine loop; ``scheduler``: who runs; ``runner``: the forward
  passes and the KV cache; ``sampler``: the next token; ``detokenizer``: text;
* ``loader``: the build through the plugin hooks; ``inputs``: checked requests.
"""

from pluginhost.engine.llm import LLM

__all__ = ["LLM"]
