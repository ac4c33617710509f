"""The model directory's tokenizer, when it has one (never with remote code), and what a token's bytes are."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pluginhost.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TOKENIZER_FILES", "has_tokenizer_files", "load_tokenizer", "token_bytes"]

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
        raise ConfigError(
            f"The tokenizer files in {model_dir} could not be loaded: {type(exc).__name__}: {exc}. "
            "Fix or remove them; token-id prompts work without a tokenizer."
        ) from None


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The UTF-8 bytes one token stands for, also when it holds only part of a character.

    Decoded alone, such a token is U+FFFD; its bytes then come from its piece: a byte-level BPE
    piece (GPT-2, OPT, Llama 3: each byte drawn as one character) or a SentencePiece byte
    (``<0xE2>``). A piece of neither kind gives the decoded text's bytes.
    """
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text.encode()
    if match := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
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
