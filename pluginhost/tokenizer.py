"""The model directory's tokenizer, when it has one (never with remote code), and what a token's bytes are."""

from __future__ import annotations

import functools
import json
import re
import unicodedata
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pluginhost.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TOKENIZER_FILES",
    "has_tokenizer_files",
    "load_tokenizer",
    "most_chars_per_token",
    "token_bytes",
    "token_text",
]

#: The files whose presence means a model directory has a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer_files(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a tokenizer's files (checked without importing transformers)."""
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """``AutoTokenizer`` for ``model_dir``, or ``None`` when it holds no tokenizer files."""
    if not has_tokenizer_files(model_dir):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        if _names_own_code(model_dir):  # transformers' advice (trust_remote_code=True) is not pluginhost's
            raise ConfigError(
                f"The tokenizer in {model_dir} needs code of its own (auto_map in tokenizer_config.json), which "
                "pluginhost never runs from a model directory. Provide a standard tokenizer (tokenizer.json), or "
                "remove the tokenizer files: token-id prompts work without one."
            ) from None
        raise ConfigError(
            f"The tokenizer files in {model_dir} could not be loaded: {type(exc).__name__}: {exc}. "
            "Fix or remove them; token-id prompts work without a tokenizer."
        ) from None


def _names_own_code(model_dir: Path) -> bool:
    """Whether the tokenizer's configuration names a class defined by code in the model directory (``auto_map``)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("auto_map"))


#: SentencePiece's drawing of a space, at the start of a word's piece (``▁the``).
_SPACE_MARK = "\u2581"
#: A SentencePiece byte-fallback piece: one byte of UTF-8 (``<0xE2>``).
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """The text one token stands for where it stands in a text: the pieces of a logprobs answer add up to its text.

    Decoding a token alone is not quite that with a SentencePiece tokenizer (Llama 2, Mistral): its decoder drops
    the space that begins a text, so ``▁quick`` alone decodes to ``quick``. The spaces its piece begins with, and
    the decoded text lacks, are put back, as vLLM does.
    """
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and (byte := _BYTE_PIECE.fullmatch(piece)) and int(byte.group(1), 16) < 0x80:
        return chr(int(byte.group(1), 16))  # an ASCII byte is its character: <0x20> alone decoded to "", stripped
    text = tokenizer.decode([token_id])
    if isinstance(piece, str) and piece.startswith(_SPACE_MARK):
        marks = len(piece) - len(piece.lstrip(_SPACE_MARK))
        missing = marks - (len(text) - len(text.lstrip(" ")))
        if missing > 0:
            text = " " * missing + text
    return text


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The UTF-8 bytes one token stands for (``token_text``'s), also when it holds only part of a character.

    Decoded alone, such a token is U+FFFD; its bytes then come from its piece: a byte-level BPE
    piece (GPT-2, OPT, Llama 3: each byte drawn as one character) or a SentencePiece byte
    (``<0xE2>``). A piece of neither kind gives the decoded text's bytes.
    """
    text = token_text(tokenizer, token_id)
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text.encode()
    if match := _BYTE_PIECE.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    byte_of = _byte_level_alphabet()
    if piece and all(char in byte_of for char in piece):
        return bytes(byte_of[char] for char in piece)
    return text.encode()


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's drawing of the 256 bytes as characters (GPT-2's ``bytes_to_unicode``), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(code): b for b, code in chars.items()}


def most_chars_per_token(tokenizer: Any) -> int | None:  # noqa: ANN401 - any tokenizer a model directory holds
    """The most characters of a text one token of ``tokenizer`` can stand for; ``None`` when it cannot be bounded.

    A text of ``c`` characters then encodes to at least ``c / most`` tokens, so a prompt far too long for the
    model is refused without tokenizing it (megabytes take seconds and gigabytes of memory). The bound must
    never be too low: it is worked out from what the tokenizer does to a text, and is ``None`` (no
    shortcut) wherever a step may drop characters without a token for them (stripping accents or whitespace,
    whitespace splitting, an unknown token that takes any run of characters, special tokens that take the
    whitespace beside them, a slow tokenizer whose Python code could do anything). Computed once per tokenizer.
    """
    try:
        return _MOST_CHARS[tokenizer]
    except (KeyError, TypeError):  # TypeError: an object without weak references, worked out every time
        pass
    most = _most_chars_per_token(tokenizer)
    try:
        _MOST_CHARS[tokenizer] = most
    except TypeError:
        pass
    return most


