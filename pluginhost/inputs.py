"""vLLM's prompt types, for programs that build them (``from vllm import TokensPrompt`` ports by changing the package).

They are plain dicts, as vLLM's are: ``LLM.generate`` and ``AsyncLLM.generate`` take them as they take any prompt
dict. vLLM's keys for other inputs (``multi_modal_data``, ``mm_processor_kwargs``) are taken only empty: pluginhost's
models read text or token ids. ``cache_salt`` is taken (pluginhost shares no cache between requests).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A prompt of text, tokenized by the model's tokenizer (its special tokens added)."""

    prompt: str
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt of token ids, run as given."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


#: Any one prompt ``generate`` takes: text, token ids, or one of the dicts above.
PromptType = str | list[int] | TextPrompt | TokensPrompt
