"""``RequestOutput`` and ``CompletionOutput``: what a request produced, shaped as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CompletionOutput", "FinishReason", "RequestOutput"]

#: "length" (max_tokens or max_model_len reached), "stop" (end-of-sequence, a stop token or a stop
#: string), or "abort" (``AsyncLLM.abort``, a client that went away, a shutdown).
FinishReason = Literal["length", "stop", "abort"]


@dataclass
class CompletionOutput:
    """One sample of a request (``SamplingParams.n`` of them)."""

    #: Which sample this is, 0 to n - 1.
    index: int
    #: The generated text (special tokens skipped, cut before a stop string), or ``None`` without a tokenizer.
    text: str | None
    #: Generated token ids only (a stop or end-of-sequence token that ended generation included).
    token_ids: list[int]
    #: ``None``, or one ``{token_id: logprob}`` per generated token (the chosen one and the top k).
    logprobs: list[dict[int, float]] | None = None
    #: Sum of the chosen tokens' log-probabilities, when ``logprobs`` was asked for.
    cumulative_logprob: float | None = None
    #: Why it ended (``FinishReason``), or ``None`` while it is still running.
    finish_reason: FinishReason | None = None
    #: What stopped it: the stop string, the stop token id, or ``None`` (end-of-sequence, length).
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result, in the order prompts were given.

    ``text``, ``token_ids``, ``logprobs`` and ``finish_reason`` are those of
    ``outputs[0]``, for callers that ask for one sample.
    """

    request_id: str
    #: The prompt as given when it was text, else ``None``.
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Whether every sample has finished."""
        return all(o.finished for o in self.outputs)

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason
