"""``RequestOutput`` and ``CompletionOutput``: what a request produced, shaped as in vLLM."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CompletionOutput", "FinishReason", "RequestOutput", "TokenLogprobs", "text_after"]

#: "length" (max_tokens or max_model_len reached), "stop" (end-of-sequence, a stop token or a stop
#: string), or "abort" (``AsyncLLM.abort``, a client that went away, a shutdown).
FinishReason = Literal["length", "stop", "abort"]

logger = logging.getLogger("pluginhost")


class TokenLogprobs(dict[int, float]):
    """One token's ``{token_id: logprob}`` (the token's own first, then the top k, the most likely first): a
    ``dict``, read-only, that knows each entry's rank in the vocabulary (``rank``, ``ranks()``).

    Every output of a request holds the same one for a token, the engine's own: built once, never copied
    (a streamed answer of thousands of tokens is handed out after each of them). Read it as any dict;
    to change it, make a copy (``dict(logprobs)``) and change that.
    """

    __slots__ = ("rank", "_in_top")

    def __init__(
        self, entries: Mapping[int, float] | None = None, /, *, rank: int | None = None, in_top: bool = False
    ) -> None:
        super().__init__(entries or {})
        #: The rank of the token this entry is for (the chosen one, or the prompt's) in the whole vocabulary, as
        #: vLLM's ``Logprob.rank``: 1 for the most likely; among the top k its place there, else how many tokens
        #: are at least as likely as it (itself included). ``None``: not known (built by hand).
        self.rank = rank
        #: Whether that token is one of the top k too (then the entries are the k, that token's first).
        self._in_top = in_top

    def ranks(self) -> dict[int, int]:
        """Every entry's rank in the vocabulary (vLLM's ``Logprob.rank``): the token's own (``rank``), and the top
        k's places, 1 to k; empty when ``rank`` is not known."""
        if self.rank is None:
            return {}
        own, *top = self
        places = (place for place in range(1, len(self) + 1) if not (self._in_top and place == self.rank))
        return {own: self.rank, **dict(zip(top, places, strict=False))}

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "a token's logprobs are read-only (every output of the request shares them with the engine): "
            "change a copy, dict(logprobs)"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only  # type: ignore[assignment]

    def copy(self) -> dict[int, float]:
        """A plain dict with the same entries, to change."""
        return dict(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle and deepcopy: built at once, not filled item by item
        return _rebuilt, (dict(self), self.rank, self._in_top)


def _rebuilt(entries: dict[int, float], rank: int | None, in_top: bool) -> TokenLogprobs:
    return TokenLogprobs(entries, rank=rank, in_top=in_top)


@dataclass
class CompletionOutput:
    """One sample of a request (``SamplingParams.n`` of them)."""

    #: Which sample this is, 0 to n - 1.
    index: int
    #: The generated text (special tokens skipped, cut before a stop string), ``""`` with ``detokenize=False``,
    #: or ``None`` without a tokenizer.
    text: str | None
    #: Generated token ids only (a stop or end-of-sequence token that ended generation included).
    token_ids: list[int]
    #: Sum of the chosen tokens' log-probabilities, when ``logprobs`` was asked for.
    cumulative_logprob: float | None = None
    #: ``None``, or one ``{token_id: logprob}`` per generated token (the chosen one and the top k; each a
    #: read-only ``TokenLogprobs``). The list is the output's own.
    logprobs: list[dict[int, float]] | None = None
    #: Why it ended (``FinishReason``), or ``None`` while it is still running.
    finish_reason: FinishReason | None = None
    #: What stopped it: the stop string, the stop token id, or ``None`` (end-of-sequence, length).
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        """Whether this sample has ended (a method, as in vLLM; ``RequestOutput.finished`` is an attribute there)."""
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
    #: The output's own copy of the prompt's token ids (changing it changes nothing else).
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    #: ``None``, or with ``prompt_logprobs``, one entry per prompt token: ``None`` for the first (nothing precedes
    #: it), then its ``{token_id: logprob}`` given the tokens before it (the prompt's token and the top k; each a
    #: read-only ``TokenLogprobs``). The list is the output's own.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        """Whether every sample has finished."""
        return all(o.finished() for o in self.outputs)

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


def text_after(sent: str, text: str, request_id: str) -> str:
    """What of ``text`` (a choice's text so far) a stream has not sent yet, given it sent ``sent``.

    The text only grows, unless an ``on_output`` hook changed the final output's text (it runs once
    the request has finished): what was sent cannot be taken back, so the rest follows the end of
    the sent text where the changed text still has it, and nothing more where it does not.
    """
    if text.startswith(sent):
        return text[len(sent) :]
    # Where an end of the sent text (8 to 32 characters; shorter only if none is found) is in the changed
    # text, ending nearest to where the sent text ended: repeated text has it more than once.
    cut = None
    longest = min(len(sent), 32)
    for sizes in (range(longest, min(longest, 8) - 1, -1), range(min(longest, 8) - 1, 0, -1)):
        found = [
            (abs(at + size - len(sent)), -size, at + size) for size in sizes for at in _occurrences(text, sent[-size:])
        ]
        if found:
            cut = min(found)[2]
            break
    logger.warning(
        "%s: an on_output hook changed text the stream had already sent; the client keeps what it got%s",
        request_id,
        "" if cut is not None else ", and no more of this choice's text",
    )
    return text[cut:] if cut is not None else ""


def _occurrences(text: str, part: str) -> list[int]:
    """Where ``part`` starts in ``text``, every time."""
    found, at = [], text.find(part)
    while at >= 0:
        found.append(at)
        at = text.find(part, at + 1)
    return found
