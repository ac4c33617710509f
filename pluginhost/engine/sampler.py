"""Choosing the next token of each sequence from its logits, as vLLM's v1 sampler does.

In order, on a batch of rows (one per sequence) of float32 logits:

1. the request's own token choices (``TokenChoices``): ``logit_bias`` is
   added, then every token ``allowed_token_ids`` leaves out, or that
   completes one of ``bad_words``, is masked (so a mask always wins over a
   bias, even an infinite one);
2. logits processors that may change the most likely token (plugins');
3. ``min_tokens``: the sequence's stop tokens are masked until it has that many;
4. penalties: repetition (prompt and output tokens), frequency and presence
   (output tokens only);
5. greedy rows take the most likely token; the others are divided by their
   temperature, then go through the processors that never change the most
   likely token (skipped when every row is greedy), and are filtered by
   ``min_p``, ``top_k`` and ``top_p`` and drawn from their own random stream.

Rows that need none of steps 1-4 cost nothing there, and an all-greedy batch
without them is one ``argmax``. A row whose state is ``None`` gets no token
(its sequence waits this step).

A row the processors (or the request's own choices) leave without a token to
choose (every logit -inf, or a NaN, which ``argmax`` would pick) raises
``NoTokenLeft``, naming the processor (none when the request's own choices
emptied it), before any row draws: greedy decoding would pick token 0 for ever,
sampling would fail. What the check costs (one pass over the logits after each
processor, and after the requests' choices when one may empty its row; one read
for the whole batch) is paid only then.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from pluginhost.outputs import TokenLogprobs
from pluginhost.sampling import SamplingParams

__all__ = ["NoTokenLeft", "Processor", "SamplingState", "TokenChoices", "choices_given", "sample", "top_logprobs"]


def choices_given(params: SamplingParams) -> list[str]:
    """The fields making a request's ``TokenChoices`` that ``params`` sets, in the order messages name them."""
    return [name for name in ("allowed_token_ids", "bad_words", "logit_bias") if getattr(params, name)]


@dataclass(frozen=True)
class TokenChoices:
    """What one request's ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` do to its logits.

    Made once when the engine takes the request (``pluginhost.engine.inputs``, which checks every id against
    the vocabulary), shared by its samples. Ids are (N,) long tensors on the logits' device.
    """

    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None
    allowed: Tensor | None = None
    #: The bad words of one token: banned at every step.
    banned: Tensor | None = None
    #: The bad words of several tokens, by the last token before their own last: that is banned when the output
    #: ends with the others (only the words whose prefix ends with the output's last token are compared).
    sequences: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    #: Whether these choices can leave a row no token (a mask, or a bias of -inf): then the sampler checks.
    may_empty: bool = False

    def apply(self, row: Tensor, generated: Sequence[int]) -> None:
        """Change one row of logits (V,) in place; ``generated``: the sequence's tokens so far."""
        if self.bias_ids is not None:
            row.index_add_(0, self.bias_ids, self.bias_values)
        if self.allowed is not None:
            kept = row[self.allowed]  # (A,)
            row.fill_(float("-inf")).index_copy_(0, self.allowed, kept)
        if self.banned is not None:
            row.index_fill_(0, self.banned, float("-inf"))
        for word in self.sequences.get(generated[-1], ()) if generated else ():
            if tuple(generated[-(len(word) - 1) :]) == word[:-1]:
                row[word[-1]] = float("-inf")


class _RequestChoices:
    """The stage of ``sample`` where the requests' own ``TokenChoices`` applied (a row they empty is the request's)."""


