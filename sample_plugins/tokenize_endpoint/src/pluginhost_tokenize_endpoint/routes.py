"""The two routes, their request bodies (pydantic) and their answers, as vLLM's.

The tokenizer runs in the engine's input thread (``engine.off_loop``), where the completion routes
prepare their prompts, never on the event loop: a text of megabytes takes seconds to tokenize, and
the loop serves every other client (and ``/health``) meanwhile. A text longer than ``max_model_len``
tokens could ever hold is refused before it is tokenized, as the completion routes refuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from pluginhost.errors import PromptTooLongError
from pluginhost.server.app import APIError, bad_request
from pluginhost.server.protocol import ChatMessage

__all__ = ["DetokenizeRequest", "TokenizeRequest", "add_routes"]


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (a chat, through the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    #: Add the tokenizer's special tokens (its BOS): default true for a prompt, false for messages
    #: (the template writes its own), as the completion endpoints do.
    add_special_tokens: bool | None = None
    #: End the rendered chat with the assistant's turn opening, as ``/v1/chat/completions`` does.
    add_generation_prompt: bool = True
    #: Also answer each token's string (``token_strs``).
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (text) or messages (a chat), exactly one of them")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]


def add_routes(app: FastAPI, engine: Any) -> None:
    """Add ``POST /tokenize`` and ``POST /detokenize`` to ``app``, answering with ``engine``'s tokenizer."""

    def tokenizer_for(model: str | None) -> Any:
        served = getattr(app.state, "served_model_name", None)
        if model is not None and served is not None and model != served:
            raise APIError(
                404,
                f"The model `{model}` does not exist: this server serves `{served}` (GET /v1/models).",
                type="not_found_error",
                code="model_not_found",
                param="model",
            )
        tokenizer = engine.get_tokenizer()
        if tokenizer is None:
            raise bad_request(f"the model {engine.config.model} has no tokenizer; nothing to tokenize with")
        return tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tokenizer = tokenizer_for(body.model)
        if body.messages is not None and not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template (its tokenizer_config.json sets none); tokenize a prompt",
                param="messages",
            )
        field = "prompt" if body.messages is None else "messages"
        try:
            answer = await engine.off_loop(_tokenize, tokenizer, body, engine.input_processor.check_text_length)
        except PromptTooLongError as exc:
            message = str(exc).replace("prompt 0 has", "the prompt has")
            if field == "messages":
                message = message.replace("the prompt has", "the messages come to").replace("prompt.", "messages.")
            raise bad_request(message, param=field, code="context_length_exceeded") from None
        return {**answer, "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        tokenizer = tokenizer_for(body.model)
        return {"prompt": await engine.off_loop(_detokenize, tokenizer, body.tokens)}


def _tokenize(tokenizer: Any, body: TokenizeRequest, check_length: Callable[[int, str], None]) -> dict[str, Any]:
    """``/tokenize``'s tokens (and their strings), in the engine's input thread; ``check_length`` refuses a text far
    too long (``PromptTooLongError``) before it is tokenized."""
    if body.messages is not None:
        conversation = [m.for_template() for m in body.messages]  # as /v1/chat/completions renders them
        try:
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=body.add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja's errors, raise_exception)
            raise bad_request(f"the chat template cannot render these messages: {exc}", param="messages") from None
        add_special_tokens = bool(body.add_special_tokens)
    else:
        text = body.prompt
        add_special_tokens = body.add_special_tokens is not False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\udce9"): the tokenizer would raise a TypeError
        field = "prompt" if body.messages is None else "messages"
        raise bad_request(f"the {field} is not valid Unicode: {text[exc.start]!r}, {exc.reason}", param=field) from None
    check_length(0, text)
    tokens = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    answer: dict[str, Any] = {"tokens": tokens, "count": len(tokens)}
    if body.return_token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return answer


def _detokenize(tokenizer: Any, tokens: list[int]) -> str:
    """``/detokenize``'s text, in the engine's input thread (a 400 for ids outside the vocabulary)."""
    size = len(tokenizer)
    bad = [t for t in tokens if not 0 <= t < size]
    if bad:
        raise bad_request(f"token id(s) {bad[:5]} are outside the tokenizer's vocabulary [0, {size})", param="tokens")
    return tokenizer.decode(tokens)
