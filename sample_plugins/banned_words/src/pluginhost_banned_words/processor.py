"""The banned-words logits processor: vLLM v1's ``LogitsProcessor`` interface, pluginhost's imports.

The classic "bad words" processor, per request. For each banned word, its
token sequences (the word as written, and with a leading space, as it reads
mid-text) are split into a prefix and a last token; at each step a row's
last tokens are banned when its generated tokens end with their prefix
(an empty prefix always matches). Only generated tokens count, not the
prompt's, as in vLLM.

The engine keeps one instance per engine and tells it how the batch changed
(``update_state``): per-row state follows rows as they are added, removed,
moved and swapped, and reads each row's live list of generated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pluginhost.errors import ConfigError
from pluginhost.logits_processors import BatchUpdate, LogitsProcessor, MoveDirectionality
from pluginhost.sampling import SamplingParams
from pluginhost.tokenizer import TOKENIZER_FILES, load_tokenizer
from pluginhost_banned_words import OPTION

__all__ = ["BannedWordsLogitsProcessor"]

#: Tokenized words kept per engine (the tokenization of a word never changes).
_MAX_CACHED_WORDS = 4096


@dataclass
class _Row:
    """One request's banned token sequences, and its generated tokens (the engine's live list)."""

    #: Tokens banned at every step: the last (only) token of one-token words.
    always: list[int]
    #: (prefix, last token) of longer words: the last token is banned right after the prefix.
    after: list[tuple[tuple[int, ...], int]]
    output: Sequence[int]

    def banned_now(self) -> list[int]:
        banned = list(self.always)
        n = len(self.output)
        for prefix, last in self.after:
            k = len(prefix)
            if k <= n and tuple(self.output[n - k :]) == prefix:
                banned.append(last)
        return banned


class BannedWordsLogitsProcessor(LogitsProcessor):
    """Bans ``extra_args["banned_words"]`` per request; not argmax-invariant (it changes which token wins)."""

    def __init__(self, config: Any, device: torch.device) -> None:
        self._model_dir = Path(config.model).expanduser()
        self._tokenizer: Any = None  # loaded at the first request that bans words
        self._tokenized: dict[str, list[tuple[int, ...]]] = {}
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
                rows[row] = self._row(words, output_ids)
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
        for row, state in self._rows.items():
            banned = [t for t in state.banned_now() if t < vocab]
            if banned:
                logits[row, banned] = float("-inf")
        return logits

    # -- tokenizing ------------------------------------------------------------------------------

    def _row(self, words: list[str], output: Sequence[int]) -> _Row:
        always: set[int] = set()
        after: set[tuple[tuple[int, ...], int]] = set()
        for index, word in enumerate(words):
            for ids in self._token_sequences(index, word):
                if len(ids) == 1:
                    always.add(ids[0])
                else:
                    after.add((ids[:-1], ids[-1]))
        return _Row(sorted(always), sorted(after), output)

    def _token_sequences(self, index: int, word: str) -> list[tuple[int, ...]]:
        """The word's token ids as written and with one leading space (each once); ``ValueError`` if one is empty.

        A word the tokenizer spells with no token of its own (characters its vocabulary lacks and drops,
        or only whitespace) cannot be banned: it is the request's error, never silently dropped.
        """
        cached = self._tokenized.get(word)
        if cached is not None:
            return cached
        tokenizer = self._load_tokenizer()
        variants: list[tuple[int, ...]] = []
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not ids or not tokenizer.decode(ids).strip():
                raise ValueError(
                    f"extra_args[{OPTION!r}][{index}] {word!r:.60} encodes to no token of its own with the model's "
                    f"tokenizer ({text!r:.60} -> {list(ids)}), so it cannot be banned; remove it, or write it as "
                    "the model spells it"
                )
            if ids not in variants:
                variants.append(ids)
        if len(self._tokenized) >= _MAX_CACHED_WORDS:
            self._tokenized.clear()
        self._tokenized[word] = variants
        return variants

    def _load_tokenizer(self) -> Any:
        """The model directory's tokenizer, found and loaded as the engine loads its own (never a stand-in)."""
        if self._tokenizer is None:
            try:
                tokenizer = load_tokenizer(self._model_dir)
            except ConfigError as exc:
                raise RuntimeError(f"banned_words needs the model's tokenizer, and it does not load: {exc}") from None
            if tokenizer is None:
                raise RuntimeError(
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
    for i, word in enumerate(words):
        if not isinstance(word, str):
            raise ValueError(f"extra_args[{OPTION!r}][{i}] must be a string, got {type(word).__name__} {word!r:.40}")
        if not word.strip():
            raise ValueError(f"extra_args[{OPTION!r}][{i}] is empty; give a word or remove it")
    return list(words)