_MOST_CHARS: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def _most_chars_per_token(tokenizer: Any) -> int | None:  # noqa: ANN401 - any tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer's pipeline
    if backend is None or not hasattr(backend, "get_vocab"):
        return None
    try:
        shrink = _normalizer_shrink(_state(backend.normalizer))
        if shrink is None or not _keeps_every_character(_state(backend.pre_tokenizer)):
            return None
        added = backend.get_added_tokens_decoder().values()
        if any(token.lstrip or token.rstrip for token in added):  # the whitespace beside them goes with them
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        byte_level = "ByteLevel" in backend.pre_tokenizer.__getstate__().decode() if backend.pre_tokenizer else False
        unknown = _unknown_token_chars(backend.model, vocab, byte_level=byte_level)
    except Exception:  # noqa: BLE001 - an unexpected tokenizer: no shortcut, the prompt is tokenized as before
        return None
    if unknown is None or not vocab:
        return None
    # A token's piece has at least one character for each it stands for: byte-level pieces draw each byte as
    # a character (and a character has at least one byte), other pieces are the text itself, or more ("##",
    # "</w>", "<0x41>"). The normalizer may have shrunk the text before: ``shrink`` input characters at most
    # per character it leaves.
    return shrink * max(unknown, *(len(piece) for piece in vocab))


def _state(component: Any) -> dict[str, Any] | None:  # noqa: ANN401 - a tokenizers component, or None
    """A pipeline component's settings, as the ``tokenizer.json`` it was read from holds them."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(state: dict[str, Any] | None) -> int | None:
    """The most input characters a normalizer turns into one; ``None`` when it may drop characters outright."""
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        shrinks = [_normalizer_shrink(part) for part in state.get("normalizers", [])]
        if any(s is None for s in shrinks):
            return None
        product = 1
        for s in shrinks:
            product *= s  # type: ignore[operator]
        return product
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):  # they only ever add or change characters
        return 1
    if kind in ("NFC", "NFKC"):  # canonical composition: a character for each base and the marks it takes
        return _longest_canonical_decomposition()
    if kind == "Replace":
        pattern, content = state.get("pattern", {}), state.get("content", "")
        if "String" in pattern and content:  # a fixed string for another: what it shrinks by, rounded up
            return max(1, -(-len(pattern["String"]) // len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, a regular expression... may drop characters


def _keeps_every_character(state: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer leaves every character of the text in some piece (whitespace splitting drops it)."""
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(part) for part in state.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return state.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _unknown_token_chars(model: Any, vocab: dict[str, int], *, byte_level: bool) -> int | None:  # noqa: ANN401
    """The most characters a token stands for where the vocabulary lacks them (0: it never does); ``None``: any.

    BPE: byte-level with all 256 bytes in the vocabulary never lacks one; byte fallback gives a token per
    byte, an unfused unknown token one per character. Without any of these, BPE drops what its
    vocabulary lacks, with no token at all. WordPiece makes a whole word one unknown token, and the
    pre-tokenizers that keep every character keep whole words of any length. Unigram fuses runs of
    unknown characters; WordLevel makes any word unknown.
    """
    if type(model).__name__ != "BPE":
        return None
    if byte_level and all(char in vocab for char in _byte_level_alphabet()):
        return 0
    if model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return 1
    return 1 if model.unk_token is not None and not model.fuse_unk else None


@functools.cache
def _longest_canonical_decomposition() -> int:
    """The most code points one character stands for in canonical decomposition (4, as Unicode 15 has it).

    NFC composes no more than that into one character; Unicode's stability policy freezes which characters
    composition makes, so Python's tables bound the Rust tokenizers' too.
    """
    return max(len(unicodedata.normalize("NFD", chr(code))) for code in range(0x110000) if not 0xD800 <= code < 0xE000)