_REQUEST = _RequestChoices()


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
    #: Tokens ``min_tokens`` holds back (``None``: ``stop_ids``): end-of-sequence too when it is ignored, as vLLM.
    held_back_ids: frozenset[int] | None = None
    #: The request's ``logit_bias``, ``allowed_token_ids`` and ``bad_words``, when it has any.
    choices: TokenChoices | None = None
    #: The tokens generated so far, kept only for bad words of several tokens.
    generated: list[int] | None = field(default=None, repr=False)
    #: The held-back ids as an index tensor, made at the first step ``min_tokens`` masks them: made again at every
    #: step, a request stopping at every id of the vocabulary slowed everyone's steps 3 to 15 times.
    _stop_index: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.choices is not None and self.choices.sequences and self.generated is None:
            self.generated = []

    @property
    def held_back(self) -> frozenset[int]:
        """The tokens ``min_tokens`` holds back until that many are generated."""
        return self.stop_ids if self.held_back_ids is None else self.held_back_ids

    def stop_index(self, width: int) -> Tensor:
        """The held-back ids below ``width`` (the logits' vocabulary: an end-of-sequence id a config puts beyond it
        cannot be sampled anyway), as one index tensor."""
        if self._stop_index is None:
            ids = sorted(t for t in self.held_back if t < width)
            self._stop_index = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self._stop_index

    def record(self, token: int) -> None:
        """Count a generated token."""
        self.num_generated += 1
        if self.generated is not None:
            self.generated.append(token)
        if self.params.penalized:
            if self.output_counts is None:
                self.output_counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            self.output_counts[token] += 1


class Processor(Protocol):
    """What the sampler needs of a logits processor."""

    def apply(self, logits: Tensor) -> Tensor: ...

    def is_argmax_invariant(self) -> bool: ...


