"""pluginhost: a plugin framework, built on pluggy, for an LLM inference engine.

Importing this package is cheap: torch and transformers are imported only when
an engine is built (``LLM``), and pydantic when a configuration is (``EngineConfig``),
so listing plugins and models stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from hookspecs import hookimpl
from pluginhost.errors import PluginhostError
from pluginhost.registry import ModelRegistry

if TYPE_CHECKING:
    from pluginhost.config import EngineConfig
    from pluginhost.engine import LLM
    from pluginhost.engine.async_llm import AsyncLLM
    from pluginhost.inputs import TextPrompt, TokensPrompt
    from pluginhost.outputs import CompletionOutput, RequestOutput
    from pluginhost.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "ModelRegistry",
    "PluginhostError",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
    "hookimpl",
]

# Names whose modules import torch or pydantic: resolved on first access (PEP 562).
_LAZY = {
    "AsyncLLM": "pluginhost.engine.async_llm",
    "CompletionOutput": "pluginhost.outputs",
    "EngineConfig": "pluginhost.config",
    "LLM": "pluginhost.engine",
    "SamplingParams": "pluginhost.sampling",
    "RequestOutput": "pluginhost.outputs",
    "TextPrompt": "pluginhost.inputs",
    "TokensPrompt": "pluginhost.inputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pluginhost' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
