"""The decoding loop: one batch of sequences, prefill then token by token.

Prompts of different lengths are left-padded to a common length P, so every
sequence writes its t-th step into the same cache slot P + t. The mask keeps
padding out of every real token's attention; a padding token attends only to
itself, which keeps its (unused) activations finite.

A model with ``setup_caches`` decodes from its static cache; one without
(a minimal plugin model) is re-run over the whole sequence each step.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pluginhost.detokenizer import IncrementalDetokenizer
from pluginhost.outputs import CompletionOutput, FinishReason
from pluginhost.sampler import SamplingState, sample, top_logprobs

__all__ = ["Sequence", "generate_batch"]


@dataclass
class Sequence:
    """One sample being generated for one request: its tokens, text and why it ended."""

    sample_index: int
    prompt_token_ids: list[int]
    sampling: SamplingState
    #: Most tokens to generate (``max_tokens``, or what ``max_model_len`` leaves).
    max_tokens: int
    detokenizer: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def params(self):  # -> SamplingParams
        return self.sampling.params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprobs: Tensor | None, vocab_size: int) -> None:
        """Take the next token (and the step's log-probabilities (V,), when asked for); decide whether to stop."""
        self.token_ids.append(token)
        self.sampling.record(token, vocab_size, logprobs.device if logprobs is not None else torch.device("cpu"))
        if logprobs is not None:
            assert self.params.logprobs is not None
            if self.logprobs is None:
                self.logprobs, self.cumulative_logprob = [], 0.0
            step = top_logprobs(logprobs, token, self.params.logprobs)
            self.logprobs.append(step)
            self.cumulative_logprob += step[token]
        may_stop = len(self.token_ids) >= self.params.min_tokens
        stop_string = None
        if self.detokenizer is not None:
            stop_string = self.detokenizer.push(token, check_stop=may_stop)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        elif may_stop and token in self.sampling.stop_ids:
            self.finish_reason = "stop"
            self.stop_reason = token if token in (self.params.stop_token_ids or ()) else None
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        if self.finished and self.detokenizer is not None and stop_string is None:
            self.detokenizer.flush()

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.sample_index,
            text=self.detokenizer.text if self.detokenizer is not None else None,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@torch.inference_mode()
def generate_batch(model: nn.Module, sequences: SequenceOf[Sequence], device: torch.device, vocab_size: int) -> None:
    """Decode ``sequences`` together, filling in their tokens, logprobs and finish reasons."""
    B = len(sequences)
    P = max(len(s.prompt_token_ids) for s in sequences)
    N = max(s.max_tokens for s in sequences)
    ids = torch.zeros(B, P, dtype=torch.long)
    positions = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P + N, dtype=torch.bool)  # which cache slots hold real tokens
    for i, s in enumerate(sequences):
        L = len(s.prompt_token_ids)
        ids[i, P - L :] = torch.tensor(s.prompt_token_ids)
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

    want_logprobs = any(s.params.logprobs is not None for s in sequences)
    all_ids, all_positions = ids, positions
    for step in range(N):
        # Log-probabilities of the model's own distribution: before the sampler changes the logits.
        logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        tokens = sample(logits, [s.sampling for s in sequences]).tolist()
        for i, s in enumerate(sequences):
            if not s.finished:
                row = logprobs[i] if logprobs is not None and s.params.logprobs is not None else None
                s.append(tokens[i], row, vocab_size)
        if all(s.finished for s in sequences) or step == N - 1:
            break
        slot = P + step
        valid[:, slot] = True
        next_ids = torch.tensor(tokens, device=device)[:, None]  # (B, 1)
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
