"""``SamplingParams``: how one request is decoded, with vLLM's names, meanings and defaults."""

from __future__ import annotations

import copy
import enum
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from pluginhost.errors import InvalidParameterError

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_BAD_WORDS",
    "MAX_STOP_STRINGS",
    "VLLM_NEUTRAL",
    "RequestOutputKind",
    "SamplingParams",
    "check_min_tokens_within_cap",
    "is_neutral",
    "kind_of",
]


class RequestOutputKind(enum.IntEnum):
    """What each output ``AsyncLLM.generate`` yields holds (vLLM's ``output_kind``); ``LLM.generate`` returns the final
    outputs whatever it says."""

    #: Everything so far: each output's text and tokens begin at the first token.
    CUMULATIVE = 0
    #: What is new since the output before: each sample's text, tokens and logprobs since then (empty when nothing
    #: is); the prompt's logprobs in the first output only.
    DELTA = 1
    #: The finished output alone.
    FINAL_ONLY = 2


#: Temperatures below this decode greedily, as in vLLM (dividing by them overflows).
GREEDY_TEMPERATURE = 1e-5

#: The most stop strings one request may give. Every new token of every sample is checked against each of
#: them, in the engine loop that serves every request: 20,000 of them with n=8 made the other requests 23
#: times slower. OpenAI's API allows 4; vLLM sets no limit.
MAX_STOP_STRINGS = 64

#: The most ``bad_words`` one request may give: each is tokenized twice when the engine takes the request, and
#: those of several tokens are compared with the output at every step its last token begins one.
MAX_BAD_WORDS = 1024


