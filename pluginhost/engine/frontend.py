"""What ``LLM`` and ``AsyncLLM`` share: the built model and what is known about it."""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from pluginhost.config import EngineConfig, take_vllm_settings
from pluginhost.device import resolve_device
from pluginhost.engine.core import EngineCore
from pluginhost.engine.inputs import InputProcessor
from pluginhost.engine.loader import LoadedModel, load_model, validated_config
from pluginhost.errors import InvalidParameterError
from pluginhost.host import PluginHost, PluginRecord
from pluginhost.registry import Registration
from pluginhost.sampling import SamplingParams

if TYPE_CHECKING:
    from pluginhost.engine.parallel import Ranks

__all__ = ["EngineFrontend", "no_lora_or_priority"]

#: Seconds ``close`` waits for a step in flight before ending a tensor-parallel engine's ranks regardless.
_CLOSE_WAIT_S = 10.0


class EngineFrontend:
    """A built model with its engine loop; subclasses say how requests come in."""

    engine: EngineCore | None = None

    def __init__(
        self,
        model: str,
        *,
        plugins: Sequence[object] = (),
        load_installed_plugins: bool = True,
        **settings: Any,
    ) -> None:
        settings = take_vllm_settings({"model": model, **settings})  # before any plugin loads: a port's settings
        host = PluginHost(plugins=plugins, load_installed=load_installed_plugins)
        self._build(host, settings)

    @classmethod
    def _from_host(cls, host: PluginHost, **settings: Any) -> Self:
        """An engine on a host the caller configured (the CLI's plugin selection)."""
        frontend = cls.__new__(cls)
        frontend._build(host, take_vllm_settings(settings))  # the test kit's make_engine takes a port's too
        return frontend

    def _build(self, host: PluginHost, settings: dict[str, Any]) -> None:
        """Build the model (on every rank, with tensor parallelism) and start the engine on it.

        On a rank other than 0 (under torchrun) this serves rank 0's steps until rank 0's engine
        closes, and the frontend is left unable to generate.
        """
        config = validated_config(settings)
        if config.tensor_parallel_size == 1:
            self._start(load_model(host, settings))
            return
        from pluginhost.engine.parallel import build_parallel, serve_steps

        loaded, ranks = build_parallel(host, settings, config.tensor_parallel_size, resolve_device(config.device))
        if ranks.rank == 0:
            self._start(loaded, ranks)
            return
        self._loaded, self._ranks = loaded, ranks
        try:
            serve_steps(loaded, ranks)
        except Exception as exc:  # the model's or a plugin's code on this rank: named, as rank 0 names its own
            from pluginhost.engine.core import blame

            error = blame(loaded, exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            ranks.close()

    def _start(self, loaded: LoadedModel, ranks: Ranks | None = None) -> None:
        self._loaded = loaded
        self._ranks = ranks
        try:
            self.engine = EngineCore(loaded, ranks)
            self._inputs = InputProcessor(loaded)
        except BaseException:
            # No engine reaches the caller to be closed: end the other ranks here, or they would live as long as
            # this process, which could start no other tensor-parallel engine (it stays in their group).
            if ranks is not None:
                ranks.close()
            raise
        self._request_ids = itertools.count()
        self._built_in = os.getpid()  # ``os.fork`` copies an engine without its threads
        if ranks is not None:  # the other ranks end with this engine, or with the interpreter at the latest
            self._finalizer = weakref.finalize(self, ranks.close)

    def close(self) -> None:
        """End the engine's other processes (tensor parallelism); nothing to do otherwise. Idempotent.

        A step another thread runs is waited for (up to ``_CLOSE_WAIT_S``, then the ranks are ended regardless):
        its message to the ranks and the stop message, sent at once on one channel, interleaved, so a rank read
        one's size and the other's bytes. That thread's next step then says the engine was closed.
        """
        ranks = getattr(self, "_ranks", None)
        if ranks is None:
            return
        engine = getattr(self, "engine", None)
        if engine is None:
            ranks.close()
            return
        with engine.between_steps(timeout=_CLOSE_WAIT_S):
            ranks.close()

    def _check_generates(self) -> None:
        built_in = getattr(self, "_built_in", None)
        if built_in is not None and built_in != os.getpid():
            # A forked child has the engine's objects but none of its threads (AsyncLLM's loop: a request waited
            # for ever) and torch's thread pool in a state the child cannot use (LLM's first product hung).
            raise RuntimeError(
                f"this engine was built in process {built_in}, before it forked this one ({os.getpid()}): its "
                "threads did not come with it. Build the engine in this process (after the fork), or start "
                "processes with multiprocessing's 'spawn' or 'forkserver' method"
            )
        if getattr(self, "engine", None) is None:
            raise RuntimeError(
                f"this is rank {self.rank} of a tensor-parallel engine, whose rank 0 has closed it: only rank 0 "
                "generates (check pluginhost.distributed.get_rank() == 0 before generating)"
            )

    @property
    def rank(self) -> int:
        """This process's rank (0 without tensor parallelism; only rank 0 generates)."""
        ranks = getattr(self, "_ranks", None)
        return ranks.rank if ranks is not None else 0

    def _new_request_id(self) -> str:
        """A fresh id, never one a running request holds (a caller may have chosen ``asyncllm-3`` itself)."""
        while True:
            request_id = f"{type(self).__name__.lower()}-{next(self._request_ids)}"
            if not self.engine.is_running(request_id):
                return request_id

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
    def input_processor(self) -> InputProcessor:
        """What checks prompts and parameters and turns them into engine requests."""
        return self._inputs

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

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields the model's ``generation_config.json`` recommends (``generation_config=
        "auto"``; vLLM's ``get_diff_sampling_param()``): a request's defaults, where it leaves a field out."""
        return dict(self._loaded.sampling_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` a prompt given none runs with, as vLLM's: ``sampling_defaults`` over
        ``SamplingParams()``'s own."""
        return SamplingParams(**self._loaded.sampling_defaults)

    def get_tokenizer(self) -> Any:
        """The model directory's tokenizer (a transformers tokenizer), or ``None`` without one."""
        return self._loaded.tokenizer

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.config.model!r}, architecture={self.architecture!r}, "
            f"device={self.device}, dtype={self.dtype})"
        )


def no_lora_or_priority(lora_request: object, priority: object = None, prompts: int | None = None) -> None:
    """Refuse vLLM's ``lora_request`` and ``priority`` (a list, one per of ``prompts``) when they ask for something:
    a port passes ``None`` (and every priority 0)."""
    if lora_request is not None:
        raise InvalidParameterError(
            f"lora_request={lora_request!r} is not supported by pluginhost (it serves no LoRA adapters; only None): "
            "see docs/porting-from-vllm.md",
            param="lora_request",
        )
    if priority is None:
        return
    if isinstance(priority, str | bytes) or not isinstance(priority, Sequence):
        raise InvalidParameterError(
            f"priority must be a list of ints, one per prompt, got {type(priority).__name__}", param="priority"
        )
    if prompts is not None and len(priority) != prompts:
        raise InvalidParameterError(
            f"priority lists {len(priority)} priorities for {prompts} prompt(s): give one per prompt", param="priority"
        )
    if any(p != 0 for p in priority):
        raise InvalidParameterError(
            "priority is not supported by pluginhost (requests run first come, first served, as vLLM's default "
            "scheduling; only None or every priority 0)",
            param="priority",
        )
