"""Running one engine step on the model: the forward passes, the KV cache, the logits.

A step either decodes one token for every running sequence, rows ``0 .. B-1``
of the cache (one contiguous block), or prefills the prompts not yet in the
cache, right-padded, in passes of similar length. Either way the
logits of the step's active rows come out as one tensor, in row order.

A model without ``setup_caches`` (a minimal plugin model) is run over every
sequence's whole text each step instead: slower, same result.

The KV cache grows on demand, never more than ``max_num_seqs`` rows and
``max_model_len`` slots: rows as the batch grows, slots (in steps of 256) as
sequences get longer, keeping what it holds, and never past what the memory
left allows (``check_memory``: ``KVCacheMemoryError`` says what it can hold).
When the memory runs short, rows no sequence holds are given up for slots (one
long request may use what a batch of short ones grew), and fewer sequences run
at once (``row_cap``) until the sequences that made the cache long have ended:
then it gives back their slots, and its rows may grow again.
A compiled decoding step (``pluginhost.engine.compiled``) is compiled for each
cache shape, so then the cache takes every row at once and doubles its slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from builtin_models.kv_cache import KVCache
from pluginhost.engine.compiled import CompiledDecode
from pluginhost.engine.memory import CACHE_SHARE, available_bytes
from pluginhost.engine.request import Sequence
from pluginhost.engine.scheduler import ScheduledStep
from pluginhost.errors import KVCacheMemoryError, ModelClassError

__all__ = ["ModelOutputError", "ModelRunner", "PromptScores", "StepInputs", "StepOutput"]

logger = logging.getLogger("pluginhost")


class ModelOutputError(Exception):
    """A model returned what its interface does not allow; the message says what, the engine adds which model."""


def _tensor(value: object, method: str, expected: str) -> Tensor:
    """``value``, a model's ``method`` returned, if it is a tensor (its shape is checked where it is used)."""
    if not isinstance(value, Tensor):
        raise ModelOutputError(f"its {method} returned {type(value).__name__}, not a tensor of {expected}")
    return value


#: Cache slots are added in steps of this many, rows in steps of ``_ROW_STEP``.
_SLOT_STEP = 256
_ROW_STEP = 8


@dataclass(frozen=True)
class StepInputs:
    """What the model needs of a step, and nothing else: small, plain and picklable.

    Built from a ``ScheduledStep`` on the process that schedules; with tensor
    parallelism it is sent to every other rank, which runs exactly the same
    forward passes on its shard.
    """

    #: "decode" (one token per row), "prefill" (prompts not cached yet), "recompute" (no cache), or
    #: "move" (only the cache changes: rows move, for a step that failed before its forward after the
    #: scheduler moved rows; or it takes ``cache_shape``, giving back slots).
    kind: str
    #: Rows of the batch, and cache slots its rows need: those the step writes, and the others' next ones.
    num_rows: int = 0
    slots_needed: int = 0
    #: KV cache rows to move before the forward: (from, to, slots to copy).
    moves: tuple[tuple[int, int, int], ...] = ()
    #: decode: each row's last token and its position.
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    #: prefill: the rows prefilled and their texts (prompts, and a preempted sequence's tokens too);
    #: recompute: the active rows' whole texts.
    rows: list[int] = field(default_factory=list)
    texts: list[list[int]] = field(default_factory=list)
    #: The (rows, slots) the cache takes first, when it changes: decided where the memory is checked,
    #: so every rank's cache has the same shape. ``None``: as this process's runner would grow it.
    cache_shape: tuple[int, int] | None = None
    #: prefill: the most tokens one pass takes (rows x width); a longer prompt is prefilled in pieces (0: whole).
    pass_tokens: int = 0
    #: prefill: each text's prompt length (shorter than the text for a sequence preempted after some tokens).
    prompt_lengths: list[int] = field(default_factory=list)
    #: prefill and recompute: the texts (by index) whose prompt is scored (``prompt_logprobs``), each with how many
    #: of the most likely tokens to report at every position (-1: all). A text scored is a prompt, nothing generated.
    scored: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, step: ScheduledStep, *, cached: bool, pass_tokens: int = 0) -> StepInputs:
        if not cached:
            texts = [step.rows[r].prompt_token_ids + step.rows[r].token_ids for r in step.active_rows]
            return cls("recompute", texts=texts, scored=_scored(step, step.active_rows))
        moves = cls.moves_of(step)
        if step.prefill_rows:
            texts = [list(step.rows[r].prefill_token_ids) for r in step.prefill_rows]
            return cls(
                "prefill",
                len(step.rows),
                # The others' next tokens too: newcomers must not take the room those are about to need.
                max([*(len(t) for t in texts), *(s.num_computed + 1 for s in step.rows if s.num_computed)]),
                moves,
                rows=list(step.prefill_rows),
                texts=texts,
                pass_tokens=pass_tokens,
                prompt_lengths=[len(step.rows[r].prompt_token_ids) for r in step.prefill_rows],
                scored=_scored(step, step.prefill_rows),
            )
        positions = [s.num_computed for s in step.rows]
        return cls("decode", len(step.rows), max(positions) + 1, moves, [s.token_ids[-1] for s in step.rows], positions)

    @staticmethod
    def moves_of(step: ScheduledStep) -> tuple[tuple[int, int, int], ...]:
        # A sequence with nothing computed yet (its prefill failed before the forward) has no cache row to move.
        return tuple((src, dst, step.rows[dst].num_computed) for src, dst in step.moves if step.rows[dst].num_computed)


