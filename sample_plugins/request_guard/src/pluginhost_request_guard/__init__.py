"""pluginhost-request-guard: an operator's limits on each request, through the ``on_request`` hook.

From the environment, read at every request (parsing is cached, so a
request costs a few dictionary look-ups), and checked once when an engine is
built (``pre_load``: a malformed value stops the engine, naming the
variable):

* ``PLUGINHOST_GUARD_MAX_PROMPT_TOKENS``: the most prompt tokens;
* ``PLUGINHOST_GUARD_MAX_TOKENS``: the most tokens a request may generate
  (``max_tokens``). A request asking for more is refused, or capped with
  ``PLUGINHOST_GUARD_MAX_TOKENS_ACTION=cap``; one that sets no ``max_tokens``
  gets this limit;
* ``PLUGINHOST_GUARD_MAX_N``: the most samples per prompt (``n``);
* ``PLUGINHOST_GUARD_BLOCKED_WORDS``: comma-separated words or phrases a
  prompt may not contain (case-insensitive, whole words). Prompts given as
  token ids cannot be read, so they are refused while this is set.

Unset (or empty) variables set no limit. A refusal is a ``ValueError``
saying which limit and how to change it: ``LLM.generate`` raises it (as a
``RequestRefusedError`` naming this plugin), the server answers 400 with it.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from pluginhost import hookimpl

__all__ = [
    "BLOCKED_WORDS",
    "GuardSettingsError",
    "Limits",
    "MAX_N",
    "MAX_PROMPT_TOKENS",
    "MAX_TOKENS",
    "MAX_TOKENS_ACTION",
    "VARIABLES",
    "current_limits",
    "on_request",
    "pre_load",
]

MAX_PROMPT_TOKENS = "PLUGINHOST_GUARD_MAX_PROMPT_TOKENS"
MAX_TOKENS = "PLUGINHOST_GUARD_MAX_TOKENS"
MAX_TOKENS_ACTION = "PLUGINHOST_GUARD_MAX_TOKENS_ACTION"
MAX_N = "PLUGINHOST_GUARD_MAX_N"
BLOCKED_WORDS = "PLUGINHOST_GUARD_BLOCKED_WORDS"
VARIABLES = (MAX_PROMPT_TOKENS, MAX_TOKENS, MAX_TOKENS_ACTION, MAX_N, BLOCKED_WORDS)

_ASK = "or ask the operator to raise the limit"


class GuardSettingsError(RuntimeError):
    """A malformed ``PLUGINHOST_GUARD_*`` variable: the operator's error, not the client's (not a ValueError)."""


@dataclass(frozen=True)
class Limits:
    """The limits in force (``None``: no limit)."""

    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    cap_max_tokens: bool = False
    max_n: int | None = None
    blocked_words: tuple[str, ...] = ()
    blocked: re.Pattern[str] | None = None


def current_limits() -> Limits:
    """The limits the environment sets now; ``GuardSettingsError`` naming a malformed variable."""
    return _parse(tuple(os.environ.get(name, "") for name in VARIABLES))


@functools.lru_cache(maxsize=16)
def _parse(values: tuple[str, ...]) -> Limits:
    raw = dict(zip(VARIABLES, values, strict=True))
    action = raw[MAX_TOKENS_ACTION].strip().lower() or "refuse"
    if action not in ("refuse", "cap"):
        raise GuardSettingsError(f"{MAX_TOKENS_ACTION}={raw[MAX_TOKENS_ACTION]!r} must be 'refuse' or 'cap'")
    words = tuple(dict.fromkeys(w.strip() for w in raw[BLOCKED_WORDS].split(",") if w.strip()))
    blocked = None
    if words:
        # Any run of whitespace in the text matches a space in a phrase: "secret  key" is "secret key".
        alternatives = "|".join(r"\s+".join(map(re.escape, w.split())) for w in sorted(words, key=len, reverse=True))
        blocked = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)
    return Limits(
        max_prompt_tokens=_positive_int(MAX_PROMPT_TOKENS, raw[MAX_PROMPT_TOKENS]),
        max_tokens=_positive_int(MAX_TOKENS, raw[MAX_TOKENS]),
        cap_max_tokens=action == "cap",
        max_n=_positive_int(MAX_N, raw[MAX_N]),
        blocked_words=words,
        blocked=blocked,
    )


def _positive_int(name: str, value: str) -> int | None:
    value = value.strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or int(value) < 1:  # isdigit alone takes "²", which int() does not
        raise GuardSettingsError(f"{name}={value!r} must be a positive integer (or unset for no limit)")
    return int(value)


@hookimpl
def pre_load(config, model_class):
    """Check the variables when an engine is built: a malformed one stops it there, not at the first request."""
    current_limits()


@hookimpl
def on_request(request):
    limits = current_limits()
    params = request.params
    if limits.max_n is not None and params.n > limits.max_n:
        raise ValueError(
            f"n={params.n} samples is more than this server allows ({limits.max_n}, {MAX_N}); "
            f"ask for at most {limits.max_n}, {_ASK}"
        )
    if limits.max_prompt_tokens is not None and len(request.prompt_token_ids) > limits.max_prompt_tokens:
        raise ValueError(
            f"the prompt has {len(request.prompt_token_ids)} tokens, more than this server allows "
            f"({limits.max_prompt_tokens}, {MAX_PROMPT_TOKENS}); shorten it, {_ASK}"
        )
    if limits.max_tokens is not None:
        _limit_max_tokens(params, limits)
    if limits.blocked is not None:
        if request.prompt is None:
            raise ValueError(
                f"this server checks prompts for blocked words ({BLOCKED_WORDS}) and cannot read a prompt given "
                "as token ids; send it as text"
            )
        found = limits.blocked.search(request.prompt)
        if found is not None:
            raise ValueError(
                f"the prompt contains {found.group(0)!r}, a word this server blocks ({BLOCKED_WORDS}); "
                "rephrase it, or ask the operator to unblock the word"
            )


def _limit_max_tokens(params, limits: Limits) -> None:
    limit = limits.max_tokens
    if params.max_tokens is None:  # "as many as fit": this server's limit
        params.max_tokens = limit
    elif params.max_tokens > limit:
        if not limits.cap_max_tokens:
            raise ValueError(
                f"max_tokens={params.max_tokens} is more than this server allows ({limit}, {MAX_TOKENS}); "
                f"ask for at most {limit}, {_ASK} (or to set {MAX_TOKENS_ACTION}=cap, which caps such requests "
                "instead of refusing them)"
            )
        params.max_tokens = limit
    if params.min_tokens > limit:
        raise ValueError(
            f"min_tokens={params.min_tokens} is more than the {limit} tokens this server lets a request generate "
            f"({MAX_TOKENS}); ask for at most {limit}, {_ASK}"
        )
