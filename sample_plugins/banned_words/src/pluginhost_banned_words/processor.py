"""The banned-words logits processor: vLLM v1's ``LogitsProcessor`` interface, pluginhost's imports.

The classic "bad words" processor, per request. For each banned word, its
token sequences (the word as written, and with a leading space, as it reads
mid-text) are split into a prefix and a last token; at each step a row's
last tokens are banned when its generated tokens end with their prefix
(an empty prefix always matches). Only generated tokens count, not the
prompt's, as in vLLM.

What a step costs does not grow with the words: one-token words are one
tensor of token ids per request, masked at once, and the longer ones are
indexed by the last token of their prefix, so a step looks only at those
the row's last token may complete.

The engine keeps one instance per engine and tells it how the batch changed
(``update_state``): per-row state follows rows as they are added, removed,
moved and swapped, and reads each row's live list of generated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pluginhost.errors import ConfigError
from pluginhost.logits_processors import BatchUpdate, LogitsProcessor, MoveDirectionality
from pluginhost.sampling import SamplingParams
from pluginhost.tokenizer import TOKENIZER_FILES, load_tokenizer
from pluginhost_banned_words import MAX_WORD_CHARS, MAX_WORDS, OPTION

__all__ = ["BannedWordsLogitsProcessor"]

#: Tokenized words kept per engine (the tokenization of a word never changes); the oldest go first.
_MAX_CACHED_WORDS = 4 * MAX_WORDS
#: Word lists kept per engine, indexed (the rows of one request, its ``n`` samples, share one).
_MAX_CACHED_LISTS = 64


@dataclass
class _Banned:
    """One word list's token sequences, indexed for the steps."""

    #: Tokens banned at every step: the last (only) token of one-token words.
    always: list[int]
    #: The last token of a prefix -> (the rest of that prefix, the token banned right after the prefix).
    after: dict[int, list[tuple[tuple[int, ...], int]]]
    #: ``always`` as a tensor, for the (device, vocabulary size) last asked.
    _always: tuple[torch.device, int, torch.Tensor | None] | None = field(default=None, repr=False)

    @classmethod
    def index(cls, sequences: set[tuple[int, ...]]) -> _Banned:
        always, after = set(), {}
        for ids in sequences:
            if len(ids) == 1:
                always.add(ids[0])
            else:
                after.setdefault(ids[-2], []).append((ids[:-2], ids[-1]))
        return cls(sorted(always), {last: sorted(entries) for last, entries in after.items()})

    def always_on(self, device: torch.device, vocab: int) -> torch.Tensor | None:
        """``always`` within the vocabulary, as a tensor on ``device`` (``None`` when empty); made once."""
        if self._always is None or self._always[:2] != (device, vocab):
            ids = [t for t in self.always if t < vocab]
            self._always = (device, vocab, torch.tensor(ids, dtype=torch.long, device=device) if ids else None)
        return self._always[2]

    def after_prefix(self, output: Sequence[int]) -> list[int]:
        """The tokens banned now, after ``output``: those of the prefixes ``output`` ends with."""
        n = len(output)
        entries = self.after.get(output[-1]) if n else None
        if not entries:
            return []
        banned = []
        for rest, last in entries:
            k = len(rest)
            if not k or (k < n and tuple(output[n - 1 - k : n - 1]) == rest):
                banned.append(last)
        return banned


@dataclass
class _Row:
    """One request's banned words, and its generated tokens (the engine's live list)."""

    banned: _Banned
    output: Sequence[int]


