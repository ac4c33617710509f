"""Batch-level logits processors, with vLLM v1's interface.

A plugin adds processor classes in its ``register_logits_processors`` hook;
the engine makes one instance of each per engine and, every step:

1. ``update_state(batch_update)``: how the batch changed since the last step
   (``None`` if it did not);
2. ``apply(logits)`` on the step's (batch, vocab) logits, row i being the
   sequence in row i of the batch, before penalties and sampling (processors
   that are ``is_argmax_invariant()`` are skipped when every row decodes
   greedily). Rows that get no token this step (they wait while newcomers'
   prompts are prefilled) hold zeros, and what ``apply`` makes of them is
   not used;
3. ``validate_params(params)``, a class method, for every new request.

The engine keeps its running sequences in a persistent batch. Between two
steps, sequences finish and leave, new ones join, and the batch is compacted;
a ``BatchUpdate`` describes that, to be applied in vLLM's order: ``removed``,
then ``added``, then ``moved``. (A new sequence may take the row of one
that finished in the same update; that row is then in ``added`` and not in
``removed``, so the first two never touch the same row.)

A vLLM v1 processor ports by changing its imports: its
``__init__(vllm_config, device, is_pin_memory)`` gets pluginhost's
``EngineConfig``, the device, and ``False``. vLLM's helpers for writing one
are here too: ``process_dict_updates`` (per-row state that follows the
batch) and ``AdapterLogitsProcessor``, which runs a per-request function
(a ``RequestLogitsProcessor``) on each row that has one; and, for tests
that drive a processor by hand, ``BatchUpdateBuilder``. vLLM's submodules
``interface``, ``builtin`` and ``state`` exist under this package with the
same names in them, so ``vllm.v1.sample.logits_processor.X`` becomes
``pluginhost.logits_processors.X`` for every import a processor makes
(vLLM's builtin processors are not among them: pluginhost's sampler does
min_p, min_tokens and the rest itself).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from pluginhost.attribution import PluginRef, current_plugin
from pluginhost.errors import RegistryError
from pluginhost.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = [
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitsProcessor",
    "LogitsProcessorRegistry",
    "MoveDirectionality",
    "MovedRequest",
    "RegisteredProcessor",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "process_dict_updates",
]

T = TypeVar("T")

#: The rows that get a token in the step being sampled (``None``: every row), while the engine applies
#: the processors; ``AdapterLogitsProcessor`` calls a request's function only when its row gets one.
_STEP_ROWS: ContextVar[frozenset[int] | None] = ContextVar("pluginhost_step_rows", default=None)


@contextmanager
def step_rows(rows: Sequence[int] | None) -> Iterator[None]:
    """Within the block, only ``rows`` get a token (the engine's prefill steps; ``None``: every row)."""
    token = _STEP_ROWS.set(frozenset(rows) if rows is not None else None)
    try:
        yield
    finally:
        _STEP_ROWS.reset(token)


class MoveDirectionality(StrEnum):
    """How a row moved: ``"move"`` (a -> b, a is left empty) or ``"swap"`` (a <-> b)."""

    UNIDIRECTIONAL = "move"
    SWAP = "swap"


#: (row, params, prompt token ids, output token ids): the output list is the sequence's own,
#: growing as it generates.
AddedRequest = tuple[int, SamplingParams, Sequence[int], Sequence[int]]
#: A row that left the batch.
RemovedRequest = int
#: (from, to, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the previous step (vLLM v1's ``BatchUpdate``)."""

    #: Rows in the batch after the update.
    batch_size: int
    # vLLM's order, so that one built positionally (a ported test) means the same.
    removed: Sequence[RemovedRequest] = field(default_factory=list)
    added: Sequence[AddedRequest] = field(default_factory=list)
    moved: Sequence[MovedRequest] = field(default_factory=list)


class BatchUpdateBuilder:
    """Collects one step's changes to the batch and makes the ``BatchUpdate`` (vLLM's builder of that name).

    As in vLLM: removals are appended first (``removed_append``); once ``removed`` is read (sorted,
    highest row first) or a row is taken back with ``pop_removed`` (the lowest, for a newcomer to
    reuse), no more removals may be appended until ``get_and_reset`` starts the next step.
    """

    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed = removed or []
        self.added = added or []
        self.moved = moved or []
        self._sorted = False
        #: Whether anything changed since the last reset (vLLM tracks it for batches without ``added``).
        self.batch_changed = False

    @property
    def removed(self) -> list[RemovedRequest]:
        """The removed rows, highest first."""
        self._sort()
        return self._removed

    def _sort(self) -> None:
        if not self._sorted:
            self._removed.sort(reverse=True)
            self._sorted = True

    def removed_append(self, index: RemovedRequest) -> None:
        """Record that row ``index`` left the batch; refused once the removals were read."""
        if self._sorted:
            raise RuntimeError("Cannot register new removed request after self.removed has been read.")
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> RemovedRequest | None:
        """The lowest removed row, or ``None``."""
        if not self._removed:
            return None
        self._sort()
        return self._removed[-1]

    def pop_removed(self) -> RemovedRequest | None:
        """Take back the lowest removed row (a newcomer reuses it), or ``None``."""
        if not self._removed:
            return None
        self._sort()
        return self._removed.pop()

    def reset(self) -> bool:
        """Forget the step's changes; whether there were any."""
        changed = self.batch_changed
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        self._sorted = self.batch_changed = False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The step's ``BatchUpdate`` for a batch of ``batch_size`` rows (``None``: nothing changed); starts afresh."""
        self._sorted = self.batch_changed = False
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved)
        self._removed, self.added, self.moved = [], [], []
        return update


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
        """Follow the batch: ``removed``, then ``added``, then ``moved`` (``None``: nothing changed)."""


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, Sequence[int] | None, Sequence[int]], T | None],
) -> bool:
    """Make per-row state (``req_entries``, row -> state) follow the batch, as vLLM's helper of this name does.

    An added row gets ``new_state(params, prompt_token_ids, output_token_ids)`` (``None``: no entry);
    a removed row loses its entry; a moved row takes its entry along (a swap exchanges two). Returns
    whether any entry changed.
    """
    if batch_update is None:
        return False
    changed = False
    for row, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[row] = state
            changed = True
        elif req_entries.pop(row, None) is not None:  # a row reused by a request without state
            changed = True
    for row in batch_update.removed:
        if req_entries.pop(row, None) is not None:
            changed = True
    for source, target, direction in batch_update.moved:
        moving, displaced = req_entries.pop(source, None), req_entries.pop(target, None)
        if moving is not None:
            req_entries[target] = moving
            changed = True
        if displaced is not None:
            changed = True
            if direction == MoveDirectionality.SWAP:
                req_entries[source] = displaced
    return changed


