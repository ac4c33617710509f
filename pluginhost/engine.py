"""``LLM``: build a model through the plugin pipeline, then generate with it.

>>> llm = LLM(model="path/to/opt", dtype="float32")          # doctest: +SKIP
>>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0]
>>> out.outputs[0].text, out.token_ids, out.finish_reason     # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from pluginhost.build import plan_build
from pluginhost.checkpoint import find_checkpoint
from pluginhost.config import EngineConfig, describe_validation_error
from pluginhost.detokenizer import IncrementalDetokenizer
from pluginhost.device import dtype_name, resolve_device, resolve_dtype
from pluginhost.errors import CheckpointError, ConfigError, ModelClassError, ModelRunError
from pluginhost.generation import Sequence as Seq
from pluginhost.generation import generate_batch
from pluginhost.host import PluginHost
from pluginhost.outputs import RequestOutput
from pluginhost.registry import Registration
from pluginhost.sampler import SamplingState
from pluginhost.sampling import SamplingParams
from pluginhost.tokenizer import load_tokenizer

__all__ = ["LLM", "Prompt"]

logger = logging.getLogger(__name__)

#: A prompt: text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``.
Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """An engine: one model, built once, generating for any number of requests.

    Takes every ``EngineConfig`` field as a keyword argument, plus ``plugins``
    (in-process plugin objects or ``register()`` functions, no packaging
    needed) and ``load_installed_plugins`` (``False`` skips entry points).
    """

    def __init__(
        self,
        model: str,
        *,
        plugins: Sequence[object] = (),
        load_installed_plugins: bool = True,
        **settings: Any,
    ) -> None:
        host = PluginHost(plugins=plugins, load_installed=load_installed_plugins)
        self._build(host, {"model": model, **settings})

    @classmethod
    def _from_host(cls, host: PluginHost, **settings: Any) -> LLM:
        """An engine on a host the caller configured (the CLI's plugin selection)."""
        llm = cls.__new__(cls)
        llm._build(host, settings)
        return llm

    # -- building: see pluginhost.build for the order ---------------------------------

    def _build(self, host: PluginHost, settings: dict[str, Any]) -> None:
        try:
            config = EngineConfig(**settings)
        except ValueError as exc:
            raise ConfigError(f"Invalid engine settings: {describe_validation_error(exc)}") from None
        plan = plan_build(config, host)
        tokenizer = load_tokenizer(plan.model_dir)
        checkpoint = find_checkpoint(plan.model_dir)
        model_class = plan.registry.resolve(plan.architecture)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, plan.hf_config, device)
        config.settle(device=str(device), dtype=dtype_name(dtype), max_model_len=_max_model_len(config, plan.hf_config))
        host.call("pre_load", config=config, model_class=model_class)

        model = _construct(model_class, plan.registration, plan.hf_config, dtype)
        loaded = model.load_weights(checkpoint.tensors(dtype=dtype, device=device))
        _check_loaded(model, loaded, plan.model_dir)
        model.eval().requires_grad_(False)
        host.call("post_load", config=config, model=model)

        self.model: nn.Module = model
        self.config = config
        self.hf_config = plan.hf_config
        self.architecture = plan.architecture
        self.registration = plan.registration
        self.plugins = host.records
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]  # settled above
        self.vocab_size = int(plan.hf_config.vocab_size)
        self._eos_ids = _eos_ids(plan.hf_config, tokenizer)
        self._generator = torch.Generator(device).manual_seed(config.seed)
        self._model_code = _code_files(model)
        self._next_request = 0
        logger.info(
            "built %s (%s) on %s as %s from %s",
            plan.architecture,
            plan.registration.implementation,
            device,
            dtype,
            plan.model_dir,
        )

    # -- generating ---------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        """The model directory's tokenizer (a transformers tokenizer), or ``None`` without one."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; one ``RequestOutput`` per prompt, in prompt order.

        A prompt is text, a list of token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``. A bad prompt or parameter raises
        ``ValueError`` before anything runs, and the engine stays usable.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        requests = [
            self._request(i, prompt, params)
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True))
        ]
        sequences = [seq for _, seqs in requests for seq in seqs]
        for start in range(0, len(sequences), self.config.max_num_seqs):
            batch = sequences[start : start + self.config.max_num_seqs]
            try:
                generate_batch(self.model, batch, self.device, self.vocab_size)
            except Exception as exc:
                if not self._raised_by_model(exc.__traceback__):
                    raise
                entry = self.registration
                raise ModelRunError(
                    f"The model {entry.implementation} (architecture {entry.architecture!r}, registered by "
                    f"{entry.registered_by.describe()}) failed while generating: {type(exc).__name__}: {exc}"
                ) from exc
        for output, seqs in requests:
            output.outputs = [seq.output() for seq in seqs]
        return [output for output, _ in requests]

    def _params_for(
        self, prompts: list[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if isinstance(params, str | bytes | Mapping) or not isinstance(params, Sequence):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(
                f"sampling_params must be one SamplingParams or one per prompt ({len(prompts)}), "
                f"got {len(params)} items"
            )
        return params

    def _request(self, index: int, prompt: Prompt, params: SamplingParams) -> tuple[RequestOutput, list[Seq]]:
        """The output to fill in for one prompt, and its ``n`` sequences; every check made here."""
        text, token_ids = self._encode(index, prompt)
        params.validate()
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        total = len(token_ids) + max_tokens
        if total > self.max_model_len or max_tokens < 1:
            raise ValueError(
                f"prompt {index} has {len(token_ids)} tokens; with max_tokens={max_tokens} that is {total}, "
                f"more than max_model_len={self.max_model_len}. Shorten the prompt or lower max_tokens."
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"prompt {index} asks for stop strings, but {self.config.model} has no tokenizer to find them in "
                "the text; use stop_token_ids instead"
            )
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self._eos_ids)
        sequences = []
        for sample in range(params.n):
            if params.seed is not None:  # sample i draws from seed + i, as in vLLM
                generator = torch.Generator(self.device).manual_seed(params.seed + sample)
            else:
                generator = self._generator
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop or ())
            sampling = SamplingState(params, generator, token_ids, stop_ids)
            sequences.append(Seq(sample, token_ids, sampling, max_tokens, detokenizer))
        request_id = str(self._next_request)
        self._next_request += 1
        return RequestOutput(request_id, text, token_ids), sequences

    def _encode(self, index: int, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            prompt = _unwrap_prompt_dict(index, prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is an empty string; give some text or token ids")
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is text, but {self.config.model} has no tokenizer files; "
                    "pass token ids instead (a list of ints)"
                )
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError(f"prompt {index} is an empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError(f"prompt {index} must hold only int token ids")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return None, token_ids

    def _raised_by_model(self, tb: TracebackType | None) -> bool:
        """Whether the model's own code (its classes' files, outside torch) is in the traceback."""
        while tb is not None:
            if tb.tb_frame.f_code.co_filename in self._model_code:
                return True
            tb = tb.tb_next
        return False

    def __repr__(self) -> str:
        return (
            f"LLM(model={self.config.model!r}, architecture={self.architecture!r}, "
            f"device={self.device}, dtype={self.dtype})"
        )


def _unwrap_prompt_dict(index: int, prompt: Mapping[str, Any]) -> str | Sequence[int]:
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(
        f"prompt {index} is a dict with keys {sorted(map(str, prompt))}; a dict prompt needs 'prompt' (text) "
        "or 'prompt_token_ids' (a list of ints)"
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Sequence | Iterator):
        raise ValueError(
            f"prompts must be a string, a list of token ids, or a list of prompts, got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # a single prompt of token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str | list | tuple | Mapping):
            raise ValueError(
                f"prompt {i} must be a string, a list of token ids or a prompt dict, got {type(p).__name__}"
            )
    return prompts


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if limit is None:
            raise ConfigError("The model config has no max_position_embeddings; set max_model_len.")
        return int(limit)
    if limit is not None and config.max_model_len > limit:
        raise ConfigError(
            f"max_model_len={config.max_model_len} is more than the model's {limit} positions "
            "(max_position_embeddings); lower it."
        )
    return config.max_model_len


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextmanager
def _no_weight_init() -> Iterator[None]:
    """Skip ``torch.nn.init`` while constructing: every parameter is about to come from the checkpoint.

    Besides the wasted work, initialising meta tensors imports torch's Python
    decompositions, which costs seconds of start-up.
    """
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _construct(model_class: type, registration: Registration, hf_config: Any, dtype: torch.dtype) -> nn.Module:
    """Build the model on the meta device: no memory until its weights arrive."""
    try:
        with torch.device("meta"), _default_dtype(dtype), _no_weight_init():
            return model_class(hf_config)
    except Exception as exc:
        raise ModelClassError(
            f"Constructing {registration.implementation}(config) for architecture {registration.architecture!r} "
            f"(registered by {registration.registered_by.describe()}) failed: {type(exc).__name__}: {exc}"
        ) from exc


def _check_loaded(model: nn.Module, loaded: object, model_dir: Path) -> None:
    if not isinstance(loaded, set | frozenset):
        raise ModelClassError(
            f"{type(model).__name__}.load_weights returned {type(loaded).__name__}; it must return the set of "
            "parameter names it loaded (see builtin_models.weights.assign_weights)."
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(name for name, p in params.items() if p.is_meta or name not in loaded)
    if missing:
        raise CheckpointError(
            f"The checkpoint in {model_dir} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:20])}"
            + (" ..." if len(missing) > 20 else "")
            + ". Is it the right checkpoint for this architecture?"
        )
    unset = sorted(name for name, b in model.named_buffers() if b.is_meta)
    if unset:
        raise ModelClassError(
            f"{type(model).__name__} left buffer(s) {', '.join(unset)} on the meta device: models are built on "
            "meta, so compute buffers in load_weights (or setup_caches), not in __init__."
        )


def _code_files(model: nn.Module) -> frozenset[str]:
    """The source files of the model's classes (and their bases), torch's own excluded."""
    torch_dir = os.path.dirname(torch.__file__)
    files = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            try:
                path = inspect.getsourcefile(cls)
            except TypeError:  # builtins
                continue
            if path and not path.startswith(torch_dir):
                files.add(path)
    return frozenset(files)


def _eos_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
