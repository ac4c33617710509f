"""Conversations through the tokenizer's chat template: the prompt ``LLM.chat`` and the server's chat route run.

Both read messages as OpenAI's API writes them (``server.protocol.ChatMessage``: text or text parts, the
``developer`` role as ``system``; no tools, images or audio) and render them the same way, so a conversation
gives the same tokens offline and served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pluginhost.errors import InvalidParameterError

__all__ = ["OVERRIDABLE", "chat_prompts", "conversation_of", "render_chat"]

#: What ``LLM.chat``'s own arguments decide, which ``chat_template_kwargs`` may override (as in vLLM).
OVERRIDABLE = frozenset({"chat_template", "add_generation_prompt", "continue_final_message"})


def chat_prompts(
    tokenizer: Any,
    messages: Any,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``LLM.chat``'s conversation (a list of messages), or list of them, as prompt dicts; ``[]`` for none.

    As vLLM's: ``chat_template_kwargs`` go over the other arguments (``{"add_generation_prompt": False}`` there
    is as good as the argument), and ``tokenize`` in them is dropped (the prompt is tokenized after rendering).
    Raises ``InvalidParameterError`` naming the conversation and message that are wrong.
    """
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        raise InvalidParameterError(
            "messages must be a conversation (a list of messages such as {'role': 'user', 'content': 'Hi'}), or a "
            f"list of them, got {messages!r:.80}",
            param="messages",
        )
    messages = list(messages)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise InvalidParameterError(
            f"chat_template_kwargs must be a dict of the template's variables, got {chat_template_kwargs!r:.80}",
            param="chat_template_kwargs",
        )
    settings: dict[str, Any] = {
        "chat_template": chat_template,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        **(chat_template_kwargs or {}),
    }
    settings.pop("tokenize", None)
    from pluginhost.server.protocol import template_parameters

    taken = sorted((template_parameters() - OVERRIDABLE) & settings.keys())
    if taken:
        raise InvalidParameterError(
            f"chat_template_kwargs cannot set {', '.join(taken)}: apply_chat_template's own parameters, which "
            "LLM.chat decides",
            param="chat_template_kwargs",
        )
    several = bool(messages) and isinstance(messages[0], Sequence) and not isinstance(messages[0], str | bytes)
    conversations = messages if several else [messages] if messages else []
    prompts = []
    for index, conversation in enumerate(conversations):
        try:
            prompts.append(
                render_chat(
                    tokenizer,
                    conversation_of(conversation),
                    chat_template=settings["chat_template"],
                    add_generation_prompt=settings["add_generation_prompt"],
                    continue_final_message=settings["continue_final_message"],
                    variables={k: v for k, v in settings.items() if k not in OVERRIDABLE},
                )
            )
        except InvalidParameterError as exc:
            if not several:
                raise
            raise InvalidParameterError(f"conversation {index}: {exc}", param=exc.param) from None
    return prompts


def conversation_of(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """OpenAI-style messages (dicts) as the chat template reads them; ``InvalidParameterError`` (``param``
    "messages") saying which message is wrong and why."""
    from pydantic import TypeAdapter, ValidationError

    from pluginhost.server.protocol import ChatMessage

    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidParameterError(
            "messages must be a non-empty list of messages ({'role': 'user', 'content': 'Hi'}), got "
            f"{messages!r:.80}",
            param="messages",
        )
    try:
        parsed = TypeAdapter(list[ChatMessage]).validate_python(list(messages))
    except ValidationError as exc:
        raise InvalidParameterError("; ".join(_said(e) for e in exc.errors()), param="messages") from None
    return [m.for_template() for m in parsed]


def _said(error: Mapping[str, Any]) -> str:
    """One pydantic error about a message, as ``message 1: content: ...``."""
    where = list(error.get("loc", ()))
    prefix = f"message {where.pop(0)}" if where and isinstance(where[0], int) else "messages"
    field = ".".join(str(p) for p in where)
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    got = "" if error.get("type") == "value_error" else f" (got {error.get('input')!r:.80})"
    return f"{prefix}: {field + ': ' if field else ''}{message}{got}"


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, str]],
    *,
    variables: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    check_length: Callable[[int, str], None] | None = None,
) -> dict[str, Any]:
    """The conversation through the chat template, as a prompt dict: its text and token ids.

    The ids are the text's tokens without the tokenizer's own special tokens: the template writes those it wants
    (a BOS the tokenizer added again would be the model's second). ``variables`` are the template's to read
    (vLLM's ``chat_template_kwargs``); ``chat_template`` replaces the tokenizer's; ``check_length`` refuses a text
    far too long before it is tokenized. Raises ``InvalidParameterError`` (``param`` "messages") when the
    template cannot render the messages.
    """
    if tokenizer is None:
        raise InvalidParameterError("a chat needs the model's tokenizer, and this model has none", param="messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidParameterError(
            "the model's tokenizer has no chat template (tokenizer_config.json's chat_template): pass one "
            "(chat_template=...), or render the prompt yourself and generate from it",
            param="messages",
        )
    if add_generation_prompt and continue_final_message:
        raise InvalidParameterError(
            "continue_final_message continues the last message, add_generation_prompt starts a new one: "
            "set add_generation_prompt=False to continue",
            param="continue_final_message",
        )
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tokenize=False,
            **(variables or {}),
        )
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja's errors, raise_exception)
        raise InvalidParameterError(
            f"the chat template cannot render these messages: {exc}", param="messages"
        ) from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\udce9"): the tokenizer would raise a TypeError
        raise InvalidParameterError(
            f"the messages are not valid Unicode: {text[exc.start]!r}, {exc.reason}", param="messages"
        ) from None
    if check_length is not None:
        check_length(0, text)
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not token_ids:  # the engine would say "an empty list of token ids", which the caller never gave
        raise InvalidParameterError("the chat template renders these messages to an empty prompt", param="messages")
    return {"prompt": text, "prompt_token_ids": token_ids}
