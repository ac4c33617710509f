"""Choosing the next token of each sequence from its logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pluginhost.sampling import SamplingParams

__all__ = ["next_tokens", "top_logprobs"]


def next_tokens(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Tensor:
    """One token per row of ``logits`` (B, V), float32; returns (B,) token ids."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for i, (row, p, generator) in enumerate(zip(logits, params, generators, strict=True)):
        tokens[i] = row.argmax() if p.greedy else _sample(row, p, generator)
    return tokens


def _sample(logits: Tensor, p: SamplingParams, generator: torch.Generator) -> Tensor:
    """Temperature, then top-k, then top-p, then a draw from the request's own stream."""
    logits = logits / p.temperature  # (V,)
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # (V,), (V,)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
        drop_sorted = probs.cumsum(dim=-1) - probs >= p.top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def top_logprobs(logprobs: Tensor, chosen: int, k: int) -> dict[int, float]:
    """``{token: logprob}`` for the chosen token and the ``k`` most likely ones; ``logprobs`` is (V,)."""
    result = {chosen: float(logprobs[chosen])}
    if k > 0:
        values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        result.update(zip(indices.tolist(), values.tolist(), strict=True))
    return result
