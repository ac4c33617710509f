"""vLLM's ``vllm.v1.sample.logits_processor.interface``, under pluginhost's name (the classes live in the package)."""

from pluginhost.logits_processors import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest", "RemovedRequest"]
