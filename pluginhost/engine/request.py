"""A request inside the engine: its samples (sequences), their tokens, text and state.

A request of ``SamplingParams.n`` samples is ``n`` sequences, each scheduled
on its own (one row of the running batch, one row of the KV cache). They are
built by the caller's thread, then handed to the engine loop, which alone
changes them until they finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pluginhost.engine.sampler import SamplingState, top_logprobs
from pluginhost.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprobs

if TYPE_CHECKING:
    from torch import Tensor

    from pluginhost.engine.detokenizer import IncrementalDetokenizer
    from pluginhost.engine.runner import PromptScores
    from pluginhost.sampling import SamplingParams

__all__ = ["EngineRequest", "OutputCallback", "Sequence"]

#: Called by the engine loop with a request's cumulative output after each step that changed it,
#: or with the error that ended it.
OutputCallback = Callable[["RequestOutput | None", "BaseException | None"], None]


@dataclass(eq=False)
class Sequence:
    """One sample being generated: its tokens, text, where it runs, and why it ended."""

    request: EngineRequest
    index: int
    sampling: SamplingState
    #: Most tokens to generate (``max_tokens``, or what ``max_model_len`` leaves).
    max_tokens: int
    detokenizer: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    #: Tokens whose keys and values are in the KV cache (0 until it is prefilled, and again once preempted).
    num_computed: int = 0
    #: Its row in the running batch and in the KV cache, while it runs.
    row: int | None = None
    #: When its latest token was sampled (``time.monotonic()``): the gap to the next is an inter-token latency.
    last_token_time: float | None = None

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_token_ids(self) -> list[int]:
        """What a prefill step puts in the cache: the prompt, and the tokens generated before a preemption."""
        return self.prompt_token_ids + self.token_ids if self.token_ids else self.prompt_token_ids

    def append(self, token: int, logprobs: Tensor | None) -> None:
        """Take the next token (and the step's log-probabilities (V,), when asked for); decide whether to stop."""
        self.token_ids.append(token)
        self.sampling.record(token)
        if logprobs is not None:
            assert self.params.logprobs is not None
            if self.logprobs is None:
                self.logprobs, self.cumulative_logprob = [], 0.0
            step = top_logprobs(logprobs, token, self.params.logprobs)  # shared by every output
            self.logprobs.append(step)
            self.cumulative_logprob += step[token]
        if len(self.token_ids) >= self.params.min_tokens and token in self.sampling.stop_ids:
            # End-of-sequence or a stop token id: kept in token_ids, left out of the text (as vLLM does), unless the
            # stop is to be in the output (a special token's text is still skipped).
            self.finish_reason = "stop"
            self.stop_reason = token if token in (self.params.stop_token_ids or ()) else None
            if self.detokenizer is not None:
                if self.params.include_stop_str_in_output:  # its text may complete a stop string: then that ended it
                    found = self.detokenizer.push(token, check_stop=len(self.token_ids) > self.params.min_tokens)
                    if found is not None:
                        self.stop_reason = found
                self.detokenizer.flush()
            return
        stop_string = None
        if self.detokenizer is not None:
            # Past min_tokens, as vLLM has it: the sampler holds end-of-sequence and stop ids back until
            # min_tokens are out, so the first token that may end the answer is the one after them.
            stop_string = self.detokenizer.push(token, check_stop=len(self.token_ids) > self.params.min_tokens)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        if self.finished and self.detokenizer is not None and stop_string is None:
            self.detokenizer.flush()

    def output(self, *, streaming: bool = False) -> CompletionOutput:
        """A snapshot of the sample so far: its lists are its own, each token's logprobs read-only.

        While streaming an unfinished sample, trailing text that may still turn out to start a stop
        string is held back.
        """
        text = None if self.params.detokenize else ""  # as vLLM: empty, not missing (a model without a tokenizer)
        if self.detokenizer is not None:
            text = self.detokenizer.text
            held = self.detokenizer.stop_buffer if streaming and not self.finished else 0
            text = text[: max(0, len(text) - held)] if held else text
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass(eq=False)
class EngineRequest:
    """One prompt and its ``n`` sequences, from submission to the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence] = field(default_factory=list)
    #: Where outputs go (``None``: the caller collects them when the request is finished).
    on_output: OutputCallback | None = None
    #: Whether ``on_output`` gets text that may still be cut by a stop string (streaming) or not.
    streaming: bool = False
    #: Called once, by the thread that steps the engine, when the request has ended (finished, aborted or failed):
    #: a caller waiting for many requests counts them instead of looking at each after every step.
    on_end: Callable[[], None] | None = None
    #: When the request arrived (``time.monotonic()``): when it was made, unless the caller says (a server: when
    #: the HTTP request came in, so latencies count the wait to be tokenized).
    arrival_time: float = field(default_factory=time.monotonic)
    #: When its first token was sampled, and when it ended (finished, failed or aborted).
    first_token_time: float | None = None
    end_time: float | None = None
    #: Why it ended early: a model failure, a plugin's error, an abort.
    error: BaseException | None = None
    aborted: bool = False
    #: Which of ``on_end`` and ``on_output`` an abort has called (each once, however often it is taken).
    abort_called: set[str] = field(default_factory=set)
    #: The output once finished, as ``on_output`` hooks left it.
    final_output: RequestOutput | None = None
    #: With ``prompt_logprobs``: the prompt's, from the step that first prefilled it (kept through preemptions).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def score_prompt(self, scores: PromptScores) -> None:
        """Take the prompt's ``prompt_logprobs`` from its scores: ``None`` for its first token, then each token's
        ``{token: logprob}`` of it and of the most likely (as a generated token's, the prompt's token first), with
        its rank."""
        chosen, top_ids, top_values = scores.chosen.tolist(), scores.top_ids.tolist(), scores.top_values.tolist()
        ranks = scores.ranks.tolist()
        logprobs: list[TokenLogprobs | None] = [None]
        steps = zip(self.prompt_token_ids[1:], chosen, ranks, top_ids, top_values, strict=True)
        for token, logprob, rank, ids, values in steps:
            step = {token: logprob}
            step.update(zip(ids, values, strict=True))
            logprobs.append(TokenLogprobs(step, rank=rank, in_top=len(step) == len(ids)))
        self.prompt_logprobs = logprobs

    @property
    def last_token_time(self) -> float | None:
        """When its latest token was sampled (``None`` before the first)."""
        return max((s.last_token_time for s in self.sequences if s.last_token_time is not None), default=None)

    @property
    def finished(self) -> bool:
        return self.error is not None or self.aborted or all(s.finished for s in self.sequences)

    def output(self) -> RequestOutput:
        """A cumulative snapshot of every sample (once finished, the final output).

        The caller's to change: its lists are copies, never the engine's (the prompt's ids run on, and are
        prefilled again after a preemption).
        """
        if self.final_output is not None:
            return self.final_output
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_token_ids),
            [s.output(streaming=self.streaming) for s in self.sequences],
            list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
        )
