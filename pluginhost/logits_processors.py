"""Batch-level logits processors, with vLLM v1's interface.

A plugin adds processor classes in its ``register_logits_processors`` hook;
the engine makes one instance of each per engine and, every step:

1. ``update_state(batch_update)``: how the batch changed since the last step
   (``None`` if it did not);
2. ``apply(logits)`` on the step's (batch, vocab) logits, row i being the
   sequence in row i of the batch, before penalties and sampling (processors
   that are ``is_argmax_invariant()`` are skipped when every row decodes
   greedily). Rows that get no token this step (they wait while newcomers'
   prompts are prefilled) hold no meaningful values;
3. ``validate_params(params)``, a class method, for every new request.

The engine keeps its running sequences in a persistent batch. Between two
steps, sequences finish and leave, new ones join, and the batch is compacted;
a ``BatchUpdate`` describes that, to be applied in this order: ``added``,
then ``removed``, then ``moved``. (A new sequence may take the row of one
that finished in the same update; that row is then in ``added`` and not in
``removed``.)

A vLLM v1 processor ports by changing its imports: its
``__init__(vllm_config, device, is_pin_memory)`` gets pluginhost's
``EngineConfig``, the device, and ``False``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pluginhost.attribution import PluginRef, current_plugin
from pluginhost.errors import RegistryError
from pluginhost.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = [
    "AddedRequest",
    "BatchUpdate",
    "LogitsProcessor",
    "LogitsProcessorRegistry",
    "MoveDirectionality",
    "RegisteredProcessor",
]


class MoveDirectionality(StrEnum):
    """How a row moved: ``"move"`` (a -> b, a is left empty) or ``"swap"`` (a <-> b)."""

    UNIDIRECTIONAL = "move"
    SWAP = "swap"


#: (row, params, prompt token ids, output token ids): the output list is the sequence's own,
#: growing as it generates.
AddedRequest = tuple[int, SamplingParams, Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the previous step (vLLM v1's ``BatchUpdate``)."""

    #: Rows in the batch after the update.
    batch_size: int
    added: Sequence[AddedRequest] = field(default_factory=list)
    removed: Sequence[int] = field(default_factory=list)
    #: (from, to, directionality).
    moved: Sequence[tuple[int, int, MoveDirectionality]] = field(default_factory=list)


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM v1's ``LogitsProcessor``)."""

    @abstractmethod
    def __init__(self, config: Any, device: torch.device) -> None:
        """One instance per engine: ``config`` is the engine's ``EngineConfig``."""

    @classmethod  # noqa: B027 - optional to override, as in vLLM
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ``ValueError`` to refuse a request whose options (``params.extra_args``) this processor rejects."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Change the step's (batch, vocab) logits (in place or not); return them."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when ``apply`` never changes the most likely token (then greedy batches skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch: ``added``, then ``removed``, then ``moved`` (``None``: nothing changed)."""


@dataclass(frozen=True)
class RegisteredProcessor:
    """A processor class and the plugin that added it."""

    cls: type[LogitsProcessor]
    registered_by: PluginRef

    def describe(self) -> str:
        return f"logits processor {self.cls.__qualname__} ({self.registered_by.describe()})"

    def instantiate(self, config: Any, device: torch.device) -> LogitsProcessor:
        """``cls(config, device)``, with ``is_pin_memory=False`` for vLLM's three-argument form."""
        params = list(inspect.signature(self.cls.__init__).parameters.values())[1:]
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params):
            return self.cls(config, device, False)  # type: ignore[call-arg]
        return self.cls(config, device)


class LogitsProcessorRegistry:
    """The logits processors of one engine, in the order they were added (and so applied)."""

    def __init__(self) -> None:
        self._entries: list[RegisteredProcessor] = []

    def add(self, cls: type[LogitsProcessor]) -> None:
        """Add a ``LogitsProcessor`` subclass (the same class twice is added once)."""
        source = current_plugin() or PluginRef("<unknown>")
        if not (inspect.isclass(cls) and issubclass(cls, LogitsProcessor)):
            raise RegistryError(
                f"registry.add() takes a subclass of pluginhost.logits_processors.LogitsProcessor, got {cls!r}"
            )
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise RegistryError(f"logits processor {cls.__qualname__} does not implement {missing}")
        if all(entry.cls is not cls for entry in self._entries):
            self._entries.append(RegisteredProcessor(cls, source))

    def entries(self) -> list[RegisteredProcessor]:
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
