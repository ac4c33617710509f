"""Batch-level logits processors, with vLLM v1's interface.

The engine keeps its running sequences in a persistent batch: row i of the
logits is the sequence in row i. Between two steps, sequences finish and
leave, new ones join, and the batch is compacted; a ``BatchUpdate`` describes
that, to be applied in this order: ``added``, then ``removed``, then
``moved``. (A new sequence may take the row of one that finished in the same
update; that row is then in ``added`` and not in ``removed``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from pluginhost.sampling import SamplingParams

__all__ = ["AddedRequest", "BatchUpdate", "MoveDirectionality"]


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
