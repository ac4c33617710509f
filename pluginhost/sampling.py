"""``SamplingParams``: how one request is decoded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request; invalid values raise ``ValueError`` at once.

    * ``max_tokens``: most tokens to generate (>= 1).
    * ``temperature``: 0 is greedy; higher flattens the distribution.
    * ``top_p``: nucleus sampling, in (0, 1]; 1 keeps every token.
    * ``top_k``: keep the k most likely tokens; 0 keeps all.
    * ``seed``: the request's own random stream: the same seed gives the same
      output, whatever else is in the batch. ``None`` uses the engine's stream.
    * ``logprobs``: ``None``, or k >= 0: each generated step reports the
      log-probabilities (of the model's distribution, before temperature and
      filtering) of the chosen token and of the k most likely tokens.
    * ``stop_token_ids``: generation stops after any of these (it is included).
    * ``ignore_eos``: keep generating past the end-of-sequence token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

        check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}",
        )
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        check(self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}")
        check(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            f"logprobs must be None or an integer >= 0, got {self.logprobs!r}",
        )
        stop = tuple(self.stop_token_ids)
        check(all(_is_int(t) and t >= 0 for t in stop), f"stop_token_ids must be token ids >= 0, got {list(stop)!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    import math

    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