@dataclass(frozen=True)
class PromptScores:
    """A prompt's own log-probabilities (``prompt_logprobs``): at each position from the second, of the prompt's token
    there and of the ``k`` most likely, given the tokens before it (the model's distribution, nothing applied)."""

    #: (L - 1,) float32: the log-probability of prompt token ``p + 1`` at row ``p``.
    chosen: Tensor
    #: (L - 1, k) float32 and int64: the most likely tokens at each position, the most likely first.
    top_values: Tensor
    top_ids: Tensor
    #: (L - 1,) int64: the rank of prompt token ``p + 1`` at row ``p`` (``TokenLogprobs.rank``, as vLLM ranks it).
    ranks: Tensor


@dataclass(frozen=True)
class StepOutput:
    """What a step computed: the logits of its active rows, and the prompts scored."""

    #: (A, V) float32, the active rows in row order.
    logits: Tensor
    #: The scored prompts' log-probabilities, by their index in ``StepInputs.texts`` (``execute``: by row).
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)


class ModelRunner:
    """Turns a scheduled step into logits."""

    #: Processes whose KV caches, each this one's size, share this machine's memory (tensor parallelism on a CPU).
    memory_sharers = 1

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        max_num_seqs: int,
        max_model_len: int,
        compile_decode: bool = False,
        pass_tokens: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device = device
        #: The KV caches' dtype, when not the one the model's ``setup_caches`` makes them in (``kv_cache_dtype``).
        self.kv_cache_dtype = kv_cache_dtype
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.cached = callable(getattr(model, "setup_caches", None))
        #: Whether padding a prompt would change the model's results (``prefill_unpadded``, read once).
        self._unpadded = bool(getattr(model, "prefill_unpadded", False))
        pieces = bool(getattr(model, "prefill_in_pieces", False))
        #: The most tokens a prefill pass takes (``pass_tokens``, the engine's ``max_num_batched_tokens``), for a
        #: model prefilled in pieces whose frequencies a piece would not change; 0: whole prompts, however long.
        self.pass_tokens = pass_tokens if pieces and not self._unpadded else 0
        #: Whether a preempted sequence's tokens are replayed one at a time (RoPE following the length).
        self._replays = pieces and self._unpadded
        #: The compiled decoding step, when asked for.
        self.compiled = CompiledDecode(model, device, self._decode_logits) if compile_decode and self.cached else None
        if compile_decode and not self.cached:
            logger.warning(
                "compile_decode has no effect on %s: it has no KV cache (no setup_caches), so no decoding step",
                type(model).__name__,
            )
        if kv_cache_dtype is not None and not self.cached:
            logger.warning(
                "kv_cache_dtype has no effect on %s: it has no KV cache (no setup_caches)", type(model).__name__
            )
        self._caches: list[KVCache] = []
        self._rows = self._slots = 0
        #: The most rows the memory allows (``cap_rows`` lowers it when it finds less): never grown past.
        self.row_cap = max_num_seqs
        #: The memory available and the row length ``row_cap`` was last priced at (``None``: no cap).
        self._cap_priced_at: tuple[int, int] | None = None
        self._last_available: int | None = None

    @property
    def stopped(self) -> Exception | None:
        """The error that stopped this runner for good (a tensor-parallel rank lost), else ``None``."""
        return None

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(rows, slots) of the KV cache now."""
        return self._rows, self._slots

    def execute(self, step: ScheduledStep) -> StepOutput:
        """The logits of the step's active rows, (len(active_rows), V) float32, in row order; the prompts scored,
        by row.

        ``KVCacheMemoryError`` before anything runs when the cache cannot grow to what the step needs.
        """
        inputs = StepInputs.of(step, cached=self.cached, pass_tokens=self.pass_tokens)
        if inputs.kind != "recompute":
            rows_in_use = _rows_in_use(step)
            self._give_back(step, rows_in_use, inputs.slots_needed)
            if inputs.kind == "prefill":
                self._check_room_to_come(step, rows_in_use)
            try:
                self.check_memory(inputs.num_rows, inputs.slots_needed, rows_in_use)
            except KVCacheMemoryError:
                if not self._give_back_rows(step, rows_in_use):
                    raise
                inputs = replace(inputs, moves=())  # applied with the rows given back
                self.check_memory(inputs.num_rows, inputs.slots_needed, rows_in_use)  # in what they freed
            if not self._fits(inputs.num_rows, inputs.slots_needed):
                inputs = replace(inputs, cache_shape=self._grown_shape(inputs.num_rows, inputs.slots_needed))
        output = self.run(inputs)
        if output.prompt_scores:
            rows = step.prefill_rows if inputs.kind == "prefill" else step.active_rows
            output = replace(output, prompt_scores={rows[i]: s for i, s in output.prompt_scores.items()})
        return output

    def apply_moves(self, step: ScheduledStep) -> None:
        """Move the step's rows in the cache, once (the engine does it first in every step); then clear them.

        The scheduler has placed the sequences already; their cache rows must follow, or a moved
        sequence would read another's keys and values from its next step on. A sequence's slots are
        copied as far as it has computed, so moves applied again before any forward copy the same.
        """
        moves = StepInputs.moves_of(step) if self.cached else ()
        if moves:
            self.run(StepInputs("move", moves=moves))
        step.moves.clear()

    def check_memory(self, rows: int, slots: int, in_use: int | None = None) -> None:
        """Raise ``KVCacheMemoryError`` when growing the cache to hold ``rows`` x ``slots`` would not fit.

        Growing holds the old block and the new one at once, so the new block alone must fit in
        ``CACHE_SHARE`` of the memory available now. Only the rows of running sequences (below
        ``in_use``; by default the rows held, up to ``rows``) must be kept: the others hold no sequence
        yet, and newcomers in them may wait, so the cache may trade them for slots. The error says what
        can be had: the slots the step needs with as many rows as then fit, else as many slots as fit
        beside the rows in use.
        """
        if self._fits(rows, slots):
            return
        available = self._available()
        if available is None:
            return
        per_slot = self.slot_bytes()
        budget = CACHE_SHARE * available
        grown_rows, grown_slots = self._grown_shape(rows, slots)
        if grown_rows * grown_slots * per_slot <= budget:
            return
        # What can be had, as a shape the cache really grows to (rows capped until it gives slots back, see
        # ``_grown_shape``): the slots the step needs, with as many rows as then fit if that keeps the
        # rows in use; else those rows (one at least), with as many slots as fit beside them.
        fit_rows = self._rows_fitting(available, grown_slots)
        in_use = max(min(self._rows, rows) if in_use is None else in_use, 1)
        if fit_rows >= in_use:
            allowed = (min(grown_rows, fit_rows), grown_slots)
        else:
            allowed = (in_use, max(self._slots, self._realizable_slots(int(budget // (in_use * per_slot)))))
        self.cap_rows(*allowed)
        if rows <= allowed[0] and slots <= allowed[1]:
            return  # the cap alone makes the step fit: fewer rows than the rounding asked for
        gib = 1 << 30
        raise KVCacheMemoryError(
            f"The KV cache cannot grow to {grown_rows} rows x {grown_slots} slots: that takes "
            f"{grown_rows * grown_slots * per_slot / gib:.2f} GiB, and it may take {budget / gib:.2f} GiB "
            f"({CACHE_SHARE:.0%} of the {available / gib:.2f} GiB of memory available). The cache is one block "
            f"of rows x the longest sequence, so it holds {allowed[0]} sequences of up to {allowed[1]} tokens. "
            "Requests longer than that were ended, the others go on; lower max_model_len or max_num_seqs, ask for "
            "fewer tokens, or free memory.",
            rows=allowed[0],
            slots=allowed[1],
        )

    def _check_room_to_come(self, step: ScheduledStep, rows_in_use: int) -> None:
        """Raise ``KVCacheMemoryError`` for the newcomers that could not run to their ends beside the others.

        When the memory cannot hold every row of the batch at the length its longest may reach (prompt
        and ``max_tokens``), newcomers beyond the rows that fit wait for a free one, rather than run
        until some must be preempted and recomputed. Eight requests of 300 tokens in room for 4 x 512
        slots: 4 run at once, not 8 that all stop at 256. A request without ``max_tokens`` reserves
        nothing ahead (``_slots_to_come``): preemption makes room for it when it comes to need it.
        """
        rows = len(step.rows)
        slots = self._slots_for(max(_slots_to_come(s) for s in step.rows))
        if self._fits(rows, slots):
            return
        available = self._available()
        if available is None:
            return
        fitting = self._rows_fitting(available, slots)
        room = max(fitting, rows_in_use, 1)  # those running, or one, go on even when fewer fit: as far as they can
        if not any(row >= room for row in step.prefill_rows):
            return  # nothing to hold back: the growth check decides, token by token
        self.cap_rows(room, slots)  # until the cache gives slots back, or the memory comes back (``_give_back``)
        raise KVCacheMemoryError(
            f"The KV cache has room for {fitting} sequences of up to {slots} tokens in the memory available",
            rows=room,
            slots=slots,
            fitting_rows=fitting,
        )

    def rows_that_fit(self, slots: int) -> int | None:
        """How many rows of ``slots`` tokens the cache could grow to in the memory available (``None``: unknown)."""
        available = self._available()
        return None if available is None else self._rows_fitting(available, slots)

    def cap_rows(self, rows: int, slots: int) -> None:
        """Lower ``row_cap`` to ``rows`` (never raise it): what the memory last read allows, in rows of ``slots``."""
        if rows < self.row_cap:
            self.row_cap = rows
            self._cap_priced_at = None if self._last_available is None else (self._last_available, slots)

    def _rows_fitting(self, available: int, slots: int) -> int:
        """Rows of ``slots`` tokens (as the cache would take them) a new block may have in ``available`` bytes."""
        return int(CACHE_SHARE * available // (self._slots_for(slots) * self.slot_bytes()))

    def _available(self) -> int | None:
        """The memory the cache may grow into now (``None``: unknown), its caches set up to know a slot's cost."""
        if not self._caches:
            self._setup_caches()
        self._last_available = available_bytes(self.device)
        return self._last_available

    def slot_bytes(self) -> int:
        """Bytes one row's slot takes: keys and values of every layer, on every rank sharing this memory."""
        return self.memory_sharers * sum(2 * c.k[:1, :, :1].numel() * c.k.element_size() for c in self._caches)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> StepOutput:
        """What a step described by ``inputs`` computes (what ``execute`` runs, and every rank of a split model)."""
        if inputs.kind == "recompute":
            return self._recompute(inputs.texts, inputs.scored)
        for src, dst, length in inputs.moves:  # first: they stay within the rows held, and a failing resize
            for cache in self._caches:  # must not leave a moved sequence reading another's row
                cache.move(src, dst, length)
        shape = inputs.cache_shape
        if shape is None and inputs.kind != "move" and not self._fits(inputs.num_rows, inputs.slots_needed):
            shape = self._grown_shape(inputs.num_rows, inputs.slots_needed)
        if shape is not None and shape != self.cache_shape:
            self._resize(shape)
        if inputs.kind == "move":
            return None  # type: ignore[return-value]  # nothing to compute
        if inputs.kind == "decode":
            # Compiled only at the cache's full rows: under a memory shortage its rows follow the memory free, and
            # each count would compile anew (seconds each, the batch waiting), as often as the memory changes.
            if self.compiled is not None and self._rows == self.max_num_seqs:
                logits = self.compiled.logits(
                    inputs.tokens, inputs.positions, cache_rows=self._rows, cache_slots=self._slots
                )
                return StepOutput(logits)
            return StepOutput(self._decode_logits(inputs.tokens, inputs.positions))
        texts, prompt_lengths = inputs.texts, inputs.prompt_lengths
        # Preempted after generating, with RoPE following the length: its keys again as it wrote them, each at the
        # length it had then (the prompt's, then one more a token); at the whole length, later tokens changed.
        replayed = {i for i, n in enumerate(prompt_lengths) if n < len(texts[i])} if self._replays else set()

        def ends(group: list[int], width: int) -> list[int]:
            if group[0] in replayed:  # alone in its group
                return list(range(prompt_lengths[group[0]], width + 1))
            piece = max(1, inputs.pass_tokens // len(group)) if inputs.pass_tokens else width
            return [*range(piece, width, piece), width]

        scores: dict[int, PromptScores] = {}
        hidden = self._last_hidden(texts, inputs.rows, ends, alone=replayed, scored=inputs.scored, scores=scores)
        return StepOutput(self._logits(hidden), scores)  # (P, V)

    def _decode_logits(self, tokens: list[int], positions: list[int]) -> Tensor:
        """One token for every row: logits (B, V) float32."""
        return self._logits(self._decode(tokens, positions))

    def _decode(self, tokens: list[int], positions_list: list[int]) -> Tensor:
        """One token for every row: (B, W)."""
        ids = torch.tensor(tokens, device=self.device)[:, None]  # (B, 1)
        positions = torch.tensor(positions_list, device=self.device)[:, None]  # (B, 1)
        slots = max(positions_list) + 1
        mask = torch.arange(slots, device=self.device)[None, :] <= positions  # (B, S)
        hidden = self._forward(ids, positions, slice(0, len(tokens)), mask[:, None, None, :])  # (B, 1, W)
        return hidden[:, -1]

    def _last_hidden(
        self,
        texts: list[list[int]],
        cache_rows: list[int] | None,
        ends: Callable[[list[int], int], list[int]],
        alone: set[int] = frozenset(),
        scored: dict[int, int] | None = None,
        scores: dict[int, PromptScores] | None = None,
    ) -> Tensor:
        """The hidden state of each text's last token (len(texts), W): texts of similar length share a pass
        (``_similar_lengths``; those in ``alone`` have theirs), in pieces ending at ``ends(group, width)``.

        ``cache_rows``: each text's row of the KV cache, written as it goes; ``None``: a model without a cache.
        The texts in ``scored`` (index: top k) are scored as they pass, into ``scores`` (by index).
        """
        lengths = [len(text) for text in texts]
        hidden = None
        for group in _similar_lengths(list(range(len(texts))), lengths, padding=not self._unpadded, alone=alone):
            rows = [cache_rows[i] for i in group] if cache_rows is not None else None
            width = max(lengths[i] for i in group)
            asked = {j: scored[i] for j, i in enumerate(group) if scored and i in scored}  # by place in the group
            found: dict[int, PromptScores] = {}
            joined = self._prefill([texts[i] for i in group], rows, ends(group, width), asked, found)  # (k, W)
            if scores is not None:
                scores.update((group[j], s) for j, s in found.items())
            if hidden is None:
                hidden = joined.new_empty((len(texts), joined.shape[-1]))
            hidden[torch.tensor(group, device=self.device)] = joined
        assert hidden is not None
        return hidden

    def _prefill(
        self,
        prompts: list[list[int]],
        cache_rows: list[int] | None,
        ends: list[int],
        scored: dict[int, int] | None = None,
        scores: dict[int, PromptScores] | None = None,
    ) -> Tensor:
        """The prompts of these cache rows (``None``: no cache), right-padded; the hidden state of each one's last
        token.

        In pieces of positions ending at ``ends`` (the last: the padded length), one pass each: a piece's
        tokens attend the cache's slots up to its end, as a decoding step attends them. A pass over T
        tokens holds a T x T mask and attention (a 16k-token prompt of a tiny model took 1.5 GiB more,
        a 64k one ~24), a piece's T x its width. The prompts in ``scored`` (index: top k) are scored piece
        by piece, into ``scores``.
        """
        pieces: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {j: [] for j in scored or {}}
        ids, positions, last = self._padded(prompts)
        rows = torch.tensor(cache_rows, device=self.device) if cache_rows is not None else None
        k = ids.shape[0]
        out = None
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            piece = slice(start, end)
            mask = _causal(k, start, end, self.device)  # (k, 1, C, end)
            hidden = self._forward(ids[:, piece], positions[:, piece], rows, mask)  # (k, C, W)
            if out is None:
                out = hidden.new_empty((k, hidden.shape[-1]))
            ending = ((last >= start) & (last < end)).nonzero().flatten()  # the rows whose last token is here
            out[ending] = hidden[ending, last[ending] - start]
            for j, top in (scored or {}).items():  # position p predicts token p + 1: up to the prompt's last but one
                stop = min(end, len(prompts[j]) - 1)
                if stop > start:
                    pieces[j].append(self._score(hidden[j, : stop - start], ids[j, start + 1 : stop + 1], top))
        assert out is not None
        if scores is not None:
            for j, parts in pieces.items():
                scores[j] = PromptScores(*(torch.cat(p) for p in zip(*parts, strict=True))) if parts else _no_scores()
        return out  # (k, W)

    def _score(self, hidden: Tensor, following: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The log-probabilities of ``following`` (C,), the ``k`` most likely tokens (-1: all) after each of
        ``hidden`` (C, W), and the rank of each of ``following``: (C,), (C, k), (C, k), (C,), a bounded number of
        positions at a time (C x V floats each)."""
        parts = []
        for at in range(0, hidden.shape[0], _SCORED_AT_ONCE):
            logprobs = self._logits(hidden[at : at + _SCORED_AT_ONCE]).log_softmax(dim=-1)  # (c, V)
            tokens = following[at : at + _SCORED_AT_ONCE, None]  # (c, 1)
            chosen = logprobs.gather(1, tokens)  # (c, 1)
            values, top_ids = logprobs.topk(logprobs.shape[-1] if k == -1 else min(k, logprobs.shape[-1]), dim=-1)
            # vLLM's rank: a token's place among the top k, else how many tokens are at least as likely (ties last).
            place = (logprobs >= chosen).sum(-1)  # (c,)
            if k:
                in_top = top_ids == tokens  # (c, k)
                place = torch.where(in_top.any(-1), in_top.int().argmax(-1) + 1, place)
            parts.append((chosen[:, 0], values, top_ids, place))
        return tuple(torch.cat(p) for p in zip(*parts, strict=True))  # type: ignore[return-value]

    def _recompute(self, texts: list[list[int]], scored: dict[int, int]) -> StepOutput:
        """The active sequences' whole texts, for a model without a cache, grouped as prompts are prefilled (of
        equal length only, where padding would change the model's results: positions run on through the
        padding, and RoPE following the length took the longest row's); logits (B, V), and the prompts scored."""
        scores: dict[int, PromptScores] = {}
        hidden = self._last_hidden(texts, None, lambda group, width: [width], scored=scored, scores=scores)
        return StepOutput(self._logits(hidden), scores)

    def _forward(self, ids: Tensor, positions: Tensor, rows: Tensor | slice | None, mask: Tensor) -> Tensor:
        """The model's hidden states (B, T, W) of ``ids`` (B, T)."""
        hidden = _tensor(self.model(ids, positions, rows, mask), "forward", "hidden states (batch, tokens, width)")
        if hidden.dim() != 3 or hidden.shape[:2] != ids.shape:
            raise ModelOutputError(
                f"its forward returned hidden states of shape {tuple(hidden.shape)} for input_ids of shape "
                f"{tuple(ids.shape)}: it must return (batch, tokens, width)"
            )
        return hidden

    def _logits(self, hidden: Tensor) -> Tensor:
        """float32 logits (N, V) of hidden states (N, W); the vocabulary's size is checked by the engine."""
        return _tensor(self.model.compute_logits(hidden), "compute_logits", "logits (tokens, vocabulary)").float()

    def _padded(self, texts: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
        """Token ids (B, T) right-padded with 0, positions (B, T), last indices (B,)."""
        lengths = torch.tensor([len(t) for t in texts])
        B, T = len(texts), int(lengths.max())
        ids = torch.zeros(B, T, dtype=torch.long)
        for i, text in enumerate(texts):
            ids[i, : len(text)] = torch.tensor(text)
        positions = torch.arange(T, device=self.device).expand(B, T)  # padding continues the count
        return ids.to(self.device), positions, (lengths - 1).to(self.device)

    def _grown_shape(self, rows: int, slots: int) -> tuple[int, int]:
        """The (rows, slots) the cache grows to when a step needs ``rows`` x ``slots``.

        It keeps what it holds, except rows beyond ``row_cap``: those hold no sequence (``check_memory``).
        """
        most_rows = min(self.max_num_seqs, self.row_cap)  # what rounding may reach; never fewer than the step's rows
        kept_rows = min(self._rows, most_rows)
        if self.compiled is None:
            new_rows = max(kept_rows, rows, min(most_rows, _round_up(rows, _ROW_STEP)))
        else:  # each cache shape is compiled anew: every row at once
            new_rows = max(rows, most_rows)
        return new_rows, max(self._slots, self._slots_for(slots))

    def _slots_for(self, slots: int) -> int:
        """The slots the cache takes to hold ``slots``: steps of 256, or doubling when compiled (fewer shapes)."""
        if self.compiled is None:
            return min(self.max_model_len, _round_up(slots, _SLOT_STEP))
        return min(self.max_model_len, _SLOT_STEP << ((slots - 1) // _SLOT_STEP).bit_length())  # 256, 512, ...

    def _give_back(self, step: ScheduledStep, rows_in_use: int, slots_needed: int) -> None:
        """After the memory ran short, give back the slots no sequence of the batch can come to need.

        A shortage caps the rows (``row_cap``). Once the sequences that made the cache long have ended
        (what the running ones can come to, their prompt and ``max_tokens``, and what the step needs),
        the cache shrinks to that and the cap is lifted; so it is when no sequence runs. A running
        sequence without ``max_tokens`` keeps the cap (the cache still shrinks to what it holds). Until then,
        the cap rises as far as more memory allows, when there is more (``_memory_came_back``): memory
        another process took for a while comes back to the batch. Growing rows is checked anyway.
        Without a shortage the cache keeps what it holds, as growing it again would cost a copy (and a
        compile, for a compiled step).
        """
        if self.row_cap >= self.max_num_seqs or not self._caches:
            return  # the common case, every step: nothing to work out
        running = [s for s in step.rows if s.num_computed]
        to_come = max((_slots_to_come(s) for s in running), default=0)
        shorter = self._slots_for(max(to_come, slots_needed))
        shrinks = shorter < self._slots
        if shrinks:
            self.run(StepInputs("move", cache_shape=(self._rows, shorter)))  # every rank's cache shrinks alike
        # A running sequence without max_tokens grows past what it holds now: shrunk to it, the cache is no bound
        # on what it comes to need, and lifting the cap would let newcomers in to be preempted again as it grows.
        if rows_in_use and (not shrinks or any(s.params.max_tokens is None for s in running)):
            self._memory_came_back()
            return
        self.lift_row_cap()

    def lift_row_cap(self) -> None:
        """Let the rows grow to ``max_num_seqs`` again (checked against the memory as they grow): nothing runs."""
        self.row_cap, self._cap_priced_at = self.max_num_seqs, None

    def _memory_came_back(self) -> None:
        """Raise ``row_cap`` as far as the memory available now allows, when there is more than when it was set.

        Rows are priced as they were then (the same slots), so a cap set for newcomers that cannot run
        to their ends is not lifted for them only to be refused again.
        """
        if self._cap_priced_at is None:
            return
        then, slots = self._cap_priced_at
        available = self._available()
        if available is None or available <= then:
            return
        self._cap_priced_at = (available, slots)
        self.row_cap = max(self.row_cap, min(self.max_num_seqs, self._rows_fitting(available, slots)))

    def _give_back_rows(self, step: ScheduledStep, rows_in_use: int) -> bool:
        """When the cache cannot grow, free the rows no running sequence holds; whether there were any.

        Growing holds the old block while it fills the new one, so rows left empty by sequences that
        ended or were preempted can keep a running one from its next slot. The step's moves are
        applied first (a moved sequence's keys and values are still in its old row), then the cache
        keeps rows ``0 .. rows_in_use-1``: the others hold nothing, or newcomers not prefilled yet.
        """
        keep = max(rows_in_use, 1)
        if self._rows <= keep:
            return False
        self.run(StepInputs("move", moves=StepInputs.moves_of(step), cache_shape=(keep, self._slots)))
        step.moves.clear()  # applied: neither this step nor a refused one moves them again
        return True

    def _realizable_slots(self, most: int) -> int:
        """The most slots, at most ``most``, that the cache grows to (steps of 256; doubling when compiled)."""
        if self.compiled is None:
            return min(self.max_model_len, _round_down(most, _SLOT_STEP))
        slots, size = 0, _SLOT_STEP
        while size <= most:  # 256, 512, 1024, ...
            slots, size = size, size * 2
        return min(self.max_model_len, slots)

    def _fits(self, rows: int, slots: int) -> bool:
        return rows <= self._rows and slots <= self._slots

    def _resize(self, shape: tuple[int, int]) -> None:
        new_rows, new_slots = shape
        if not self._caches:
            self._setup_caches()
        for cache in self._caches:
            cache.resize(new_rows, new_slots)
        self._rows, self._slots = new_rows, new_slots

    def _setup_caches(self) -> None:
        """The model's caches, one row of one slot (then grown): what a row's slot costs is known before it grows."""
        self.model.setup_caches(1, 1)  # a probe: not counted as held (rows and slots stay 0) until it grows
        self._caches = [m for m in self.model.modules() if isinstance(m, KVCache)]
        if not self._caches:
            raise ModelClassError(
                f"{type(self.model).__name__}.setup_caches() created no builtin_models.kv_cache.KVCache: the "
                "engine grows and reorders the cache through KVCache, so a model's caches must be KVCache "
                "modules (or the model must not define setup_caches)."
            )
        if self.kv_cache_dtype is not None:
            kept = {c.k.dtype for c in self._caches if c.k.dtype != self.kv_cache_dtype}
            narrow = sorted(str(d).removeprefix("torch.") for d in kept if d.itemsize <= self.kv_cache_dtype.itemsize)
            if narrow:
                logger.warning(
                    "kv_cache_dtype %s over a %s cache saves no memory, and rounds keys and values to its precision",
                    str(self.kv_cache_dtype).removeprefix("torch."),
                    " and ".join(narrow),
                )
            for cache in self._caches:
                cache.cast(self.kv_cache_dtype)
        self._rows = self._slots = 0


#: Positions of a prompt scored at once: their logits and log-probabilities are this many x the vocabulary each.
_SCORED_AT_ONCE = 256


def _scored(step: ScheduledStep, rows: list[int]) -> dict[int, int]:
    """Of ``rows``, by index, the prompts to score (``prompt_logprobs``) and their top k: each request's once, by
    its first sequence to be computed (its others, and a sequence preempted after generating, are not scored)."""
    scored: dict[int, int] = {}
    requests = set()
    for i, row in enumerate(rows):
        sequence = step.rows[row]
        request = sequence.request
        k = sequence.params.prompt_logprobs
        if k is None or sequence.token_ids or request.prompt_logprobs is not None or id(request) in requests:
            continue
        requests.add(id(request))
        scored[i] = k
    return scored


def _no_scores() -> PromptScores:
    """The scores of a one-token prompt: nothing precedes its only token."""
    return PromptScores(
        torch.empty(0), torch.empty(0, 0), torch.empty(0, 0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    )


def _rows_in_use(step: ScheduledStep) -> int:
    """The rows up to the last running sequence's (not those prefilled now): every row in a decoding step."""
    if not step.prefill_rows:
        return len(step.rows)
    return next((row + 1 for row in reversed(range(len(step.rows))) if step.rows[row].num_computed), 0)


def _slots_to_come(sequence: Sequence) -> int:
    """The slots a sequence can come to need: its prompt and ``max_tokens``, when it asked for a number.

    Without one (``max_tokens=None``, the server's chat default) only what it holds and its next
    token: counting all of what ``max_model_len`` leaves for every such request would run them one
    or two at a time, where most end long before.
    """
    if sequence.params.max_tokens is None:
        return len(sequence.prompt_token_ids) + len(sequence.token_ids)
    return len(sequence.prompt_token_ids) + sequence.max_tokens - 1


def _causal(rows: int, start: int, end: int, device: torch.device) -> Tensor:
    """The causal mask (rows, 1, end - start, end) of positions ``start .. end - 1`` over slots ``0 .. end - 1``."""
    return torch.ones(end - start, end, dtype=torch.bool, device=device).tril(start)[None, None].expand(rows, 1, -1, -1)


#: Joining prompts share a prefill pass while padding them to the longest adds at most this fraction.
_MAX_PADDING = 0.25


def _similar_lengths(
    rows: list[int], lengths: list[int], *, padding: bool = True, alone: set[int] = frozenset()
) -> list[list[int]]:
    """The rows to prefill in groups of similar prompt length (``lengths``, in ``rows`` order), each one prefill pass.

    A prefill pass is mostly large matrix products, whose cost grows with the
    padded tokens: one pass over prompts of 16 and 256 tokens pays for 512.
    Short prompts still go together (their products are not compute-bound).
    Without ``padding`` (a model whose ``prefill_unpadded`` says padding would
    change its results), only prompts of the same length share a pass. Rows
    in ``alone`` have a pass each.
    """
    length_of = dict(zip(rows, lengths, strict=True))
    ordered = sorted((r for r in rows if r not in alone), key=length_of.__getitem__)
    groups: list[list[int]] = []
    total = 0
    for row in ordered:
        length = length_of[row]
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * length  # sorted: this one is the longest so far
            if not padding:
                fits = length == length_of[group[0]]
            else:
                fits = padded <= (1 + _MAX_PADDING) * (total + length) or padded <= _SHORT_PASS
            if fits:
                group.append(row)
                total += length
                continue
        groups.append([row])
        total = length
    return [[r] for r in rows if r in alone] + groups


#: A pass of at most this many padded tokens is cheap whatever its padding.
_SHORT_PASS = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _round_down(n: int, multiple: int) -> int:
    return n // multiple * multiple
