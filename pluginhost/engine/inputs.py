"""Turning a prompt and its ``SamplingParams`` into an ``EngineRequest``, checking everything first.

Runs in the caller's thread, so a bad prompt or parameter raises
``ValueError`` at once, before the engine loop sees anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pluginhost.engine.detokenizer import IncrementalDetokenizer
from pluginhost.engine.loader import LoadedModel
from pluginhost.engine.request import EngineRequest, OutputCallback
from pluginhost.engine.request import Sequence as EngineSequence
from pluginhost.engine.sampler import SamplingState, TokenChoices, choices_given
from pluginhost.errors import InvalidParameterError, PluginHookError, PromptTooLongError, RequestRefusedError
from pluginhost.sampling import SamplingParams, check_min_tokens_within_cap, kind_of
from pluginhost.tokenizer import most_chars_per_token

__all__ = ["InputProcessor", "Prompt", "as_prompt_list"]

#: A prompt: text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``.
Prompt = str | Sequence[int] | Mapping[str, Any]


class InputProcessor:
    """Makes checked ``EngineRequest``s for one loaded model."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        self._generator = torch.Generator(loaded.device).manual_seed(loaded.config.seed)
        self._on_request = loaded.host.has_implementations("on_request")

    def make_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        index: int = 0,
        on_output: OutputCallback | None = None,
        streaming: bool = False,
        exact_max_tokens: bool = False,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
    ) -> EngineRequest:
        """The request for ``prompt``; ``index`` names the prompt in error messages.

        A text prompt is tokenized with the tokenizer's special tokens (a BOS), unless ``add_special_tokens`` is
        false (a server's client that rendered a chat template itself, vLLM's completions field).

        A ``max_tokens`` beyond what ``max_model_len`` leaves after the prompt ends generation
        there, with ``finish_reason`` "length", as in vLLM's engine; with ``exact_max_tokens`` it
        is a ``PromptTooLongError`` instead (the OpenAI server's rules), and one left unset after the
        ``on_request`` hooks takes the model's recommended ``max_tokens`` (``generation_config.json``'s
        ``max_new_tokens``), cut to fit, as vLLM's server. ``arrival_time``
        (``time.monotonic()``) is when the request arrived, if before now.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params for prompt {index} must be a SamplingParams, got {kind_of(params)}")
        loaded = self._loaded
        text, token_ids = self._encode(index, prompt, add_special_tokens)
        # The request's own parameters: plugins may change them, and one SamplingParams may serve many prompts.
        request = EngineRequest(request_id, text, token_ids, params.clone(), on_output=on_output, streaming=streaming)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        cap = loaded.sampling_defaults.get("max_tokens") if exact_max_tokens else None
        if self._on_request:
            given = (text, list(token_ids), request.params.clone())
            # Only the caller's own max_tokens can be the caller's error: what a plugin adds is cut to fit.
            asked = params.max_tokens
            exact = exact_max_tokens and asked is not None and len(token_ids) + asked > loaded.max_model_len
            loaded.host.call("on_request", request=request, consequence="The request was not run.")
            try:
                self._follow_prompt(index, request, text, given[1], add_special_tokens)
                max_tokens, choices = self._checked(index, request.prompt_token_ids, request.params, exact, cap)
            except ValueError as exc:
                now = (request.prompt, request.prompt_token_ids, request.params)
                if _unchanged(now, given):  # a processor's refusal too: of what the caller sent, or a hook set
                    raise
                self._checked(index, *given[1:], exact_max_tokens, cap)  # the caller's own request fails too: theirs
                plugins = loaded.host.implementers("on_request")
                raise PluginHookError(
                    f"prompt {index} became invalid in the on_request hook of "
                    f"{' or '.join(p.describe() for p in plugins)}: {str(exc).rstrip('.')}. The request was not run.",
                    plugin=plugins[0].name,
                    hook="on_request",
                ) from exc
        else:
            max_tokens, choices = self._checked(index, token_ids, request.params, exact_max_tokens, cap)
        params, token_ids = request.params, request.prompt_token_ids
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else loaded.eos_ids)
        held_back = _held_back(params, loaded.eos_ids)
        for sample in range(params.n):
            if params.seed is not None:  # sample i draws from seed + i, as in vLLM
                generator = torch.Generator(loaded.device).manual_seed(params.seed + sample)
            else:
                generator = self._generator
            detokenizer = None
            if loaded.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    loaded.tokenizer,
                    token_ids,
                    params.stop or (),
                    include_stop=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens,
                )
            sampling = SamplingState(
                params,
                generator,
                token_ids,
                stop_ids,
                loaded.vocab_size,
                loaded.device,
                held_back_ids=held_back,
                choices=choices,
            )
            request.sequences.append(EngineSequence(request, sample, sampling, max_tokens, detokenizer))
        return request

    def check_text_length(self, index: int, text: str) -> None:
        """Refuse a text that cannot fit ``max_model_len`` however it tokenizes, before it is tokenized.

        A ``PromptTooLongError`` (a server's 400 ``context_length_exceeded``) when ``text`` has more
        characters than ``max_model_len`` tokens can stand for (``most_chars_per_token``): megabytes of
        text took seconds and gigabytes to tokenize, only to be refused then. Conservative: a text that
        passes may still be too long, and is refused once tokenized, as before. Not checked when an
        ``on_request`` hook may shorten the prompt, or when the tokenizer gives no bound.
        """
        loaded = self._loaded
        if self._on_request or loaded.tokenizer is None:
            return
        most = most_chars_per_token(loaded.tokenizer)
        if most is not None and len(text) > loaded.max_model_len * most:
            raise PromptTooLongError(
                f"prompt {index} has {len(text)} characters, more than {_max_model_len(loaded)} tokens can hold "
                f"(one token of this tokenizer stands for {most} characters at most). Shorten the prompt."
            )

    def _checked(
        self, index: int, token_ids: list[int], params: SamplingParams, exact_max_tokens: bool, cap: int | None = None
    ) -> tuple[int, TokenChoices | None]:
        """Check a request's parameters against its prompt and this engine; the tokens it may generate (``cap``, the
        model's recommended ``max_tokens``, for a request that sets none) and its own ``TokenChoices``."""
        loaded = self._loaded
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request.params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        config = loaded.config
        most = config.max_sequences_taken
        if params.n > most:  # checked before n sequences are built
            raise InvalidParameterError(
                f"n={params.n} samples are more than the engine ever takes in at once ({most}: max_num_seqs="
                f"{config.max_num_seqs} running + max_waiting_seqs={config.max_waiting_seqs} waiting): ask for "
                "fewer, or raise max_num_seqs or max_waiting_seqs",
                param="n",
            )
        vocabulary = loaded.vocab_size  # what -1 asks for, and allows (vLLM's reading)
        allowed = vocabulary if config.max_logprobs == -1 else config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and (vocabulary if asked == -1 else asked) > allowed:
                whole = f" (the whole vocabulary, {vocabulary})" if asked == -1 else ""
                raise InvalidParameterError(
                    f"{name}={asked}{whole} is more than this engine allows ({allowed}): "
                    "ask for fewer, or raise max_logprobs (-1: the whole vocabulary)",
                    param=name,
                )
        for processor in loaded.logits_processors:
            try:
                processor.cls.validate_params(params)
            except ValueError as exc:
                raise RequestRefusedError(
                    f"{processor.describe()} refused the request: {exc}",
                    plugin=processor.registered_by.name,
                    hook="register_logits_processors",
                ) from None
            except Exception as exc:  # a bug in the plugin, not a refusal: its failure, named
                raise PluginHookError(
                    f"{processor.describe()} failed in validate_params: {type(exc).__name__}: {exc}. "
                    f"The request was not run. {processor.registered_by.remedy()}",
                    plugin=processor.registered_by.name,
                    hook="register_logits_processors",
                ) from exc
        room = loaded.max_model_len - len(token_ids)
        if room < 1:
            raise PromptTooLongError(
                f"prompt {index} has {len(token_ids)} tokens, which leaves no room to generate within "
                f"{_max_model_len(loaded)}. Shorten the prompt."
            )
        if params.max_tokens is not None and params.max_tokens > room and exact_max_tokens:
            raise PromptTooLongError(
                f"prompt {index} has {len(token_ids)} tokens; with max_tokens={params.max_tokens} that is "
                f"{len(token_ids) + params.max_tokens}, more than {_max_model_len(loaded)}. Shorten the "
                "prompt or lower max_tokens."
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.max_tokens is None and cap is not None:
            check_min_tokens_within_cap(params.min_tokens, cap)
            max_tokens = min(cap, room)
        if params.min_tokens > max_tokens:
            raise InvalidParameterError(
                f"prompt {index} has {len(token_ids)} tokens, which leaves room for {room} within "
                f"{_max_model_len(loaded)}: fewer than min_tokens={params.min_tokens}. Shorten the "
                "prompt or lower min_tokens.",
                param="min_tokens",
            )
        if params.stop and loaded.tokenizer is None:
            raise InvalidParameterError(
                f"prompt {index} asks for stop strings, but {loaded.config.model} has no tokenizer to find them in "
                "the text; use stop_token_ids instead",
                param="stop",
            )
        outside = [t for t in params.stop_token_ids or () if t >= loaded.vocab_size]
        if outside:
            raise InvalidParameterError(
                f"prompt {index} has stop_token_ids {outside[:5]} outside the vocabulary [0, {loaded.vocab_size})",
                param="stop_token_ids",
            )
        held_back = _held_back(params, loaded.eos_ids)
        if params.min_tokens and sum(t < loaded.vocab_size for t in held_back) >= loaded.vocab_size:
            # Every token would end it: the min_tokens mask would leave its row nothing to choose.
            raise InvalidParameterError(
                f"prompt {index} has stop_token_ids that, with the end-of-sequence ids, take in all "
                f"{loaded.vocab_size} tokens of the vocabulary: min_tokens={params.min_tokens} would leave no token "
                "to choose. Lower min_tokens, or stop on fewer tokens.",
                param="min_tokens",
            )
        return max_tokens, self._token_choices(index, params, held_back)

    def _token_choices(self, index: int, params: SamplingParams, held_back: frozenset[int]) -> TokenChoices | None:
        """The request's ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` as the sampler applies them; refused
        (``InvalidParameterError``) when they name a token outside the vocabulary, or leave none to choose."""
        fields = choices_given(params)
        if not fields:
            return None
        loaded = self._loaded
        V, device = loaded.vocab_size, loaded.device
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            outside = sorted({t for t in ids if t >= V})
            if outside:
                raise InvalidParameterError(
                    f"prompt {index} has {name} token ids {outside[:5]} outside the vocabulary [0, {V})", param=name
                )
        words = self._bad_words_ids(index, params.bad_words or ())
        banned = {w[0] for w in words if len(w) == 1}
        sequences: dict[int, tuple[tuple[int, ...], ...]] = {}
        for word in dict.fromkeys(w for w in words if len(w) > 1):  # by the token before the one they ban
            sequences[word[-2]] = (*sequences.get(word[-2], ()), word)
        bias = params.logit_bias or {}
        # As the sampler adds them: in float32, where -1e100 is -inf too.
        biases = torch.tensor(list(bias.values()), dtype=torch.float32)
        never = banned | {t for t, b in zip(bias, biases.tolist(), strict=True) if b == float("-inf")}
        # What a step may choose from, as far as the request alone says (a bad word of several tokens bans its last
        # only after the others: the sampler checks for those): refused now if nothing.
        choosable = set(params.allowed_token_ids) - never if params.allowed_token_ids else None
        left = len(choosable) if choosable is not None else V - len(never)
        given = f"its {' and '.join(fields)} {'leave' if len(fields) > 1 else 'leaves'}"
        if not left:
            raise InvalidParameterError(
                f"prompt {index}: {given} no token of the vocabulary to choose. Allow more tokens, or ban fewer.",
                param="allowed_token_ids" if params.allowed_token_ids else "logit_bias",
            )
        ending = {t for t in held_back if t < V}
        if params.min_tokens and (choosable <= ending if choosable is not None else left <= len(ending - never)):
            raise InvalidParameterError(
                f"prompt {index}: {given} only tokens that would end it, which min_tokens={params.min_tokens} "
                "forbids: no token to choose. Allow more tokens, or lower min_tokens.",
                param="min_tokens",
            )

        def ids(values: Any) -> torch.Tensor:
            return torch.tensor(sorted(values), dtype=torch.long, device=device)

        return TokenChoices(
            bias_ids=torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None,
            bias_values=biases.to(device) if bias else None,
            allowed=ids(params.allowed_token_ids) if params.allowed_token_ids else None,
            banned=ids(banned) if banned else None,
            sequences=sequences,
            # A bias so negative that adding it to a negative logit overflows float32 to -inf may empty a row too.
            may_empty=bool(params.allowed_token_ids or words or (biases < -1e30).any()),
        )

    def _bad_words_ids(self, index: int, words: Sequence[str]) -> list[tuple[int, ...]]:
        """Each bad word's tokens, alone and after a space where that spells it with other tokens (as vLLM reads
        them: a word is banned however the output begins it)."""
        if not words:
            return []
        tokenizer = self._loaded.tokenizer
        if tokenizer is None:
            raise InvalidParameterError(
                f"prompt {index} asks for bad_words, but {self._loaded.config.model} has no tokenizer to spell them "
                "in tokens; use logit_bias with a -inf bias instead",
                param="bad_words",
            )
        found: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            found.append(alone)
            # After a space, only where that is a different spelling of as many tokens (vLLM's rule): one that
            # merely adds a space token would ban the word's first token after any space.
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                found.append(spaced)
        V = self._loaded.vocab_size
        outside = sorted({t for w in found for t in w if t >= V})
        if outside:
            raise InvalidParameterError(
                f"prompt {index} has bad_words that the tokenizer spells with token ids {outside[:5]} outside the "
                f"model's vocabulary [0, {V}): the tokenizer of {self._loaded.config.model} does not match the model",
                param="bad_words",
            )
        return [w for w in found if w]

    def _encode(self, index: int, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            text = prompt.get("prompt")
            prompt = _unwrap_prompt_dict(index, prompt)
            if not isinstance(prompt, str) and isinstance(text, str):
                # vLLM's TokensPrompt may carry the text the ids came from (the server's chat prompts). The ids
                # run, so the request's text (what on_request hooks read, the output's prompt) is theirs.
                token_ids = self._check_ids(index, prompt)
                return self._text_of(token_ids, text), token_ids
        if isinstance(prompt, str):
            return prompt, self._tokenize(index, prompt, add_special_tokens)
        if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
            raise ValueError(
                f"prompt {index} must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}"
            )
        return None, self._check_ids(index, prompt)

    def _tokenize(self, index: int, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text prompt (with the tokenizer's special tokens, unless told), checked."""
        loaded = self._loaded
        if not prompt:
            raise ValueError(f"prompt {index} is an empty string; give some text or token ids")
        if loaded.tokenizer is None:
            raise ValueError(
                f"prompt {index} is text, but {loaded.config.model} has no tokenizer files; "
                "pass token ids instead (a list of ints)"
            )
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: tokenizers raise a TypeError on it
            raise ValueError(
                f"prompt {index} is not valid Unicode: character {exc.start} is {prompt[exc.start]!r}, "
                f"{exc.reason} (text decoded with errors='surrogateescape'?)"
            ) from None
        self.check_text_length(index, prompt)
        token_ids = list(loaded.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        if not token_ids:  # special tokens alone would have made it one token at least
            without = "" if add_special_tokens else " without the tokenizer's special tokens"
            raise ValueError(f"prompt {index} tokenizes to no token{without}; give some text")
        outside = [t for t in token_ids if not 0 <= t < loaded.vocab_size]
        if outside:
            raise ValueError(
                f"prompt {index} encodes to token id(s) {outside[:5]} outside the model's vocabulary "
                f"[0, {loaded.vocab_size}): the tokenizer of {loaded.config.model} does not match the model "
                "(tokens added to the tokenizer that the model has no embedding for?)"
            )
        return token_ids

    def _text_of(self, token_ids: list[int], given: str | None = None) -> str | None:
        """The text ``token_ids`` stand for (``None`` without a tokenizer): ``given`` if they decode to it.

        Special tokens count, as the model reads them; but ``given`` may leave out those the tokenizer adds
        (the beginning-of-sequence token a text prompt gets: ``{"prompt": t, "prompt_token_ids": ids of t}``).
        """
        tokenizer = self._loaded.tokenizer
        if tokenizer is None:
            return None
        try:
            text = tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if given is None or text == given:
                return text
            bare = tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode them: no text to show
            return None
        return given if bare == given else text

    def _follow_prompt(
        self, index: int, request: EngineRequest, text: str | None, token_ids: list[int], add_special_tokens: bool
    ) -> None:
        """Make the request's text and ids agree again after the on_request hooks (``text``, ``token_ids``: before).

        A changed text is tokenized as the prompt was (ids a hook changed too must be that text's): without the
        tokenizer's special tokens when the ids were the text's own tokens without them (a chat template wrote
        its BOS; ``add_special_tokens`` false), else as ``add_special_tokens`` says. Changed ids take the text
        they decode to; a text set to ``None`` leaves the ids as they are. A ``ValueError`` if that cannot be.
        """
        prompt = request.prompt
        if prompt is not text and prompt != text:
            if prompt is None:
                request.prompt_token_ids = self._check_ids(index, request.prompt_token_ids)
                return
            if not isinstance(prompt, str):
                raise ValueError(f"request.prompt must be text or None, got {type(prompt).__name__}")
            if text is not None and add_special_tokens:  # a chat's text: its template wrote the special tokens
                add_special_tokens = not _same_ids(token_ids, self._tokenize(index, text, add_special_tokens=False))
            tokenized, ids = self._tokenize(index, prompt, add_special_tokens), request.prompt_token_ids
            if not _same_ids(ids, token_ids) and not _same_ids(ids, tokenized):  # changed too, to other ids
                raise ValueError(
                    "request.prompt and request.prompt_token_ids were both changed, and the text does not tokenize "
                    "to those ids; change one of them (the other follows)"
                )
            request.prompt_token_ids = tokenized
            return
        request.prompt_token_ids = self._check_ids(index, request.prompt_token_ids)
        if text is not None and request.prompt_token_ids != token_ids:
            request.prompt = self._text_of(request.prompt_token_ids)

    def _check_ids(self, index: int, ids: Sequence[int]) -> list[int]:
        token_ids = list(ids)
        if not token_ids:
            raise ValueError(f"prompt {index} is an empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError(f"prompt {index} must hold only int token ids")
        vocab_size = self._loaded.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
        return token_ids


def _held_back(params: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """The tokens ``min_tokens`` holds back: ``stop_token_ids`` and end-of-sequence, ``ignore_eos`` or not (as vLLM
    holds them back: an answer of ``min_tokens`` tokens has none of them)."""
    return frozenset(params.stop_token_ids or ()) | eos_ids


#: vLLM's prompt-dict keys for inputs besides text (images, embeddings, token types): pluginhost's models read
#: text and token ids only, so these are refused unless empty (vLLM refuses them for a text-only model too).
_NON_TEXT_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids"})

#: The keys a prompt dict may hold. ``cache_salt`` keeps vLLM's prefix cache from sharing a prompt's blocks with
#: other users; pluginhost shares no cache between requests, so any salt is honoured as it is.
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"}) | _NON_TEXT_PROMPT_KEYS


def _unwrap_prompt_dict(index: int, prompt: Mapping[str, Any]) -> str | Sequence[int]:
    # A key left unread would be dropped silently: an image ran as its text alone, a misspelt key ran the text.
    unused = sorted(
        map(
            repr, (k for k in prompt if k not in _PROMPT_KEYS or (k in _NON_TEXT_PROMPT_KEYS and not _empty(prompt[k])))
        )
    )
    if unused:
        raise ValueError(
            f"prompt {index} is a dict with {', '.join(unused)}, which pluginhost does not take: its models read text "
            "('prompt') or token ids ('prompt_token_ids') only, not images, embeddings or other inputs"
        )
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str | bytes | bytearray | Mapping) or not isinstance(ids, Sequence):  # "2, 5" ran as text
            raise ValueError(f"prompt {index}: 'prompt_token_ids' must be a list of int token ids, got {_kind(ids)}")
        return ids
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt {index}: 'prompt' must be text (a str), got {_kind(prompt['prompt'])}")
        return prompt["prompt"]
    raise ValueError(
        f"prompt {index} is a dict with keys {sorted(map(str, prompt))}; a dict prompt needs 'prompt' (text) "
        "or 'prompt_token_ids' (a list of ints)"
    )


def _empty(value: object) -> bool:
    """``None`` or an empty dict or list: asking for nothing (no truth test: an array has none)."""
    return value is None or (isinstance(value, dict | list | tuple) and len(value) == 0)


def _kind(value: object) -> str:
    return "None" if value is None else f"{type(value).__name__} {value!r:.40}"


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of them, as a list (a flat list of ints is one prompt of token ids)."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a string, a list of token ids, or a list of prompts, got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        return []  # no prompts, no outputs (as vLLM's LLM.generate([]))
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # a single prompt of token ids
    return prompts


def _unchanged(now: object, given: object) -> bool:
    """Whether an on_request hook left the request as given (values that cannot be compared count as changed)."""
    try:
        return bool(now == given)
    except Exception:  # noqa: BLE001 - extra_args may hold anything (a tensor's == is not a bool)
        return False


def _same_ids(ids: object, other: list[int]) -> bool:
    """Whether ``ids`` (what a hook left: a list, a tuple, anything) are the token ids ``other``."""
    try:
        return list(ids) == other  # type: ignore[call-overload]
    except TypeError:
        return False


def _max_model_len(loaded: LoadedModel) -> str:
    """``max_model_len=N`` for a message, saying which plugin set it when one did (the user did not)."""
    source = loaded.config.provenance.get("max_model_len", "default")
    by = f" (set by plugin {source.removeprefix('plugin:')!r})" if source.startswith("plugin:") else ""
    return f"max_model_len={loaded.max_model_len}{by}"
