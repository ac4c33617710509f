"""Choosing the next token of each sequence from its logits, as vLLM's v1 sampler does.

In order, on a batch of rows (one per sequence) of float32 logits:

1. logits processors that may change the most likely token (plugins');
2. ``min_tokens``: the sequence's stop tokens are masked until it has that many;
3. penalties: repetition (prompt and output tokens), frequency and presence
   (output tokens only);
4. greedy rows take the most likely token; the others are divided by their
   temperature, then go through the processors that never change the most
   likely token (skipped when every row is greedy), and are filtered by
   ``min_p``, ``top_k`` and ``top_p`` and drawn from their own random stream.

Rows that need none of steps 1-3 cost nothing there, and an all-greedy batch
without them is one ``argmax``. A row whose state is ``None`` gets no token
(its sequence waits this step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from pluginhost.sampling import SamplingParams

__all__ = ["Processor", "SamplingState", "sample", "top_logprobs"]


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence besides its parameters."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: Sequence[int]
    #: Tokens that end the sequence (end-of-sequence unless ignored, and ``stop_token_ids``).
    stop_ids: frozenset[int]
    vocab_size: int
    device: torch.device
    num_generated: int = 0
    #: Per-token counts of the generated tokens (V,), kept only when a penalty needs them.
    output_counts: Tensor | None = None
    #: Tokens of the prompt (V,), kept only for the repetition penalty.
    prompt_mask: Tensor | None = field(default=None, repr=False)

    def record(self, token: int) -> None:
        """Count a generated token."""
        self.num_generated += 1
        if self.params.penalized:
            if self.output_counts is None:
                self.output_counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            self.output_counts[token] += 1


class Processor(Protocol):
    """What the sampler needs of a logits processor."""

    def apply(self, logits: Tensor) -> Tensor: ...

    def is_argmax_invariant(self) -> bool: ...


def sample(
    logits: Tensor, states: Sequence[SamplingState | None], processors: Sequence[Processor] = ()
) -> list[int | None]:
    """One token per row of ``logits`` (B, V), float32 (``None`` where the state is ``None``)."""
    live = [(i, s) for i, s in enumerate(states) if s is not None]
    rows = [i for i, _ in live]
    changing = [p for p in processors if not p.is_argmax_invariant()]
    keeping = [p for p in processors if p.is_argmax_invariant()]
    masked = [(i, s) for i, s in live if s.num_generated < s.params.min_tokens and s.stop_ids]
    penalized = [(i, s) for i, s in live if s.params.penalized]
    if changing or masked or penalized:
        logits = logits.clone()  # the model's own tensor stays as it returned it
    for processor in changing:
        logits = processor.apply(logits)
    for i, state in masked:  # an end-of-sequence id a config puts beyond the vocabulary cannot be sampled anyway
        logits[i, [t for t in state.stop_ids if t < logits.shape[-1]]] = float("-inf")
    for i, state in penalized:
        _apply_penalties(logits[i], state)
    tokens: list[int | None] = [None] * len(states)
    if all(s.params.greedy for _, s in live):
        chosen = (logits if len(rows) == len(states) else logits[rows]).argmax(dim=-1).tolist()
        for i, token in zip(rows, chosen, strict=True):
            tokens[i] = token
        return tokens
    scaled = logits
    if keeping:  # after temperature, on the whole batch, as vLLM applies them
        temperatures = torch.tensor(
            [s.params.temperature if s is not None and not s.params.greedy else 1.0 for s in states],
            dtype=logits.dtype,
            device=logits.device,
        )
        scaled = logits / temperatures[:, None]
        for processor in keeping:
            scaled = processor.apply(scaled)
    for i, state in live:
        if state.params.greedy:
            tokens[i] = int(logits[i].argmax())
        else:
            row = scaled[i] if keeping else logits[i] / state.params.temperature
            tokens[i] = int(_draw(row, state.params, state.generator))
    return tokens


def _apply_penalties(logits: Tensor, state: SamplingState) -> None:
    """vLLM's (and, for repetition, transformers') penalties on one row (V,), in place."""
    p = state.params
    V = logits.shape[-1]
    counts = state.output_counts if state.output_counts is not None else torch.zeros(V, device=logits.device)
    if p.repetition_penalty != 1.0:
        if state.prompt_mask is None:
            ids = torch.tensor([t for t in state.prompt_token_ids if t < V], dtype=torch.long, device=logits.device)
            state.prompt_mask = torch.zeros(V, dtype=torch.bool, device=logits.device).index_fill_(0, ids, True)
        seen = state.prompt_mask | (counts > 0)
        penalized = _repetition(logits, p.repetition_penalty, seen)
        if penalized.isposinf().any() and not logits.isposinf().any():  # the penalty overflowed float32 (5 / 1e-38)
            penalized = _without_overflow(logits, p.repetition_penalty, seen)
        logits.copy_(penalized)
    if p.frequency_penalty != 0.0:
        logits.sub_(counts * p.frequency_penalty)
    if p.presence_penalty != 0.0:
        logits.sub_((counts > 0).to(logits.dtype) * p.presence_penalty)


def _repetition(logits: Tensor, penalty: float, seen: Tensor) -> Tensor:
    """transformers' repetition penalty: a seen token's logit divided by ``penalty`` if positive, else multiplied."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def _without_overflow(logits: Tensor, penalty: float, seen: Tensor) -> Tensor:
    """The repetition penalty where float32 overflows: the same distribution, its ranks kept.

    In float64, shifted so its top is 0 (softmax does not change; what lies far below becomes -inf);
    a penalty that overflows float64 too (1e-320) leaves only the order of the raw logits: the seen
    token(s) of the largest positive one.
    """
    wide = _repetition(logits.double(), penalty, seen)
    infinite = wide.isposinf()
    if infinite.any():
        top = logits[infinite].max()
        return torch.zeros_like(logits).masked_fill_(~(infinite & (logits == top)), float("-inf"))
    return (wide - wide.max()).float()


def _draw(logits: Tensor, p: SamplingParams, generator: torch.Generator) -> Tensor:
    """Min-p, top-k and top-p on temperature-scaled logits (V,), then a draw from the sequence's own stream."""
    if p.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # (V,), (V,)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
        drop_sorted = probs.cumsum(dim=-1) - probs >= p.top_p
        drop_sorted[0] = False  # a top_p below float32's smallest value (1e-300) rounds to 0 and would drop it
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    try:
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[0]
    except RuntimeError:  # the probabilities are NaN: checked only then, so a normal draw pays nothing
        at_infinity = logits.isposinf()
        if not at_infinity.any():
            raise
        # +inf from a logits processor ("this token, surely"), or a temperature that overflowed float32: the
        # distribution's limit puts all its mass on the tokens at +inf, equally.
        return torch.multinomial(at_infinity.float(), 1, generator=generator)[0]


def top_logprobs(logprobs: Tensor, chosen: int, k: int) -> dict[int, float]:
    """``{token: logprob}`` for the chosen token and the ``k`` most likely ones; ``logprobs`` is (V,)."""
    result = {chosen: float(logprobs[chosen])}
    if k > 0:
        values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        result.update(zip(indices.tolist(), values.tolist(), strict=True))
    return result