class NoTokenLeft(Exception):
    """Rows where the logits processors left no token to choose: every logit -inf, or a NaN among them.

    ``rows`` maps each such row (of the ``logits`` given to ``sample``) to the processor after which it
    held no token; a row that still held some after the processors, but only tokens the ``min_tokens``
    mask then took away, maps to every processor that changed the logits (those rows are in
    ``by_min_tokens``). A row its request's own ``TokenChoices`` emptied, or left only tokens the ``min_tokens``
    mask took away with no processor at work, maps to no processor (those rows are in ``by_request``). Raised
    before any row draws a random number: the step may run again without them.
    """

    def __init__(
        self,
        rows: dict[int, tuple[Processor, ...]],
        by_min_tokens: frozenset[int] = frozenset(),
        by_request: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(f"the logits processors or the requests' own choices left no token in rows {sorted(rows)}")
        self.rows, self.by_min_tokens, self.by_request = rows, by_min_tokens, by_request

    def renumbered(self, rows: Sequence[int]) -> NoTokenLeft:
        """The same, for ``logits`` that held only ``rows`` of a larger batch: row i here is ``rows[i]`` there."""
        return NoTokenLeft(
            {rows[i]: processors for i, processors in self.rows.items()},
            frozenset(rows[i] for i in self.by_min_tokens),
            frozenset(rows[i] for i in self.by_request),
        )


def sample(
    logits: Tensor, states: Sequence[SamplingState | None], processors: Sequence[Processor] = ()
) -> list[int | None]:
    """One token per row of ``logits`` (B, V), float32 (``None`` where the state is ``None``)."""
    live = [(i, s) for i, s in enumerate(states) if s is not None]
    rows = [i for i, _ in live]
    changing = [p for p in processors if not p.is_argmax_invariant()]
    keeping = [p for p in processors if p.is_argmax_invariant()]
    masked = [(i, s) for i, s in live if s.num_generated < s.params.min_tokens and s.held_back]
    penalized = [(i, s) for i, s in live if s.params.penalized]
    choosing = [(i, s) for i, s in live if s.choices is not None]
    if changing or masked or penalized or choosing:
        logits = logits.clone()  # the model's own tensor stays as it returned it
    #: After each processor (``None``: after the min_tokens mask; ``_REQUEST``: after the requests' own choices),
    #: which rows still hold a token to choose.
    stages: list[tuple[Processor | _RequestChoices | None, Tensor]] = []
    for i, state in choosing:
        state.choices.apply(logits[i], state.generated or ())  # type: ignore[union-attr]  # choosing: not None
    #: Rows whose own choices leave only tokens the min_tokens mask takes away: theirs, whatever processors do.
    own_fault: set[int] = set()
    if any(s.choices.may_empty for _, s in choosing):  # type: ignore[union-attr]
        stages.append((_REQUEST, _choosable(logits)))
        for i, state in masked:
            if state.choices is not None and state.choices.may_empty:
                row = logits[i].index_fill(0, state.stop_index(logits.shape[-1]), float("-inf"))  # a copy
                if not bool(_choosable(row[None])[0]):
                    own_fault.add(i)
    for processor in changing:
        logits = processor.apply(logits)
        stages.append((processor, _choosable(logits)))
    for i, state in masked:
        logits[i].index_fill_(0, state.stop_index(logits.shape[-1]), float("-inf"))
    if stages and masked:  # what a processor left may be only the tokens min_tokens forbids
        stages.append((None, _choosable(logits)))
    for i, state in penalized:
        _apply_penalties(logits[i], state)
    if stages:
        _check_choosable(stages, rows, changing, own_fault)
    tokens: list[int | None] = [None] * len(states)
    if all(s.params.greedy for _, s in live):
        chosen = _most_likely(logits if len(rows) == len(states) else logits[rows])
        for i, token in zip(rows, chosen, strict=True):
            tokens[i] = token
        return tokens
    drawn = [(i, s) for i, s in live if not s.params.greedy]
    every_row = len(drawn) == len(states)  # then not gathered: a copy of the whole batch's logits saved
    index = torch.tensor([i for i, _ in drawn], device=logits.device)
    if keeping:  # after temperature, on the whole batch, as vLLM applies them
        scaled = logits / _temperatures(states, logits)[:, None]
        stages = []
        for processor in keeping:
            scaled = processor.apply(scaled)
            stages.append((processor, _choosable(scaled)))
        _check_choosable(stages, [i for i, _ in drawn], keeping)
        scaled = scaled if every_row else scaled[index]  # (S, V): the rows that draw
    else:
        scaled = (logits if every_row else logits[index]) / _temperatures([s for _, s in drawn], logits)[:, None]
    _filter(scaled, [s.params for _, s in drawn])
    for (i, _), token in zip(drawn, _draw(scaled, [s.generator for _, s in drawn]), strict=True):
        tokens[i] = token
    greedy = [i for i, s in live if s.params.greedy]
    if greedy:
        for i, token in zip(greedy, _most_likely(logits[greedy]), strict=True):
            tokens[i] = token
    return tokens


def _most_likely(logits: Tensor) -> list[int]:
    """Each row's most likely token (B,): the first of equal maxima, as ``argmax`` picks.

    ``max(dim=-1)`` rather than ``argmax``: on a CPU, torch's ``argmax`` over a vocabulary is a scalar loop, 2-2.5x
    slower (OPT-125m's 50,272 logits on a 2-core Xeon: 65 against 31 us a row, 1.08 against 0.43 ms at 32 rows,
    a greedy step's largest cost outside the model); both return the first maximal index.
    """
    return logits.max(dim=-1).indices.tolist()


def _choosable(logits: Tensor) -> Tensor:
    """Which rows (B,) hold a token to choose: one logit above -inf, and no NaN (``amax`` propagates it)."""
    return logits.amax(dim=-1) > float("-inf")


def _check_choosable(
    stages: Sequence[tuple[Processor | _RequestChoices | None, Tensor]],
    rows: Sequence[int],
    processors: Sequence[Processor],
    own_fault: Set[int] = frozenset(),
) -> None:
    """Raise ``NoTokenLeft`` for the ``rows`` the last stage left without a token to choose (one read of the batch).

    Each such row is the fault of the stage from which it held none to the end (a later processor may give
    an emptied row a token again); a ``None`` stage (the min_tokens mask), of every one of ``processors``, or
    of the request when there are none or its own choices left only what the mask takes (``own_fault``); the
    ``_REQUEST`` stage, of the request's own choices.
    """
    held = torch.stack([choosable for _, choosable in stages])[:, rows]  # (stages, R)
    if bool(held[-1].all()):
        return
    emptied: dict[int, tuple[Processor, ...]] = {}
    by_min_tokens, by_request = set(), set()
    for row, column in zip(rows, held.t().tolist(), strict=True):
        if column[-1]:
            continue
        stage = len(column) - 1
        while stage > 0 and not column[stage - 1]:
            stage -= 1
        processor = stages[stage][0]
        if processor is _REQUEST:
            emptied[row] = ()
            by_request.add(row)
        elif processor is None:
            by_min_tokens.add(row)
            if row in own_fault or not processors:
                emptied[row] = ()
                by_request.add(row)
            else:
                emptied[row] = tuple(processors)
        else:
            emptied[row] = (processor,)  # type: ignore[assignment]  # a processor: neither marker
    raise NoTokenLeft(emptied, frozenset(by_min_tokens), frozenset(by_request))


def _temperatures(states: Sequence[SamplingState | None], logits: Tensor) -> Tensor:
    """Each row's temperature (B,), 1 where the row does not draw (greedy, or no state)."""
    values = [s.params.temperature if s is not None and not s.params.greedy else 1.0 for s in states]
    return torch.tensor(values, dtype=logits.dtype, device=logits.device)


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


def _filter(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    """Min-p, top-k and top-p on rows of temperature-scaled logits (S, V): what they drop becomes -inf, in place.

    Each filter runs once on all the rows that ask for it (in that order, as vLLM applies them), each row with its
    own value.
    """
    V = logits.shape[-1]
    filtered = [p.min_p > 0.0 or 0 < p.top_k < V or p.top_p < 1.0 for p in params]
    if not any(filtered):
        return
    # With +inf logits, all the mass is on those tokens: the most likely, which every filter keeps. (The largest
    # logit says so in one pass; a row holding NaN, whose largest is NaN, is looked at whole.)
    top = logits.amax(dim=-1)  # (S,)
    infinite = [
        bool(logits[i].isposinf().any()) if math.isnan(value) else value == math.inf
        for i, value in enumerate(top.tolist())
    ]
    rows = [i for i in range(len(params)) if filtered[i] and not infinite[i]]
    min_p = [i for i in rows if params[i].min_p > 0.0]
    if min_p:
        _on_rows(logits, min_p, lambda x: _min_p(x, [params[i].min_p for i in min_p]))
    top_k = [i for i in rows if 0 < params[i].top_k < V]
    if top_k:
        _on_rows(logits, top_k, lambda x: _top_k(x, [params[i].top_k for i in top_k]))
    nucleus = [i for i in rows if params[i].top_p < 1.0]
    if nucleus:
        # A GPU sorts the whole vocabulary in one launch; on a CPU that costs milliseconds a row, and the 64
        # most likely tokens mostly decide (the search past them would wait for a GPU a dozen times a row).
        first = V if logits.device.type != "cpu" else min(64, V)
        _on_rows(logits, nucleus, lambda x: _top_p(x, [params[i].top_p for i in nucleus], first=first))


def _on_rows(logits: Tensor, rows: list[int], change: Callable[[Tensor], None]) -> None:
    """Run ``change`` on ``rows`` of ``logits`` (S, V), in place: on the tensor itself where it is every row, else on
    the rows gathered, put back after."""
    if len(rows) == logits.shape[0]:
        change(logits)
        return
    index = torch.tensor(rows, device=logits.device)
    some = logits[index]  # (R, V)
    change(some)
    logits[index] = some


def _min_p(logits: Tensor, min_p: Sequence[float]) -> None:
    """Drop the tokens of rows (R, V) less likely than ``min_p`` times their row's most likely, in place."""
    probs = logits.softmax(dim=-1)  # (R, V)
    scale = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None]  # (R, 1)
    _keep_only(logits, ~(probs < probs.amax(dim=-1, keepdim=True) * scale))  # NaN compares false: kept, as before


def _top_k(logits: Tensor, top_k: Sequence[int]) -> None:
    """Keep the ``top_k`` most likely tokens of rows (R, V) (and any tied with the last of them), in place.

    One ``topk`` for the rows of each value (a row asking for 40,000 beside rows asking for 50 does not have
    every row sorted as far: 45 against 6.5 ms for 32 rows on a 2-core Xeon).
    """
    by_k: dict[int, list[int]] = {}
    for row, k in enumerate(top_k):
        by_k.setdefault(k, []).append(row)
    if len(by_k) == 1:
        kth = torch.topk(logits, top_k[0], dim=-1).values[:, -1:]  # (R, 1): each row's k-th most likely logit
    else:
        kth = logits.new_empty(len(top_k), 1)
        for k, rows in by_k.items():
            index = torch.tensor(rows, device=logits.device)
            kth[index] = torch.topk(logits[index], k, dim=-1).values[:, -1:]
    _keep_only(logits, ~(logits < kth))


def _top_p(logits: Tensor, top_p: Sequence[float], first: int) -> None:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (always the most likely one).

    On rows (R, V), in place, each with its own ``top_p``. A token is kept when the tokens more likely
    than it hold less than ``top_p``. The ``first`` most likely decide, for every row at once, where they
    hold ``top_p`` (all V always do); the rows where they do not are searched together (``_nucleus``).
    """
    probs = logits.softmax(dim=-1)  # (R, V)
    limit = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)[:, None]  # (R, 1)
    searching = first < logits.shape[-1]  # else the first are every token, and decide every row
    if searching:
        wanted = torch.tensor(top_p, dtype=torch.float64, device=probs.device)[:, None]  # (R, 1): not rounded
        most = probs.amax(dim=-1, keepdim=True)  # (R, 1)
        if bool((most * first < limit).all()):  # no row's first can hold top_p (flat rows): searched at once
            _keep_only(logits, _nucleus(probs, wanted, most))
            return
    top, order = torch.topk(probs, first, dim=-1)  # (R, k), (R, k): descending
    before = top.cumsum(dim=-1) - top  # (R, k): the mass of the more likely tokens
    keep = before < limit  # (R, k)
    keep[:, 0] = True  # a top_p below float32's smallest value (1e-300) rounds to 0 and would drop it
    if searching:
        # (R,): the first hold top_p, or all the mass there is (a top_p that rounds to 1 in float32 is not reached)
        reached = (before[:, -1] + top[:, -1] >= limit[:, 0]) | (top[:, -1] == 0)
        if not bool(reached.any()):  # no row decided: every one searched, nothing scattered first
            _keep_only(logits, _nucleus(probs, wanted, top[:, -1:]))
            return
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, keep)  # (R, V)
    if searching and not bool(reached.all()):
        open_rows = (~reached).nonzero()[:, 0]  # (U,)
        kept[open_rows] = _nucleus(probs[open_rows], wanted[open_rows], top[open_rows, -1:])
    _keep_only(logits, kept)


#: float32 -inf's bits, as an int32.
_NEG_INF_BITS = -8388608  # 0xFF800000


def _keep_only(logits: Tensor, kept: Tensor) -> None:
    """Make the logits that ``kept`` (same shape) does not keep -inf, in place.

    On a CPU, float32 logits are selected through their bits (-inf ^ ((x ^ -inf) & all-ones-where-kept)):
    ``masked_fill_`` and ``where`` branch on each element, and over a mask without runs, a random model's
    nucleus holding half the vocabulary scattered, took 6.9 ms for 32 rows of 50,272 on a 2-core Xeon,
    against 0.9 ms so.
    """
    if logits.dtype != torch.float32 or not logits.is_cpu:
        logits.masked_fill_(~kept, float("-inf"))
        return
    keep_bits = kept.to(torch.int32).neg_()  # all ones where kept, else 0
    logits.view(torch.int32).bitwise_xor_(_NEG_INF_BITS).bitwise_and_(keep_bits).bitwise_xor_(_NEG_INF_BITS)


#: Bins of log-probability ``_nucleus`` sorts tokens into, over each row's own range: one pass finds the bin of the
#: boundary.
_BINS = 4096
#: Rows ``_nucleus`` searches at once: at most this many of their probabilities (~30 bytes each in temporaries).
_SEARCH_NUMBERS = 1 << 22
#: A boundary bin holding more tokens than this is first looked at for ties (equal probabilities need no sort).
_CROWDED_BIN = 2048


def _nucleus(probs: Tensor, top_p: Tensor, high: Tensor) -> Tensor:
    """Which tokens of rows ``probs`` (U, V) the mass before them leaves under ``top_p`` (U, 1, float64), given that
    the tokens above ``high`` (U, 1: the 64th probability, or the largest) hold less than it.

    Each row's tokens go into bins of log-probability over the row's own range, most likely first (those
    above ``high`` into the first), with their mass; the cumulative mass says in which bin the boundary
    lies. Every bin before it is kept, every one after it dropped, and only the boundary bin's tokens are
    sorted, every row's at once; a crowded bin of equal probabilities (a processor that flattened the row)
    takes as many as fit, in vocabulary order, unsorted. Rows together, not one by one: 32 rows of a random
    model's 50,272 logits took ~1 ms a row searched one by one on a 2-core Xeon, ~0.3 ms a row so.
    """
    U, V = probs.shape
    rows = max(1, _SEARCH_NUMBERS // V)
    if U > rows:  # 256 rows of a 262k vocabulary would take ~2 GiB of temporaries at once
        return torch.cat(
            [_nucleus(probs[i : i + rows], top_p[i : i + rows], high[i : i + rows]) for i in range(0, U, rows)]
        )
    log_probs = probs.log()  # (U, V): -inf where a token has no mass
    log_high = high.log()  # (U, 1)
    lowest = log_probs.nan_to_num(nan=0.0, neginf=0.0).amin(dim=-1, keepdim=True)  # (U, 1): the least likely's
    # Bins per unit of log-probability: the least likely token in bin BINS - 1 (the float32 product stays below BINS).
    per_log = (_BINS - 1) / (log_high - lowest).clamp_(min=1e-30)  # (U, 1)
    # Bins only have to follow the order of probabilities (a monotone map keeps ties together): float32 does.
    # Tokens without mass (log -inf) and NaN go into a last bin, BINS, which is never kept.
    bins = torch.sub(log_high, log_probs).mul_(per_log).clamp_(0, _BINS).nan_to_num_(nan=_BINS).long()  # (U, V)
    mass = probs.new_zeros(U, _BINS + 1, dtype=torch.float64).scatter_add_(1, bins, probs.double())  # (U, BINS+1)
    before_bin = mass.cumsum(dim=-1) - mass  # (U, BINS+1): the mass of the likelier bins
    reaching = before_bin[:, :_BINS] + mass[:, :_BINS] >= top_p  # (U, BINS)
    boundary = _BINS - reaching.sum(dim=-1, keepdim=True)  # (U, 1): the first bin reaching top_p (BINS: none)
    kept = bins < boundary  # (U, V)
    in_bin = bins == boundary.masked_fill(boundary >= _BINS, -1)  # (U, V): -1, a bin no token is in, where none
    start = before_bin.gather(1, boundary.clamp(max=_BINS - 1))  # (U, 1): the mass before each boundary bin
    counts = in_bin.sum(dim=-1, dtype=torch.int32)  # (U,): int32, half the bytes a bool sum passes through
    crowded = (counts > _CROWDED_BIN).nonzero()[:, 0]  # (c,)
    if crowded.numel():
        # Rows whose bin holds equal probabilities take as many as fit after the bin's start, the first in
        # vocabulary order: no sort.
        every = crowded.numel() == U  # then not gathered (copies of every row)
        in_crowded, of_crowded = (in_bin, probs) if every else (in_bin[crowded], probs[crowded])  # (c, V), (c, V)
        inside = in_crowded.to(probs.dtype)  # (c, V): 1 in the bin
        highest = (of_crowded * inside).amax(dim=-1, keepdim=True)  # (c, 1)
        tied = (highest == (of_crowded + (1 - inside) * 2).amin(dim=-1, keepdim=True))[:, 0]  # (c,)
        if every and bool(tied.all()):
            fitting = ((top_p - start) / highest).ceil_()  # (U, 1)
            return kept.logical_or_(in_bin & (in_bin.cumsum(dim=-1) <= fitting))
        if bool(tied.any()):
            some, in_tied = crowded[tied], in_crowded[tied]  # (t,), (t, V)
            fitting = ((top_p[some] - start[some]) / highest[tied]).ceil_()  # (t, 1)
            kept[some] |= in_tied & (in_tied.cumsum(dim=-1) <= fitting)
            in_bin[some] = False
            counts[some] = 0
    # The other boundary bins' tokens laid left in a row each (U, n), padded with -1, then sorted likeliest
    # first, equal ones in vocabulary order: each row's mass summed within the row, as one row alone sums it.
    # Flat indices: one-dimensional gathers and writes cost a fraction of (row, token) pairs' (~17 ms for 1.6 M).
    where = in_bin.view(-1).nonzero()[:, 0]  # (m,): row by row, then in vocabulary order
    if not where.numel():
        return kept
    row, token = where.div(V, rounding_mode="floor"), where.remainder(V)  # (m,), (m,)
    n = int(counts.max())
    column = torch.arange(where.numel(), device=row.device) - (counts.cumsum(dim=0) - counts)[row]  # (m,): in its row
    place = row * n + column  # (m,): in the (U, n) layout
    slots = torch.arange(n, device=row.device) < counts[:, None]  # (U, n): which hold a token
    values = probs.new_full((U * n,), -1.0).index_copy_(0, place, probs.view(-1)[where]).view(U, n)
    tokens = row.new_full((U * n,), V).index_copy_(0, place, token).view(U, n)  # V: a column past the vocabulary
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)  # (U, n), (U, n)
    tokens = tokens.gather(1, order)  # (U, n)
    wide = values.double()
    before = start + wide.cumsum(dim=-1) - wide  # (U, n): the mass of the likelier tokens
    chosen = (before < top_p) & slots  # (U, n): padding sorted last, never chosen
    marks = kept.new_zeros(U, V + 1).scatter_(1, tokens, chosen)  # (U, V + 1): padding in column V
    return kept.logical_or_(marks[:, :-1])


#: Rows whose cumulative distributions ``_draw`` holds at once: at most this many float64 numbers (128 MiB).
_CDF_NUMBERS = 1 << 24


def _draw(logits: Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of filtered, temperature-scaled logits (S, V), each from its row's random stream.

    By inversion: one uniform number per row, found in the row's cumulative distribution (float64, so
    no token's share is lost to rounding). ``torch.multinomial`` draws an exponential number for each
    of the V tokens instead: ~0.7 ms a row at V = 50k on a CPU core, against ~0.05 ms.
    """
    S, V = logits.shape
    rows = max(1, _CDF_NUMBERS // V)
    if S > rows:  # 256 rows of a 262k vocabulary would hold 0.5 GiB
        return [t for i in range(0, S, rows) for t in _draw(logits[i : i + rows], generators[i : i + rows])]
    cdf = logits.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)  # (S, V)
    total = cdf[:, -1]  # (S,): 1 up to rounding; NaN where a row has +inf, or nothing but -inf
    uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device) for g in generators])
    tokens = torch.searchsorted(cdf, (uniform * total)[:, None], right=True)[:, 0].tolist()  # (S,)
    for s, (token, mass) in enumerate(zip(tokens, total.tolist(), strict=True)):
        if not mass > 0:  # NaN: not a distribution
            tokens[s] = _draw_at_infinity(logits[s], float(uniform[s]))
        elif token >= V:  # u x total rounded up to total: the last token that has any mass
            tokens[s] = int((cdf[s] < total[s]).sum())
    return tokens


