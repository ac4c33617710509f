"""Errors pluginhost raises for problems the user can fix.

Every ``PluginhostError`` carries one complete message: what is wrong and what
to do about it. The CLI prints it alone (exit status 2); anything else that
escapes is an internal failure (exit status 1). As in vLLM, errors about bad
settings, an unknown architecture or an unusable model directory are also
``ValueError``s, so code written against vLLM catches them unchanged.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EngineOverloadedError",
    "InvalidParameterError",
    "KVCacheMemoryError",
    "ModelClassError",
    "ModelRunError",
    "PluginError",
    "PluginHookError",
    "PluginLoadError",
    "PluginSelectionError",
    "PluginhostError",
    "PromptTooLongError",
    "RegistryError",
    "RequestRefusedError",
    "TensorParallelError",
    "UnknownArchitectureError",
]


class PluginhostError(Exception):
    """Base class of the errors a user can act on."""


class PluginSelectionError(PluginhostError):
    """The plugin allow-list names something that is not installed."""


class PluginError(PluginhostError):
    """A plugin is broken: it failed to import or does not match the hook specs."""


class PluginLoadError(PluginError):
    """An installed plugin failed to import or to validate, and the engine refuses to start."""


class PluginHookError(PluginError):
    """A hook implementation raised; the engine build was aborted."""

    def __init__(self, message: str, *, plugin: str, hook: str) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook


class RequestRefusedError(PluginHookError, ValueError):
    """A plugin's ``on_request`` refused a request (a ``ValueError``: the server answers 400)."""


class RegistryError(PluginhostError, ValueError):
    """A model registration is malformed (a ``ValueError``, as in vLLM)."""


class UnknownArchitectureError(RegistryError):
    """No plugin registered the requested architecture."""


class ModelClassError(RegistryError):
    """A registered model target cannot be imported or lacks the model interface."""


class ModelRunError(PluginhostError, RuntimeError):
    """The model raised while generating (its forward pass or logits)."""


class TensorParallelError(PluginhostError, RuntimeError):
    """A rank of a tensor-parallel engine failed, died, disagreed with the others or did not answer in time."""


class EngineOverloadedError(PluginhostError):
    """The engine's waiting queue is full; the request was refused (a server answers 503)."""


class ConfigError(PluginhostError, ValueError):
    """The engine configuration or the model directory's config is invalid (a ``ValueError``, as in vLLM)."""


class CheckpointError(PluginhostError, ValueError):
    """The model directory's weights are missing, unreadable or do not fit the model."""


class InvalidParameterError(PluginhostError, ValueError):
    """A sampling parameter has a value the engine refuses; ``param`` names the ``SamplingParams`` field.

    A ``ValueError``, as vLLM raises for bad parameters; a server answers 400 naming the API's field.
    """

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(PluginhostError, ValueError):
    """A prompt, with the tokens asked of it, does not fit in ``max_model_len`` (a server: 400,
    ``context_length_exceeded``)."""


class KVCacheMemoryError(PluginhostError, RuntimeError):
    """The KV cache cannot grow to what a step needs in the memory left (``pluginhost.engine.memory``).

    ``rows`` and ``slots`` are what it can have: the engine preempts running sequences longer than
    ``slots`` (ending only those the memory cannot hold even alone) and holds back the newcomers
    beyond ``rows``; the others go on. ``fitting_rows`` (``rows`` unless given): how many sequences
    of ``slots`` tokens the memory really holds, fewer than ``rows`` when not even the sequences
    running (or one) can reach that length; those then run until the memory runs out.
    """

    def __init__(self, message: str, *, rows: int, slots: int, fitting_rows: int | None = None) -> None:
        super().__init__(message)
        self.rows, self.slots = rows, slots
        self.fitting_rows = rows if fitting_rows is None else fitting_rows
