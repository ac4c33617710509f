"""The model directory's tokenizer, when it has one (never with remote code)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pluginhost.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["load_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """``AutoTokenizer`` for ``model_dir``, or ``None`` when it holds no tokenizer files."""
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ConfigError(
            f"The tokenizer files in {model_dir} could not be loaded: {type(exc).__name__}: {exc}. "
            "Fix or remove them; token-id prompts work without a tokenizer."
        ) from None