def _draw_at_infinity(logits: Tensor, uniform: float) -> int:
    """The limit of the distribution of a row with +inf logits: all its mass on those tokens, equally.

    +inf comes from a logits processor ("this token, surely"), or a temperature that overflowed float32.
    """
    at_infinity = logits.isposinf().nonzero()[:, 0]  # (n,)
    if not at_infinity.numel():
        raise RuntimeError(
            "no token can be drawn: every logit of a row is -inf or NaN after the logits processors and filters"
        )
    return int(at_infinity[int(uniform * at_infinity.numel())])


def top_logprobs(logprobs: Tensor, chosen: int, k: int) -> TokenLogprobs:
    """The chosen token's and the ``k`` most likely ones' log-probabilities (-1: every token, the most likely
    first), with the chosen token's rank (``TokenLogprobs.rank``); ``logprobs`` is (V,)."""
    own = logprobs[chosen]
    entries = {chosen: float(own)}
    if k == -1:
        k = logprobs.shape[-1]
    top: list[int] = []
    if k > 0:
        values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        top = indices.tolist()
        entries.update(zip(top, values.tolist(), strict=True))
    if chosen in top:
        return TokenLogprobs(entries, rank=top.index(chosen) + 1, in_top=True)
    return TokenLogprobs(entries, rank=int((logprobs >= own).sum()))  # as vLLM counts: ties take the lowest place
