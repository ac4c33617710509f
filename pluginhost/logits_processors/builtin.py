"""vLLM's ``vllm.v1.sample.logits_processor.builtin``, under pluginhost's name: its helper for processors.

vLLM's builtin processors (min_p, min_tokens, logit_bias) are not here: pluginhost's sampler applies
those settings itself.
"""

from pluginhost.logits_processors import process_dict_updates

__all__ = ["process_dict_updates"]
