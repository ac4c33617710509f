"""``RequestOutput``: the result of one prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RequestOutput"]


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result, in the order prompts were given."""

    prompt_token_ids: list[int]
    #: Generated token ids only (a stop or end-of-sequence token that ended generation included).
    token_ids: list[int]
    #: The generated text (special tokens skipped), or ``None`` without a tokenizer.
    text: str | None
    #: ``None``, or one ``{token_id: logprob}`` per generated token (the chosen one and the top k).
    logprobs: list[dict[int, float]] | None
    #: ``"length"`` (max_tokens reached) or ``"stop"`` (end-of-sequence or a stop token).
    finish_reason: Literal["length", "stop"]
