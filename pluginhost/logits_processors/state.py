"""vLLM's ``vllm.v1.sample.logits_processor.state``, under pluginhost's name: the batch-update builder."""

from pluginhost.logits_processors import BatchUpdateBuilder

__all__ = ["BatchUpdateBuilder"]