@dataclass(slots=True, weakref_slot=True)  # slots: a misspelt field set later (params.max_token = 8) is an error
class SamplingParams:
    """Decoding settings of one request; invalid values raise ``ValueError`` at once.

    * ``n``: how many independent samples to generate for the prompt
      (``RequestOutput.outputs``). With a ``seed``, sample ``i`` draws from
      the stream of ``seed + i``, as in vLLM.
    * ``max_tokens``: most tokens to generate (>= 1), or ``None`` for as many
      as ``max_model_len`` leaves room for.
    * ``min_tokens``: end-of-sequence, ``stop_token_ids`` and ``stop`` strings
      cannot end generation before this many tokens are out: the first token
      that may end it is the one after them (a stop string completed sooner
      is kept in the text).
    * ``temperature``: 0 (or below 1e-5) is greedy; higher flattens the distribution.
    * ``top_p``: nucleus sampling, in (0, 1]; 1 keeps every token.
    * ``top_k``: keep the k most likely tokens; 0 (or -1, as in vLLM) keeps all.
    * ``min_p``: drop tokens less likely than ``min_p`` times the most likely one; 0 keeps all.
    * ``presence_penalty``, ``frequency_penalty`` (in [-2, 2]): subtracted from
      the logits of tokens already generated (prompt tokens do not count),
      once, and once per occurrence.
    * ``repetition_penalty`` (> 0): logits of tokens in the prompt or the
      output are divided by it when positive, multiplied when negative
      (transformers' ``repetition_penalty``); 1 is off.
    * ``seed``: the request's own random stream: the same seed gives the same
      output, whatever else is in the batch. ``None`` uses the engine's stream,
      and so does -1 (read as ``None``, as vLLM does: clients send it for "random").
    * ``logprobs``: ``None``, or k >= 0: each generated step reports the
      log-probabilities (of the model's distribution, before penalties,
      temperature and filtering) of the chosen token and of the k most likely;
      -1: of every token of the vocabulary, as in vLLM (within ``max_logprobs``).
    * ``prompt_logprobs``: ``None``, or k >= 0 (-1: all): the output's
      ``prompt_logprobs`` holds, for each prompt token after the first, the
      log-probabilities of it and of the k most likely tokens given the
      tokens before it (the model's distribution; within ``max_logprobs``).
    * ``stop``: strings that end generation; the text stops before them
      (``finish_reason`` "stop", ``stop_reason`` the string). At most ``MAX_STOP_STRINGS`` (64).
    * ``skip_special_tokens``: leave special tokens' text out of the text (``False``: keep it, as vLLM).
    * ``detokenize``: ``False`` leaves the text empty (``""``, as vLLM): tokens, logprobs and
      ``prompt_logprobs`` only, none of the detokenizing's cost (lm-eval's loglikelihood requests); stop
      strings need the text, and are refused with it.
    * ``include_stop_str_in_output``: the text stops after the stop string instead,
      and holds the text of the stop token that ended it (a special token's only with
      ``skip_special_tokens=False``), as vLLM decodes it then.
    * ``stop_token_ids``: token ids that end generation; the token is kept in
      ``token_ids`` but its text is not added (but see ``include_stop_str_in_output``),
      as vLLM does (end-of-sequence alike).
    * ``ignore_eos``: keep generating past the end-of-sequence token.
    * ``logit_bias``: ``{token_id: bias}`` added to those tokens' logits before
      the penalties, temperature and filters (a ``-inf`` bias bans a token).
    * ``allowed_token_ids``: only these tokens may be generated (a non-empty list).
    * ``bad_words``: words never to generate: each is tokenized, alone and after
      a space, and a token completing one of those sequences at the end of the
      output is banned (as vLLM does; the prompt's tokens do not count). At most
      ``MAX_BAD_WORDS``.
    * ``extra_args``: per-request options for plugins (logits processors, request hooks).
    * ``output_kind``: what each output ``AsyncLLM.generate`` yields holds (``RequestOutputKind``:
      ``CUMULATIVE``, the default, ``DELTA`` or ``FINAL_ONLY``, as vLLM's).

    vLLM's fields for what pluginhost does not do (``best_of``,
    ``spaces_between_special_tokens``, ...; see ``VLLM_NEUTRAL``) are taken at
    the values that ask for nothing else, as a port passes them, and any other
    value is refused naming the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    extra_args: dict[str, Any] | None = field(default=None)
    # vLLM's, at their neutral values only (VLLM_NEUTRAL): kept out of the repr, which shows what decodes.
    # (detokenize, bad_words, allowed_token_ids and logit_bias are taken; they stay where vLLM's order puts them.)
    best_of: int | None = field(default=None, repr=False)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = field(default=True, repr=False)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = field(default=None, repr=False)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: Any = field(default=None, repr=False)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (and normalise ``stop``, ``stop_token_ids``, ``top_k=-1``).

        A bad value raises ``InvalidParameterError`` (a ``ValueError``) naming the field in ``param``.

        The engine calls it again when it accepts a request, after plugins had
        their chance to change the parameters.
        """

        def check(param: str, ok: bool, message: str) -> None:
            if not ok:
                raise InvalidParameterError(f"SamplingParams: {message}", param=param)

        # NumPy's scalars (``np.arange``, a DataFrame's column) are numbers too: checked and kept as Python's.
        for name in _NUMERIC_FIELDS:
            setattr(self, name, _plain(getattr(self, name)))
        if self.seed == -1:
            self.seed = None
        check("n", _is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(
            "max_tokens",
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}",
        )
        check(
            "min_tokens",
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        check(
            "min_tokens",
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
        )
        check(
            "temperature",
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature!r}",
        )
        check("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(
            "top_k",
            _is_int(self.top_k) and self.top_k >= -1,
            f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}",
        )
        if self.top_k == -1:
            self.top_k = 0
        check("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(name, _is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        check(
            "repetition_penalty",
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 and finite (1 = off), got {self.repetition_penalty!r}",
        )
        check("seed", self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}")
        check(
            "seed",
            self.seed is None or -(2**63) <= self.seed <= 2**64 - self.n,
            f"seed must be in [-2**63, 2**64 - n] (sample i draws from seed + i), got {self.seed!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                name,
                value is None or (_is_int(value) and value >= -1),
                f"{name} must be None, an integer >= 0, or -1 for the whole vocabulary, got {value!r}",
            )
        kinds = {kind.value: kind for kind in RequestOutputKind}
        given = self.output_kind
        shown = repr(given)
        if type(given).__name__ == RequestOutputKind.__name__ and type(given) is not RequestOutputKind:  # vLLM's
            shown = f"{type(given).__module__}'s {given} (import RequestOutputKind from pluginhost.sampling)"
        check(
            "output_kind",
            _is_int(given) and given in kinds,
            f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got {shown}",
        )
        self.output_kind = kinds[self.output_kind]
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            value = getattr(self, name)
            check(name, isinstance(value, bool), f"{name} must be True or False, got {value!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        self.stop = _strings(
            check,
            "stop",
            stop,
            bool,
            "a non-empty string or a list of them",
            MAX_STOP_STRINGS,
            "strings (each is looked for after every token)",
            self.stop,
        )
        check(
            "stop",
            self.detokenize or not self.stop,
            "stop strings are looked for in the text, which detokenize=False leaves out: set detokenize=True, or "
            "use stop_token_ids",
        )
        self.stop_token_ids = _id_list(check, "stop_token_ids", self.stop_token_ids) or None
        self._check_token_choices(check)
        check(
            "extra_args",
            self.extra_args is None or isinstance(self.extra_args, dict),
            f"extra_args must be a dict or None, got {type(self.extra_args).__name__}",
        )
        for name, neutral in VLLM_NEUTRAL.items():
            value = getattr(self, name)
            check(
                name,
                is_neutral(value, neutral) or (name == "best_of" and _is_int(value) and value == self.n),
                f"{name}={value!r} is not supported by pluginhost (vLLM's field; only {_shown(neutral, name)} here, "
                "what pluginhost does anyway): see docs/porting-from-vllm.md",
            )

    def _check_token_choices(self, check: Any) -> None:
        """``logit_bias``, ``allowed_token_ids`` and ``bad_words`` (their tokens are checked against the vocabulary
        when the engine takes the request); ``{}`` and ``[]`` ask for nothing, and are kept as ``None``."""
        bias = self.logit_bias
        ids = _token_ids(bias) if isinstance(bias, dict) else None
        check(
            "logit_bias",
            bias is None or ids is not None,
            f"logit_bias must map token ids (integers >= 0) to numbers, got {_short(bias)}",
        )
        if bias:
            values = _reals(bias.values())
            if isinstance(values, str):
                check("logit_bias", False, f"logit_bias values must be numbers (-inf bans a token), got {values}")
            self.logit_bias = dict(zip(ids, values, strict=True))  # type: ignore[arg-type]  # checked above
        else:
            self.logit_bias = None
        allowed = _id_list(check, "allowed_token_ids", self.allowed_token_ids)
        check(
            "allowed_token_ids",
            allowed is None or len(allowed) > 0,
            "allowed_token_ids is empty: it would allow no token (None allows every token)",
        )
        self.allowed_token_ids = allowed
        self.bad_words = _strings(
            check,
            "bad_words",
            self.bad_words,
            str.strip,
            "a list of words (non-blank strings)",
            MAX_BAD_WORDS,
            "words (each is tokenized for the request, and checked as the output grows)",
            self.bad_words,
        )

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the most likely token (temperature 0, or too small to divide by)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied (``extra_args`` copied all the way down, not shared)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["extra_args"] = _copied(self.extra_args)
        values.update(changes)
        return SamplingParams(**values)


