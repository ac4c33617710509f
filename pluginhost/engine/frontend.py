"""What ``LLM`` and ``AsyncLLM`` share: the built model and what is known about it."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from pluginhost.config import EngineConfig
from pluginhost.engine.core import EngineCore
from pluginhost.engine.inputs import InputProcessor
from pluginhost.engine.loader import LoadedModel
from pluginhost.host import PluginHost, PluginRecord
from pluginhost.registry import Registration

__all__ = ["EngineFrontend"]


class EngineFrontend:
    """A built model with its engine loop; subclasses say how requests come in."""

    engine: EngineCore

    def _start(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self.engine = EngineCore(loaded)
        self._inputs = InputProcessor(loaded)
        self._request_ids = itertools.count()

    def _new_request_id(self) -> str:
        return f"{type(self).__name__.lower()}-{next(self._request_ids)}"

    @property
    def model(self) -> nn.Module:
        """The constructed model."""
        return self._loaded.model

    @property
    def config(self) -> EngineConfig:
        """The final ``EngineConfig`` (``config.provenance`` says who set each field)."""
        return self._loaded.config

    @property
    def hf_config(self) -> Any:
        return self._loaded.hf_config

    @property
    def architecture(self) -> str:
        return self._loaded.architecture

    @property
    def registration(self) -> Registration:
        return self._loaded.registration

    @property
    def plugins(self) -> list[PluginRecord]:
        return self._loaded.plugins

    @property
    def plugin_host(self) -> PluginHost:
        """The plugins of this engine (and the way to call their hooks)."""
        return self._loaded.host

    @property
    def tokenizer(self) -> Any:
        return self._loaded.tokenizer

    @property
    def device(self) -> torch.device:
        return self._loaded.device

    @property
    def dtype(self) -> torch.dtype:
        return self._loaded.dtype

    @property
    def max_model_len(self) -> int:
        return self._loaded.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._loaded.vocab_size

    def get_tokenizer(self) -> Any:
        """The model directory's tokenizer (a transformers tokenizer), or ``None`` without one."""
        return self._loaded.tokenizer

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.config.model!r}, architecture={self.architecture!r}, "
            f"device={self.device}, dtype={self.dtype})"
        )