class BannedWordsLogitsProcessor(LogitsProcessor):
    """Bans ``extra_args["banned_words"]`` per request; not argmax-invariant (it changes which token wins)."""

    def __init__(self, config: Any, device: torch.device) -> None:
        self._model_dir = Path(config.model).expanduser()
        self._tokenizer: Any = None  # loaded at the first request that bans words
        self._tokenized: dict[str, list[tuple[int, ...]]] = {}
        self._lists: dict[tuple[str, ...], _Banned] = {}
        self._blank: dict[int, bool] = {}  # token id -> whether it decodes to whitespace only
        self._rows: dict[int, _Row] = {}

    # -- per request ---------------------------------------------------------------------------

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        _words(params)

    def is_argmax_invariant(self) -> bool:
        return False

    # -- following the batch --------------------------------------------------------------------

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self._rows
        for row, params, _prompt_ids, output_ids in batch_update.added:
            words = _words(params)
            if words:
                rows[row] = _Row(self._banned(words), output_ids)
            else:
                rows.pop(row, None)  # a request without the option may take a row that had one
        for row in batch_update.removed:
            rows.pop(row, None)
        for a, b, direction in batch_update.moved:
            state_a, state_b = rows.pop(a, None), rows.pop(b, None)
            if state_a is not None:
                rows[b] = state_a
            if direction == MoveDirectionality.SWAP and state_b is not None:
                rows[a] = state_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        vocab = logits.shape[-1]
        rows: list[int] = []
        tokens: list[int] = []
        for row, state in self._rows.items():
            always = state.banned.always_on(logits.device, vocab)
            if always is not None:
                logits[row].index_fill_(0, always, float("-inf"))
            for token in state.banned.after_prefix(state.output):
                if token < vocab:
                    rows.append(row)
                    tokens.append(token)
        if tokens:
            logits[rows, tokens] = float("-inf")
        return logits

    # -- tokenizing ------------------------------------------------------------------------------

    def _banned(self, words: list[str]) -> _Banned:
        """The word list's token sequences, indexed (made once per list, for all the rows that ban it)."""
        key = tuple(words)
        banned = self._lists.get(key)
        if banned is None:
            known = {word: self._tokenized[word] for word in words if word in self._tokenized}
            first = {}  # each word once, with the index it is first given at
            for i, word in enumerate(words):
                if word not in known:
                    first.setdefault(word, i)
            new = self._tokenize([(i, word) for word, i in first.items()])
            sequences = {ids for variants in (*known.values(), *new.values()) for ids in variants}
            banned = self._lists[key] = _Banned.index(sequences)
            _keep_newest(self._lists, _MAX_CACHED_LISTS)
        return banned

    def _tokenize(self, words: list[tuple[int, str]]) -> dict[str, list[tuple[int, ...]]]:
        """Each ``(index, word)``'s token ids as written and with one leading space (each once), in one call.

        A word the tokenizer spells with no token of its own (characters its vocabulary lacks and drops,
        or only whitespace) cannot be banned: a ``ValueError`` naming it, never silently dropped.
        """
        if not words:
            return {}
        tokenizer = self._load_tokenizer()
        texts = [text for _, word in words for text in (word, " " + word.lstrip())]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        found: dict[str, list[tuple[int, ...]]] = {}
        for k, (index, word) in enumerate(words):
            variants: list[tuple[int, ...]] = []
            for text, ids in zip(texts[2 * k : 2 * k + 2], map(tuple, encoded[2 * k : 2 * k + 2]), strict=True):
                if all(self._is_blank(tokenizer, t) for t in ids):
                    raise ValueError(
                        f"extra_args[{OPTION!r}][{index}] {word!r:.60} encodes to no token of its own with the "
                        f"model's tokenizer ({text!r:.60} -> {list(ids)}), so it cannot be banned; remove it, or "
                        "write it as the model spells it"
                    )
                if ids not in variants:
                    variants.append(ids)
            found[word] = variants
        self._tokenized.update(found)
        _keep_newest(self._tokenized, _MAX_CACHED_WORDS)
        return found

    def _is_blank(self, tokenizer: Any, token: int) -> bool:
        blank = self._blank.get(token)
        if blank is None:
            blank = self._blank[token] = not tokenizer.decode([token]).strip()
        return blank

    def _load_tokenizer(self) -> Any:
        """The model directory's tokenizer, found and loaded as the engine loads its own (never a stand-in)."""
        if self._tokenizer is None:
            try:
                tokenizer = load_tokenizer(self._model_dir)
            except ConfigError as exc:
                raise RuntimeError(f"banned_words needs the model's tokenizer, and it does not load: {exc}") from None
            if tokenizer is None:  # this model cannot serve the option: a refusal of the request (a 400)
                raise ValueError(
                    f"banned_words needs the model's tokenizer to turn words into tokens, and {self._model_dir} has "
                    f"none (none of {', '.join(TOKENIZER_FILES)}): nothing can be banned on this model. Send the "
                    "request without extra_args.banned_words, or add the model's tokenizer files"
                )
            self._tokenizer = tokenizer
        return self._tokenizer


def _words(params: SamplingParams) -> list[str]:
    """The request's banned words (``[]`` without the option); ``ValueError`` for a malformed option."""
    extra = params.extra_args
    if not extra or extra.get(OPTION) is None:
        return []
    words = extra[OPTION]
    if not isinstance(words, list | tuple):
        example = f"[{words!r}]" if isinstance(words, str) else '["foo", "bar baz"]'
        raise ValueError(
            f"extra_args[{OPTION!r}] must be a list of words, got {type(words).__name__} {words!r:.40}; "
            f"write {example:.60}"
        )
    if len(words) > MAX_WORDS:
        raise ValueError(
            f"extra_args[{OPTION!r}] may hold at most {MAX_WORDS} words (each is tokenized in the engine loop and "
            f"looked for at every step), got {len(words)}"
        )
    for i, word in enumerate(words):
        if not isinstance(word, str):
            raise ValueError(f"extra_args[{OPTION!r}][{i}] must be a string, got {type(word).__name__} {word!r:.40}")
        if not word.strip():
            raise ValueError(f"extra_args[{OPTION!r}][{i}] is empty; give a word or remove it")
        if len(word) > MAX_WORD_CHARS:
            raise ValueError(
                f"extra_args[{OPTION!r}][{i}] has {len(word)} characters ({word!r:.30}...); a banned word or phrase "
                f"may have at most {MAX_WORD_CHARS}"
            )
    return list(words)


def _keep_newest(cache: dict[Any, Any], most: int) -> None:
    """Drop the oldest entries of ``cache`` (insertion order) beyond ``most``."""
    for key in list(cache)[: max(0, len(cache) - most)]:
        del cache[key]
