"""Turning generated tokens into text one token at a time, and finding stop strings.

Decoding each new token alone is wrong twice over: a multi-byte character
split across tokens decodes to U+FFFD halves, and tokenizers that mark spaces
on the token (SentencePiece's "▁") drop a leading space without context. So,
as in vLLM and text-generation-inference, each step decodes a short window of
tokens twice, with and without the newest one, and keeps the difference
only once it no longer ends in an incomplete character. The window starts with
a few prompt tokens, for context.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pluginhost.tokenizer import token_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IncrementalDetokenizer"]

#: Prompt tokens decoded as context before the first generated one.
CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"
#: UTF-8 bytes 0x80-0xBF continue a character; 0xC0 and above begin one.
_CONTINUATION_BYTE_MIN, _LEAD_BYTE_MIN = 0x80, 0xC0


class IncrementalDetokenizer:
    """The text of one sequence's generated tokens, grown token by token.

    ``stop`` strings end the text before them (``include_stop``: after them,
    as vLLM's ``include_stop_str_in_output``): ``push`` then reports the
    string found, and ``text`` no longer grows. Special tokens are left out of
    the text unless ``skip_special_tokens`` is false (vLLM's setting).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        # Decoded window: ids[prefix:read] is text already emitted (context included). A prompt that ends inside
        # a character (an answer cut off by max_tokens, sent back as ids) leaves its start unread: the tokens
        # that finish it make the character the first of the text, and no generated character is lost to the
        # U+FFFDs its bytes decoded to (one per byte with SentencePiece's byte fallback). The context begins
        # at a character too (see ``_finished_head``).
        self._prefix = 0
        self._read = len(self._ids)
        self._tail_checked = False  # at the first push: in the engine's thread, not where requests are prepared
        self._stop = tuple(stop)
        self._include_stop = include_stop
        # Decoding skips them: left out of the window, so a run of them (end-of-sequence under ignore_eos, padding)
        # is not decoded again at every token after it.
        self._skip_special = skip_special_tokens
        self._skipped = frozenset(getattr(tokenizer, "all_special_ids", ()) if skip_special_tokens else ())
        self.text = ""

    @property
    def stop_buffer(self) -> int:
        """How many trailing characters may still turn out to start a stop string (withheld when streaming; none
        when the stop string stays in the text)."""
        if self._include_stop:
            return 0
        return max((len(s) for s in self._stop), default=1) - 1

    def push(self, token_id: int, *, check_stop: bool = True) -> str | None:
        """Add a generated token; return the stop string it completed, if any (``check_stop``)."""
        if not self._tail_checked:
            head = self._finished_head()
            # Kept whole when nothing would be left: an empty window loses the first token's leading space
            # (SentencePiece's decoder strips the text's first), and a lone stray byte breaks no run of bytes.
            self._prefix = head if head < len(self._ids) else 0
            self._read = max(self._prefix, self._read - self._unfinished_tail())
            self._tail_checked = True
        if token_id in self._skipped:
            return None
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return None  # wait for the rest of the character (or the token decodes to nothing)
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return self._find_stop(len(delta)) if check_stop else None

    def flush(self) -> None:
        """At the end: keep whatever is left undecoded, but a character the last tokens left incomplete.

        Its bytes were never a character (``max_tokens`` cut it): shown, it would be U+FFFD, half
        a character at the end of the text (one U+FFFD for byte-level tokenizers, one per byte for
        SentencePiece's byte fallback). vLLM leaves it out too; the tokens stay in ``token_ids``.
        """
        pending = self._ids[self._read :]
        inside, cut = _cut_off_character(self._tokenizer, pending, self._skipped)
        pending = pending[: len(pending) - inside]
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix : self._read + len(pending)])
        if len(after) > len(before):
            delta = after[len(before) :]
            if cut and delta.endswith(_INCOMPLETE):  # a token holding the character's start after other text
                delta = delta[:-1]
            self.text += delta
        self._prefix = self._read = len(self._ids)

    def _finished_head(self) -> int:
        """How many of the context's first tokens hold nothing but the end of a character begun before it.

        Left out of the window: SentencePiece's byte fallback decodes a run of byte tokens that is not UTF-8 as a
        whole to one U+FFFD per byte, so a window starting inside a character (the prompt's last 5 tokens cut an
        emoji) turned every generated byte token that continued the run into U+FFFDs.
        """
        head = 0
        for token in self._ids:
            piece = b"" if token in self._skipped else token_bytes(self._tokenizer, token)
            if piece and not all(_CONTINUATION_BYTE_MIN <= byte < _LEAD_BYTE_MIN for byte in piece):
                break
            head += 1
        return head

    def _unfinished_tail(self) -> int:
        """How many of the context's last tokens hold nothing but the start of a character it does not finish."""
        if not self._ids or not self._decode(self._ids).endswith(_INCOMPLETE):
            return 0
        return _cut_off_character(self._tokenizer, self._ids, self._skipped)[0]

    def _find_stop(self, new_chars: int) -> str | None:
        """The stop string the text ends soonest at, of those the new characters complete; cut the text there.

        Soonest: the earliest start, where the text ends before it; the earliest end, where it keeps the string
        (a later-starting one may end first: ``"m"`` in ``"umps"``, and no stop string is left whole mid-text).
        """
        found: tuple[int, str] | None = None
        for stop in self._stop:
            # Only where the new characters could complete it.
            index = self.text.find(stop, max(0, len(self.text) - new_chars - len(stop) + 1))
            if index < 0:
                continue
            cut = index + len(stop) if self._include_stop else index
            if found is None or cut < found[0]:
                found = (cut, stop)
        if found is None:
            return None
        cut, stop = found
        self.text = self.text[:cut]
        return stop

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)


def _cut_off_character(tokenizer: PreTrainedTokenizerBase, ids: list[int], skipped: frozenset[int]) -> tuple[int, int]:
    """A character the bytes of ``ids`` start without finishing: how many of the last ids hold nothing but its
    bytes (or are ``skipped`` in decoding, as special tokens are), and how many of its bytes are left in the id
    before them (a token holding text, then the character's start). ``(0, 0)``: none."""
    pieces = [b"" if token in skipped else token_bytes(tokenizer, token) for token in ids]
    cut, inside = _cut_off_bytes(b"".join(pieces)), 0
    while cut and inside < len(pieces) and len(pieces[-1 - inside]) <= cut:
        cut -= len(pieces[-1 - inside])
        inside += 1
    return inside, cut


def _cut_off_bytes(data: bytes) -> int:
    """How many bytes at the end of ``data`` start a UTF-8 character without finishing it."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data)  # not final: a character cut off at the end stays in the decoder's buffer
    return len(decoder.getstate()[0])
