"""Which process of a tensor-parallel engine this is, for plugins.

With ``tensor_parallel_size=N`` every one of the N processes (ranks) loads its
plugins itself and runs every build hook, so a plugin's code runs N times, once
per process. Most plugins need not care; one that must do something once (write
a file, call a service) does it where ``get_rank() == 0``. Without tensor
parallelism, the rank is 0 and the world size 1.

Cheap: nothing here imports torch.
"""

from __future__ import annotations

import os
from contextvars import ContextVar

__all__ = ["get_rank", "get_world_size", "launched_world_size", "torchrun_rank"]

#: (rank, world size) while an engine's ranks run in this process; ``None``: none runs.
_running: tuple[int, int] | None = None

#: (rank, world size) of the engine whose hook is running, set by its plugin host while it calls the hook: an
#: engine that is not split, beside a split one in the same process, is rank 0 of 1 in its own hooks.
_in_hook: ContextVar[tuple[int, int] | None] = ContextVar("pluginhost_engine_ranks", default=None)


def _current() -> tuple[int, int]:
    return _in_hook.get() or _running or (0, 1)


def get_rank() -> int:
    """This process's rank among the engine's processes (0 in the process that schedules).

    Under a launcher (torchrun) a process keeps its rank after its engine stops, so
    ``if get_rank() == 0:`` around generating holds on every process for the rest of its life.
    """
    return _current()[0]


def get_world_size() -> int:
    """How many processes the engine's model is split over (``tensor_parallel_size``).

    In a hook, that hook's engine's: an engine that is not split, built while a split one is open in the
    same process, is 1 in its own hooks. Elsewhere (a logits processor, code outside any hook), that of
    the split engine open in this process, else 1.
    """
    return _current()[1]


def _set(rank: int, world_size: int) -> None:
    """Set by the engine as it starts its processes."""
    global _running
    _running = (rank, world_size)


def _clear() -> None:
    """Called when the engine's processes stop: back to 0 of 1, unless a launcher started this process as a rank."""
    global _running
    if torchrun_rank() is None:
        _running = None


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting ``RANK`` and ``WORLD_SIZE``) started it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ["RANK"])
        except ValueError:
            return None
    return None


def launched_world_size() -> int | None:
    """``WORLD_SIZE`` as the launcher set it (``None`` without a launcher)."""
    if torchrun_rank() is None:
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        return None
