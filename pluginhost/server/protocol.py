"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests follow OpenAI's fields and defaults, plus vLLM's sampling extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``allowed_token_ids``, ``bad_words``,
``include_stop_str_in_output``, ``skip_special_tokens``) and ``extra_args`` (also accepted as
vLLM's ``vllm_xargs``), an object handed to plugins as
``SamplingParams.extra_args``. With the ``openai`` client, pass them through
``extra_body``. Chat also takes vLLM's ``chat_template_kwargs``, variables for
the chat template (Qwen3's ``{"enable_thinking": false}``), ``add_generation_prompt`` and
``continue_final_message``; both routes vLLM's ``request_id`` (the answer's id) and
``cache_salt`` (without effect: no cache is shared between requests).

A field neither API knows is a 400, not silently ignored: a misspelt setting is
said, not lost. Both routes take vLLM's ``prompt_logprobs`` (the prompt's own log-probabilities, with each
entry's rank and text, in vLLM's shape). Fields of OpenAI's or vLLM's API that pluginhost cannot honour
(``tools``, ``suffix``, ``reasoning_effort``...) are accepted at their neutral value (the one
that asks for nothing this server does not do) and refused as not supported at
any other. Fields that do not change the answer (``user`` and its successors
``safety_identifier`` and ``prompt_cache_key``, chat's ``store``, ``metadata``,
``service_tier``, ``parallel_tool_calls``; an assistant message's ``refusal``
or ``annotations`` sent back in a conversation) are accepted and ignored.
``null`` means a field's default, as in OpenAI's API: clients send it for
arguments left unset.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
import types
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pluginhost.chat import OVERRIDABLE
from pluginhost.sampling import VLLM_NEUTRAL, SamplingParams, check_min_tokens_within_cap, is_neutral

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "FieldError",
    "StreamOptions",
    "UsageInfo",
    "capped_max_tokens",
    "random_id",
    "template_parameters",
    "wider_logprobs",
]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    #: Fields the API has and this server does not honour: name -> the values that ask nothing of it (``null``
    #: always does). Accepted at those, then dropped; refused at any other as not supported.
    _neutral: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop a ``null`` given for an optional field that does not take one: its default applies.

        A field that takes ``null`` keeps it (completions' ``max_tokens: null``: as long as the context allows).
        A field of ``_neutral`` at a neutral value is dropped too; at another value it is refused.
        """
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        for key, value in data.items():
            if key in cls._neutral and value is not None and not is_neutral(value, cls._neutral[key]):
                raise FieldError(key, f"{key} is not supported (only {_neutral_values(cls._neutral[key])})")
        return {
            key: value
            for key, value in data.items()
            if key not in cls._neutral
            and (
                value is not None
                or key not in fields
                or fields[key].is_required()
                or _takes_none(fields[key].annotation)
            )
        }


def _neutral_values(neutral: tuple[Any, ...]) -> str:
    return " or ".join(json.dumps(n) for n in (*neutral, None))


class FieldError(ValueError):
    """A refusal of one top-level field of a request, raised in a model validator, which names the field.

    Pydantic keeps the exception in its error's ``ctx``: the server answers with ``param`` this field (a
    model validator's error has no location of its own) and the message alone, which names it already.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _takes_none(annotation: Any) -> bool:
    if annotation is Any or annotation is None:
        return True
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


class StreamOptions(_Strict):
    include_usage: bool = False
    #: vLLM's: usage so far on every chunk, not only at the end.
    continuous_usage_stats: bool = False
    #: OpenAI's: random padding on stream events against length side channels. This server sends none, which
    #: ``false`` asks for; ``true`` (OpenAI's default) changes no text either: accepted, ignored.
    include_obfuscation: bool | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


#: vLLM's extras on both routes, at their values that ask for what this server does anyway: those of its
#: ``SamplingParams`` as the Python API takes them (``null`` is neutral for every field here), and the request's.
_VLLM_NEUTRAL: Mapping[str, tuple[Any, ...]] = {
    **{
        name: tuple(value for value in VLLM_NEUTRAL[name] if value is not None)
        for name in (
            "spaces_between_special_tokens",
            "truncate_prompt_tokens",
            "structured_outputs",
        )
    },
    "logits_processors": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "priority": (0,),
}


class _SamplingFields(_Strict):
    """What completions and chat share: the sampling fields and the extras."""

    _neutral = _VLLM_NEUTRAL

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    #: OpenAI's: token ids (as strings, JSON's keys) to a bias in [-100, 100] added to their logits.
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    #: vLLM's: each choice carries its ``token_ids`` (a stream's chunk, its new ones) and the prompt's
    #: ``prompt_token_ids`` (a stream's first chunk of each choice). Always, for a model without a tokenizer.
    return_token_ids: bool = False
    #: vLLM's: logprobs name tokens ``token_id:N``, not by their text. Always, for a model without a tokenizer.
    return_tokens_as_token_ids: bool = False
    #: vLLM's: the prompt's own log-probabilities (``SamplingParams.prompt_logprobs``: k, or -1 for every token's),
    #: answered in vLLM's shape: completions' choices and chat's answer carry ``prompt_logprobs``, ``null`` for the
    #: first token, then ``{token_id: {"logprob", "rank", "decoded_token"}}`` (a stream: in its first chunk).
    prompt_logprobs: int | None = None
    #: vLLM's: the answer's ``id`` is this, after the route's prefix (``cmpl-``, ``chatcmpl-``), as in vLLM (the
    #: ``X-Request-Id`` header's first); empty: the server's own.
    request_id: str | None = None
    #: vLLM's salt for its prefix cache: taken, without effect (pluginhost shares no cache between requests).
    cache_salt: str | None = Field(default=None, min_length=1)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_to_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit() and len(token) <= 10):  # 10 digits: any real id
                shown = repr(token) if len(token) <= 20 else f"{token[:20]!r}... ({len(token)} characters)"
                raise ValueError(f'logit_bias keys must be token ids (integers as strings, e.g. "50256"), got {shown}')
            if not -100 <= bias <= 100:  # OpenAI's range; NaN fails it too
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _a_count_of_logprobs(cls, value: int | None) -> int | None:
        # Here, not only in SamplingParams: completions' echo with logprobs takes the wider of the two counts.
        if value is not None and value < -1:
            raise ValueError(f"must be an integer >= 0, or -1 for every token's, got {value}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream: true")
        if self.extra_args is not None and self.vllm_xargs is not None:
            raise FieldError("vllm_xargs", "give extra_args or vllm_xargs, not both")
        return self

    def sampling_params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` (``ValueError`` for values it refuses); its ``prompt_logprobs`` the wider
        of the request's and ``prompt_logprobs`` (completions' echo with logprobs scores the prompt too).

        ``defaults`` (the model's ``generation_config.json``, ``AsyncLLM.sampling_defaults``) fill the fields the
        request leaves out, and their ``max_tokens`` caps the request's, as in vLLM (one it leaves out is the
        engine's to fill: ``exact_max_tokens``).
        """
        defaults = defaults or {}
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        optional = {k: v for k, v in defaults.items() if k in given}
        optional.update((k, v) for k, v in given.items() if v is not None)
        # A max_tokens the request gives is capped here; one it leaves out takes the model's after the on_request
        # hooks (which may set their own), in the engine (exact_max_tokens).
        capped = capped_max_tokens(max_tokens, defaults) if max_tokens is not None else None
        if capped is not None and capped != max_tokens:
            check_min_tokens_within_cap(self.min_tokens, capped)
        return SamplingParams(
            n=self.n,
            max_tokens=capped,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logit_bias={int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=wider_logprobs(self.prompt_logprobs, prompt_logprobs),
            extra_args=self.extra_args if self.extra_args is not None else self.vllm_xargs,
            **optional,
        )


def wider_logprobs(a: int | None, b: int | None) -> int | None:
    """Of two counts of log-probabilities (``None``: none, -1: every token's), the one that reports more."""
    if a is None or b is None:
        return b if a is None else a
    return -1 if -1 in (a, b) else max(a, b)


def capped_max_tokens(asked: int | None, defaults: Mapping[str, Any]) -> int | None:
    """The tokens a request may generate: what it asked for, capped by the model's recommended ``max_tokens``."""
    caps = [n for n in (asked, defaults.get("max_tokens")) if n is not None]
    return min(caps) if caps else None


#: The most prompts one completion request lists, and the most messages one chat holds. Checked before the body is
#: validated, which happens on the event loop: a million one-token prompts held it (and ``/health``) 3 s, a million
#: one-letter messages 9 s, before the engine's own bounds refused them.
MAX_PROMPTS = 65_536
MAX_MESSAGES = 8_192
#: The most token ids one prompt given as ids holds (a context of a million tokens).
MAX_PROMPT_IDS = 2**20


def _refuse_long_list(value: Any, field: str, most: int, what: str, name: str | None = None) -> None:
    """A ``FieldError`` for ``field`` when ``value`` (``name``: the field, or one of its items) lists over ``most``."""
    if isinstance(value, list) and len(value) > most:
        raise FieldError(field, f"{name or field} holds {len(value)} {what}, more than this server reads ({most})")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    _neutral = _VLLM_NEUTRAL

    @model_validator(mode="before")
    @classmethod
    def _not_too_many_prompts(cls, data: Any) -> Any:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            _refuse_long_list(prompt, "prompt", MAX_PROMPT_IDS, "token ids")
            return data
        _refuse_long_list(prompt, "prompt", MAX_PROMPTS, "prompts")
        for index, ids in enumerate(prompt if isinstance(prompt, list) else ()):
            _refuse_long_list(ids, "prompt", MAX_PROMPT_IDS, "token ids", f"prompt {index}")
        return data

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    #: vLLM's: false tokenizes a text prompt without the tokenizer's special tokens (a client that rendered a chat
    #: template itself, which wrote them).
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        if self.max_tokens == 0 and self.min_tokens:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) must be 0 with max_tokens 0")
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of is not supported (it must equal n, or be left out)")
        return self

    @property
    def prompt_only(self) -> bool:
        """Whether the answer is the prompt alone (``echo`` with ``max_tokens`` 0, lm-eval's loglikelihood):
        the engine generates one token, which the answer leaves out, as vLLM's does."""
        return self.echo and self.max_tokens == 0

    def completion_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's ``SamplingParams``: ``echo`` with ``logprobs`` scores the prompt too, with as many of the
        most likely tokens (``prompt_logprobs``, as vLLM sets it; the wider, where the request asks for those too)."""
        return self.sampling_params(
            max_tokens=1 if self.prompt_only else self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            defaults=defaults,
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per list item (a list of ints is one prompt of token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    name: str | None = None
    # What an assistant message of an answer carries, so a client can send it back as it came.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[Any] | None = None
    # A tool message's: known, so that such a message is told tools are not supported, not of an unknown field.
    tool_call_id: str | None = None
    #: Last: fields are validated in order, and whether a message may go without content depends on the others.
    #: Checked even when left out (``validate_default``).
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: object, info: ValidationInfo) -> object:
        """Parts other than text refused in one sentence (pydantic's own message lists every branch of the union);
        the ``refusal`` part of an answer's message, sent back as it came, taken as its text."""
        if not isinstance(content, list):
            return content
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "refusal" and info.data.get("role") == "assistant" and isinstance(part.get("refusal"), str):
                parts.append({"type": "text", "text": part["refusal"]})
            elif isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content parts of type {kind!r} are not supported: pluginhost's models read text only"
                )
            else:
                parts.append(part)
        return parts

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        """A message says something, as OpenAI requires: ``content`` missing, null or ``[]`` is refused.

        OpenAI lets an assistant message go without content only when it carries ``tool_calls`` or
        ``function_call``, which this server refuses (it calls no tools); an answer's message sent
        back as it came may have a ``refusal`` instead, which is then its text. A tool message is
        refused for its role.
        """
        role, given = info.data.get("role"), info.data
        if isinstance(content, list) and not content:  # OpenAI: an array of at least one part
            raise ValueError("content is an empty list of parts: give at least one text part, or a string")
        stands_in = given.get("refusal") is not None or bool(given.get("tool_calls")) or given.get("function_call")
        if content is not None or role in (None, "tool") or (role == "assistant" and stands_in):
            return content  # no role (refused already), tools (refused as such by ``_no_tools_or_audio``)
        if role == "assistant":
            raise ValueError("an assistant message needs content (or the refusal an answer came with)")
        raise ValueError(f"a {role} message needs content: a string, or a list of text parts")

    @model_validator(mode="after")
    def _no_tools_or_audio(self) -> ChatMessage:
        if self.role == "tool":
            raise ValueError("tool messages are not supported: pluginhost does not call tools")
        if self.tool_calls or self.function_call is not None:
            raise ValueError("tool calls are not supported: pluginhost does not call tools")
        if self.audio is not None:
            raise ValueError("audio is not supported")
        return self

    @property
    def template_role(self) -> str:
        """The role a chat template knows: ``developer`` is OpenAI's newer name for ``system``."""
        return "system" if self.role == "developer" else self.role

    def for_template(self) -> dict[str, str]:
        """The message as a chat template reads it: its template role, its text, and a speaker's ``name`` (as vLLM
        passes it). Every chat is rendered from this (the server's route and ``LLM.chat``: ``pluginhost.chat``)."""
        return {"role": self.template_role, "content": self.text(), **({"name": self.name} if self.name else {})}

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins a message's text parts


#: apply_chat_template's parameters chat_template_kwargs may set, overriding the request's fields, as in vLLM and
#: ``LLM.chat``: what ``LLM.chat`` lets them override, but the template itself (a request's own is refused).
_OVERRIDING = OVERRIDABLE - {"chat_template"}

#: apply_chat_template's own parameters, which chat_template_kwargs may not set: the request's fields decide them
#: (with the installed transformers' others: ``template_parameters``).
_TEMPLATE_PARAMETERS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


@functools.cache
def template_parameters() -> frozenset[str]:
    """``_TEMPLATE_PARAMETERS`` and every other named parameter of the installed transformers' ``apply_chat_template``
    (5.x added ``sanitize_control_tokens``, which then failed the render, blamed on the messages)."""
    from transformers import PreTrainedTokenizerBase

    signature = inspect.signature(PreTrainedTokenizerBase.apply_chat_template)
    named = {n for n, p in signature.parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return _TEMPLATE_PARAMETERS | (named - {"self"})


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    _neutral = _VLLM_NEUTRAL | {
        # OpenAI's, for models that reason, speak, search or call functions
        "reasoning_effort": (),
        "verbosity": (),
        "prediction": (),
        "modalities": (["text"],),
        "audio": (),
        "web_search_options": (),
        "functions": ([],),
        "function_call": ("none", "auto"),
        # vLLM's
        "echo": (False,),
        "add_special_tokens": (False,),
        "chat_template": (),
        "documents": (),
        "mm_processor_kwargs": (),
    }

    messages: list[ChatMessage] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _not_too_many_messages(cls, data: Any) -> Any:
        messages = data.get("messages") if isinstance(data, dict) else None
        _refuse_long_list(messages, "messages", MAX_MESSAGES, "messages")
        return data

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # Accepted, and without effect on the answer.
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's: variables for the chat template, and how it ends the prompt (a new assistant message, or going on
    # with the last one: an answer begun for the model)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted((template_parameters() - _OVERRIDING) & (value or {}).keys())
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the request's own fields decide it")
        for name in _OVERRIDING & (value or {}).keys():
            if not isinstance(value[name], bool):  # type: ignore[index]
                raise ValueError(f"{name} must be true or false, got {value[name]!r}")  # type: ignore[index]
        return value

    def template_arguments(self) -> tuple[dict[str, Any], bool, bool]:
        """The chat template's variables, ``add_generation_prompt`` and ``continue_final_message``: the request's,
        overridden by its ``chat_template_kwargs`` (as vLLM's server and ``LLM.chat`` take them)."""
        variables = dict(self.chat_template_kwargs or {})
        add = variables.pop("add_generation_prompt", self.add_generation_prompt)
        going_on = variables.pop("continue_final_message", self.continue_final_message)
        return variables, add, going_on

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.tools:
            raise FieldError("tools", "tools are not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "tool_choice is not supported")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise FieldError("response_format", 'response_format is not supported (only {"type": "text"})')
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them."""
        return [m.for_template() for m in self.messages]