#: A per-request processor: ``(output_token_ids, logits_row) -> logits_row``, or with the prompt's ids
#: first, ``(prompt_token_ids, output_token_ids, logits_row) -> logits_row`` (vLLM's ``RequestLogitsProcessor``).
RequestLogitsProcessor = Callable[..., "torch.Tensor"]


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch processor made of per-request functions (vLLM's ``AdapterLogitsProcessor``).

    Subclasses say which function, if any, each request gets (``new_req_logits_processor``) and whether
    those functions keep the most likely token (``is_argmax_invariant``); ``apply`` runs each row's
    function on that row, with the request's output token ids so far (a list that grows).
    """

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool = False) -> None:
        self.config, self.device = config, device
        self._rows: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The function for a request with these parameters, or ``None`` to leave its rows alone."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._bind)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # As in vLLM, a request's function runs once per token it gets: not on rows that wait this step.
        stepping = _STEP_ROWS.get()
        for row, process in self._rows.items():
            if stepping is None or row in stepping:
                logits[row] = process(logits[row])
        return logits

    def _bind(
        self, params: SamplingParams, prompt_ids: Sequence[int] | None, output_ids: Sequence[int]
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        process = self.new_req_logits_processor(params)
        if process is None:
            return None
        if _positional_parameters(process)[0] >= 3:  # as vLLM reads it: *args is not the three-argument form
            return lambda row: process(prompt_ids, output_ids, row)
        return lambda row: process(output_ids, row)


def _positional_parameters(function: Callable[..., Any]) -> tuple[int, bool]:
    """How many named positional parameters ``function`` takes, and whether it takes ``*args`` too."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: taken as two named ones
        return 2, False
    named = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
    return named, any(p.kind is p.VAR_POSITIONAL for p in parameters)


@dataclass(frozen=True)
class RegisteredProcessor:
    """A processor class and the plugin that added it."""

    cls: type[LogitsProcessor]
    registered_by: PluginRef

    def describe(self) -> str:
        return f"logits processor {self.cls.__qualname__} ({self.registered_by.describe()})"

    def instantiate(self, config: Any, device: torch.device) -> LogitsProcessor:
        """``cls(config, device)``, with ``is_pin_memory=False`` for vLLM's three-argument form."""
        named, any_number = _positional_parameters(self.cls.__init__)
        if named - 1 >= 3 or any_number:  # self aside
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