#: vLLM's ``SamplingParams`` fields for what pluginhost does not do, and the values that ask for nothing else
#: (``best_of`` may also equal ``n``). The server's request bodies take the entries they share from here
#: (``server.protocol``, which adds the fields only a route has).
VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None,),
    # Either: pluginhost's detokenizer never puts a space between special tokens, what vLLM's does with False
    # (lm-eval passes False with every request).
    "spaces_between_special_tokens": (True, False),
    "truncate_prompt_tokens": (None,),
    "structured_outputs": (None,),
}


def is_neutral(value: object, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``neutral``; a boolean only as a boolean (``1`` is not ``True``, ``False``
    is not ``0``), ``None`` only as ``None``."""
    return any(
        value is n if n is None else value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral
    )


def _shown(neutral: tuple[Any, ...], name: str) -> str:
    return " or ".join([*(repr(n) for n in neutral), *(["n"] if name == "best_of" else [])])


def kind_of(value: object) -> str:
    """The type of ``value``, given where a ``SamplingParams`` belongs: another package's ``SamplingParams`` (a
    leftover ``from vllm import SamplingParams``) by its full name, with what to do."""
    kind = type(value)
    if kind.__name__ != SamplingParams.__name__:
        return kind.__name__
    return f"{kind.__module__}.{kind.__qualname__} (import SamplingParams from pluginhost instead)"


def check_min_tokens_within_cap(min_tokens: int, cap: int) -> None:
    """Refuse a ``min_tokens`` beyond ``cap``, the most tokens the model generates for a request (its
    ``generation_config.json``'s ``max_new_tokens``): named so, not as a ``max_tokens`` the request never gave."""
    if min_tokens > cap:
        raise InvalidParameterError(
            f"min_tokens ({min_tokens}) is more than the {cap} tokens this model generates at most for a request "
            "(max_new_tokens in its generation_config.json)",
            param="min_tokens",
        )


def _copied(extra_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """A deep copy (a plugin appending to a list in one request's must not change another's); else shallow."""
    if extra_args is None:
        return None
    try:
        return copy.deepcopy(extra_args)
    except Exception:  # noqa: BLE001 - something that cannot be copied: shared, as before
        return dict(extra_args)


#: The fields holding a number, which ``_plain`` turns into Python's own.
_NUMERIC_FIELDS = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logprobs",
    "best_of",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "output_kind",
)


def _plain(value: object) -> object:
    """A number of another type (NumPy's ``int64``, ``float32``) as Python's ``int`` or ``float``; else ``value``."""
    if isinstance(value, bool | int | float) or not isinstance(value, numbers.Number):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(
    check: Any, name: str, values: Any, usable: Any, what: str, most: int, unit: str, given: Any
) -> list[str] | None:
    """``values`` (a list of at most ``most`` strings, each ``usable``) as a list, or None for none; ``check``
    refuses them otherwise, showing ``given``. ``unit`` names them, and says why they are bounded."""
    check(
        name,
        values is None or (isinstance(values, list | tuple) and all(isinstance(v, str) and usable(v) for v in values)),
        f"{name} must be {what}, got {_short(given)}",
    )
    check(
        name,
        values is None or len(values) <= most,
        f"{name} may hold at most {most} {unit}, got {len(values or ())}",
    )
    return list(values) if values else None


def _id_list(check: Any, name: str, value: Any) -> list[int] | None:
    """``value``, a list (or tuple) of token ids, as a list of Python ints; ``check`` refuses anything else."""
    ids = _token_ids(value) if isinstance(value, list | tuple) else None
    check(name, value is None or ids is not None, f"{name} must be a list of token ids >= 0, got {_short(value)}")
    return ids


def _token_ids(values: Any) -> list[int] | None:
    """``values`` as a list of Python ints >= 0 (NumPy's integers taken), or None if one is not a token id.

    Fast for plain ints: a request's ids may number a vocabulary's (150,000), and every copy of its parameters
    is checked again.
    """
    if all(type(t) is int for t in values):
        ids = list(values)
    else:
        ids = [_plain(t) for t in values]
        if not all(_is_int(t) for t in ids):
            return None
    return ids if not ids or min(ids) >= 0 else None


def _reals(values: Any) -> list[float] | str:
    """``values`` as Python floats, or the first that is no number a float holds (NaN, 10**400), shortened."""
    found = list(values)
    if not all(type(v) is float for v in found):
        found = [_plain(v) for v in found]
        for v in found:
            if not _is_real(v):
                return _short(v)
        found = [float(v) for v in found]
    if any(v != v for v in found):  # noqa: PLR0124 - NaN is the one float unequal to itself
        return "nan"
    return found


def _is_real(value: object) -> bool:
    """A number a float holds, infinite allowed (a bias of -inf bans a token); not NaN, nor an int beyond floats."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return not math.isnan(float(value))
    except OverflowError:
        return False


def _short(value: object) -> str:
    """``repr(value)``, cut to 80 characters (a request's list may hold thousands)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _is_number(value: object) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (10**400) is no finite float either
        return False
