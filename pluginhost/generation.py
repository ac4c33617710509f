"""The decoding loop: one batch of requests, prefill then token by token.

Prompts of different lengths are left-padded to a common length P, so every
sequence writes its t-th step into the same cache slot P + t. The mask keeps
padding out of every real token's attention; a padding token attends only to
itself, which keeps its (unused) activations finite.

A model with ``setup_caches`` decodes from its static cache; one without
(a minimal plugin model) is re-run over the whole sequence each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from pluginhost.sampler import next_tokens, top_logprobs
from pluginhost.sampling import SamplingParams

__all__ = ["Request", "generate_batch"]


@dataclass
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: Literal["length", "stop"] | None = None

    def append(self, token: int, logprobs: Tensor | None) -> None:
        self.token_ids.append(token)
        if logprobs is not None:
            assert self.params.logprobs is not None
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(top_logprobs(logprobs, token, self.params.logprobs))
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"


@torch.inference_mode()
def generate_batch(model: nn.Module, requests: Sequence[Request], device: torch.device) -> None:
    """Decode ``requests`` together, filling in their tokens, logprobs and finish reasons."""
    B = len(requests)
    P = max(len(r.prompt_token_ids) for r in requests)
    N = max(r.params.max_tokens for r in requests)
    ids = torch.zeros(B, P, dtype=torch.long)
    positions = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P + N, dtype=torch.bool)  # which cache slots hold real tokens
    for i, r in enumerate(requests):
        L = len(r.prompt_token_ids)
        ids[i, P - L :] = torch.tensor(r.prompt_token_ids)
        positions[i, P - L :] = torch.arange(L)
        valid[i, P - L : P] = True
    ids, positions, valid = ids.to(device), positions.to(device), valid.to(device)
    prefill_mask = _causal_mask(valid, P)  # (B, 1, P, P)

    cached = callable(getattr(model, "setup_caches", None))
    if cached:
        _ensure_caches(model, B, P + N)
        hidden = model(ids, positions, torch.arange(P, device=device), prefill_mask)  # (B, P, W)
    else:
        hidden = model(ids, positions, None, prefill_mask)
    logits = model.compute_logits(hidden[:, -1]).float()  # (B, V)

    want_logprobs = any(r.params.logprobs is not None for r in requests)
    all_ids, all_positions = ids, positions
    for step in range(N):
        tokens = next_tokens(logits, [r.params for r in requests], [r.generator for r in requests])
        logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        for i, r in enumerate(requests):
            if r.finish_reason is None:
                r.append(
                    int(tokens[i]), logprobs[i] if logprobs is not None and r.params.logprobs is not None else None
                )
        if all(r.finish_reason is not None for r in requests) or step == N - 1:
            break
        slot = P + step
        valid[:, slot] = True
        next_ids = tokens[:, None]  # (B, 1)
        next_positions = positions[:, -1:] + step + 1  # (B, 1)
        if cached:
            mask = valid[:, None, None, : slot + 1]  # (B, 1, 1, S)
            hidden = model(next_ids, next_positions, torch.tensor([slot], device=device), mask)
        else:
            all_ids = torch.cat([all_ids, next_ids], dim=1)  # (B, P + step + 1)
            all_positions = torch.cat([all_positions, next_positions], dim=1)
            hidden = model(all_ids, all_positions, None, _causal_mask(valid, all_ids.shape[1]))
        logits = model.compute_logits(hidden[:, -1]).float()  # (B, V)


def _causal_mask(valid: Tensor, T: int) -> Tensor:
    """(B, 1, T, T): each of the first T slots attends to the real ones up to itself, and to itself.

    Attending to itself keeps a padding token's (unused) activations finite.
    """
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    itself = torch.eye(T, dtype=torch.bool, device=valid.device)
    return (causal & (valid[:, None, :T] | itself)).unsqueeze(1)


def _ensure_caches(model: nn.Module, batch_size: int, seq_len: int) -> None:
    """Set up (or grow) the model's static caches; reused while they are large enough."""
    have = getattr(model, "_pluginhost_cache_shape", (0, 0))
    if have[0] >= batch_size and have[1] >= seq_len:
        return
    shape = (max(have[0], batch_size), max(have[1], _round_up(seq_len, 256)))
    model.setup_caches(*shape)
    model._pluginhost_cache_shape = shape  # type: ignore[attr-defined]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
