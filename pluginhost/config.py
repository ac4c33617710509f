"""``EngineConfig``: everything that decides how an engine is built.

A pydantic model that validates every assignment and refuses unknown fields,
so a typo or a bad value from a user or a plugin fails where it is made.
Each field remembers who set it last: ``default``, ``user`` or
``plugin:NAME`` (a plugin assigning inside its ``modify_config`` hook).
Once the engine is built, every setting is read-only: assignment is refused,
and so is a change to the contents of ``hf_overrides``.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import os
import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from pluginhost.attribution import current_plugin
from pluginhost.errors import ConfigError

__all__ = ["EngineConfig", "describe_validation_error", "take_vllm_settings"]

logger = logging.getLogger(__name__)

#: vLLM's names for the dtypes ("half" and "float" are also torch's).
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")

#: vLLM's ``LLM()`` settings that pluginhost takes another way: refused, saying which.
_TAKEN_ELSEWHERE = {
    "logits_processors": (
        "pluginhost adds logits processors from plugins, not from LLM(): add each class in a "
        "register_logits_processors hook (registry.add(cls)) of a plugin, installed or passed in-process as "
        "LLM(model, plugins=[plugin]); the classes port as they are (docs/porting-from-vllm.md, 'Loading a logits "
        "processor')"
    ),
}

_LOCAL = "the model is a local directory: nothing is downloaded"
_GENERATES = "pluginhost generates text"
#: vLLM's ``LLM()`` settings for what pluginhost does its own way: (the values that ask for nothing pluginhost does not
#: do, or ``None`` where any value does, what pluginhost does instead). Taken at those values and dropped
#: (``take_vllm_settings``), so a port's ``LLM(...)`` runs as it is; refused at any other, saying so.
_VLLM_SETTINGS: dict[str, tuple[tuple[Any, ...] | None, str]] = {
    "trust_remote_code": ((False,), "pluginhost never runs code from a model directory; architectures come from "
                          "installed plugins (docs/writing-plugins.md)"),
    "tokenizer": ((None,), "the tokenizer is the model directory's own"),
    "tokenizer_mode": (("auto",), "the tokenizer is the model directory's own, as transformers loads it"),
    "skip_tokenizer_init": ((False,), "the model directory's tokenizer is loaded when it has one"),
    "revision": ((None,), _LOCAL),
    "tokenizer_revision": ((None,), _LOCAL),
    "code_revision": ((None,), _LOCAL),
    "download_dir": ((None,), _LOCAL),
    "load_format": (("auto",), "the directory's weights are loaded (safetensors, else PyTorch .bin with "
                    "weights_only=True); tests build a tiny checkpoint instead of 'dummy' weights"),
    "quantization": ((None,), "weights are loaded unquantized (the int8_quant sample plugin quantizes as it loads)"),
    "gpu_memory_utilization": ((0.9,), "nothing is reserved ahead: the KV cache grows as sequences need it, checked "
                               "against the memory left"),
    "swap_space": (None, "a sequence preempted for memory is computed again, never swapped out"),
    "cpu_offload_gb": ((0,), "the weights stay on the model's device"),
    "enforce_eager": ((True, False, None), "decoding is eager unless compile_decode=True"),
    "pipeline_parallel_size": ((1,), "only tensor parallelism (tensor_parallel_size) is run"),
    "distributed_executor_backend": ((None, "mp"), "tensor-parallel ranks are processes on this machine (or "
                                     "torchrun's)"),
    "enable_lora": ((False,), "no LoRA adapters are run"),
    "hf_token": ((None,), _LOCAL),
    "allowed_local_media_path": (("",), "prompts are text or token ids: no media is read"),
    "task": (("auto", "generate"), _GENERATES),
    "runner": (("auto", "generate"), _GENERATES),
    # Speed and logging only: the answers are the same at any value.
    "enable_prefix_caching": (None, "no prefix is cached (every prompt is prefilled)"),
    "enable_chunked_prefill": (None, "a prompt longer than max_num_batched_tokens is prefilled in pieces"),
    "disable_log_stats": (None, "statistics go to record_stats hooks and the server's /metrics"),
    "disable_custom_all_reduce": (None, "tensor parallelism reduces through torch.distributed"),
    "disable_async_output_proc": (None, "outputs are handed out by the engine's own thread"),
    "max_seq_len_to_capture": (None, "CUDA graphs, with compile_decode=True, are captured for every length"),
    "block_size": (None, "the KV cache holds one row per sequence, not blocks"),
}  # fmt: skip


def take_vllm_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without the vLLM ``LLM()`` settings given at values that ask for nothing pluginhost does not do.

    A port passes vLLM's settings for vLLM's machinery (``gpu_memory_utilization=0.9``, ``enforce_eager=True``,
    ``trust_remote_code=False``...): at those values they are dropped, logged at debug level; at any other value
    (``gpu_memory_utilization=0.5``, ``trust_remote_code=True``) they are one ``ConfigError`` naming each, with what
    pluginhost does instead. ``tokenizer`` is also taken as the model's own directory. A setting pluginhost has
    itself (``dtype``, ``seed``, ``max_model_len``...) is never touched.
    """
    kept: dict[str, Any] = {}
    refused: list[str] = []
    for name, value in settings.items():
        if name not in _VLLM_SETTINGS:
            kept[name] = value
            continue
        neutral, instead = _VLLM_SETTINGS[name]
        if neutral is None or any(_same_setting(value, n) for n in neutral) or _the_models_tokenizer(name, settings):
            logger.debug("vLLM's setting %s=%r taken: it changes nothing here (%s)", name, value, instead)
            continue
        taken = " or ".join(repr(n) for n in neutral)
        refused.append(f"{name}: {value!r} is not supported: {instead} (vLLM's setting is taken as {taken} only)")
    if settings.get("enforce_eager") is True and settings.get("compile_decode") is True:
        refused.append("enforce_eager: True asks for eager decoding, compile_decode=True for a compiled step: leave "
                       "one of them out")  # fmt: skip
    if refused:
        raise ConfigError("Invalid engine settings: " + "; ".join(refused))
    return kept


def _same_setting(value: Any, neutral: Any) -> bool:
    """``value`` is ``neutral``: ``True`` is not ``1``, but ``0.9`` read as a NumPy float32 is ``0.9``."""
    value_is_bool = isinstance(value, bool) or type(value).__name__ == "bool_"  # NumPy's too
    if neutral is None or value is None:
        return value is neutral
    if isinstance(neutral, bool) or value_is_bool:
        return isinstance(neutral, bool) and value_is_bool and bool(value) == neutral
    if isinstance(neutral, int | float):
        return isinstance(value, numbers.Real) and math.isclose(float(value), neutral, rel_tol=1e-6)
    return type(value) is type(neutral) and value == neutral


def _the_models_tokenizer(name: str, settings: dict[str, Any]) -> bool:
    """``tokenizer`` naming the model's own directory (ports often pass ``tokenizer=model``)."""
    if name != "tokenizer" or not isinstance(settings.get("tokenizer"), str | os.PathLike):
        return False
    model = settings.get("model")
    if not isinstance(model, str | os.PathLike):
        return False
    return os.path.realpath(os.fspath(settings["tokenizer"])) == os.path.realpath(os.fspath(model))


def _dtype_name(value: Any) -> Any:
    """A torch dtype's name, or a string as vLLM reads it ("BFloat16" is bfloat16); anything else as it is."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        value = str(value).removeprefix("torch.")
    return value.strip().lower() if isinstance(value, str) else value


class _BuiltOverrides(dict):
    """``hf_overrides`` of a built engine: reads as the dict it was, refuses every change.

    Nested dicts (``rope_scaling``) are read-only too. A copy is a plain dict again, as a copied config
    describes no engine yet.
    """

    def __init__(self, overrides: dict[str, Any]) -> None:
        super().__init__({k: _BuiltOverrides(v) if isinstance(v, dict) else v for k, v in overrides.items()})

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            f"EngineConfig.hf_overrides cannot change once the engine is built (it is {self.plain()!r}): the model "
            "was built from the config they made, and would not change with them. Build a new engine with the "
            "overrides you want instead."
        )

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def plain(self) -> dict[str, Any]:
        return {k: v.plain() if isinstance(v, _BuiltOverrides) else v for k, v in self.items()}

    def __copy__(self) -> dict[str, Any]:
        return self.plain()

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(self.plain(), memo)

    def __reduce__(self) -> tuple[Any, ...]:  # unpickled with the config, still built: still read-only
        return _BuiltOverrides, (self.plain(),)


class EngineConfig(BaseModel):
    """The settings of one engine. Build one with ``LLM(model=..., **fields)``."""

    model_config = ConfigDict(
        validate_assignment=True,
        extra="forbid",
        protected_namespaces=(),
        frozen=False,
    )

    model: str = Field(
        description="Path of a Hugging Face-format model directory (config.json, weights, optional tokenizer)."
    )
    model_architecture_override: str | None = Field(
        default=None,
        description="Build this registered architecture instead of the one config.json names.",
    )
    model_impl: Literal["auto", "native", "transformers"] = Field(
        default="auto",
        description="'auto': the registered model for the architecture if there is one, else the transformers "
        "fallback; 'native': registered models only; 'transformers': always the fallback.",
    )
    hf_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Attributes set on the Hugging Face config after it is read.",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto",
        description="Parameter dtype; 'auto' takes the checkpoint's where the device runs it well, else float32.",
    )
    kv_cache_dtype: Literal["auto", "bfloat16"] = Field(
        default="auto",
        description="The KV cache's dtype: 'auto', the model's; 'bfloat16' holds a float32 model's keys and values "
        "rounded to bfloat16: half the cache's memory, and the builtin models attend in bfloat16 over it, reading "
        "half the bytes (vLLM's setting; its fp8 values are not taken).",
    )
    device: str = Field(default="auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'.")
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="Longest prompt plus generated tokens; defaults to the model's position limit.",
    )
    max_num_seqs: int = Field(default=32, gt=0, description="Most sequences running together (rows of the batch).")
    max_num_batched_tokens: int = Field(
        default=2048,
        gt=0,
        description="Prompt tokens (padding included) a step prefills for joining sequences, the first always joining; "
        "a longer prompt is prefilled in pieces of this many tokens, by models that take pieces (the builtin ones).",
    )
    max_waiting_seqs: int = Field(
        default=1024,
        gt=0,
        description="Most sequences waiting to run beyond the rows free in the running batch; more are refused (a "
        "server answers 503) instead of queued.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        gt=0,
        le=64,
        description="Processes the model is split over (tensor parallelism; gloo on CPU, NCCL on CUDA). Under "
        "torchrun, its world size.",
    )
    compile_decode: bool = Field(
        default=False,
        description="Compile the decoding step with torch.compile (replayed as a CUDA graph on a GPU). Each new "
        "shape compiles at its first step (seconds): a batch-size bucket (1, 2, 4, 8, then multiples of 8) times a "
        "KV-cache length (256 slots, doubling); the cache takes all max_num_seqs rows at once. Decoding falls back "
        "to eager if compiling fails.",
    )
    seed: int = Field(
        default=0,
        ge=-(2**63),
        le=2**64 - 1,
        description="Seed of the sampler for requests that set none themselves (what torch.manual_seed takes).",
    )
    max_logprobs: int = Field(
        default=20,
        ge=-1,
        description="Most log-probabilities a request may ask for per token (SamplingParams.logprobs); -1: the "
        "whole vocabulary, as in vLLM.",
    )
    allow_external_weights: bool = Field(
        default=False,
        description="Read weight files that an index or a link places outside the model directory.",
    )
    refuse_nonfinite_weights: bool = Field(
        default=False, description="Refuse a checkpoint holding inf or nan weights (by default: a warning naming them)."
    )
    generation_config: Literal["auto", "vllm"] = Field(
        default="auto",
        description="Default sampling parameters, as vLLM's: 'auto', those the model's generation_config.json "
        "recommends (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) for what a "
        "request leaves out; 'vllm', SamplingParams' own.",
    )

    _provenance: dict[str, str] = PrivateAttr(default_factory=dict)
    #: Set once the engine is built: a change then would describe an engine that is not the one running.
    _fixed: bool = PrivateAttr(default=False)

    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        """``None`` for a setting whose vLLM default is ``None`` (a port passes its arguments' defaults): the default,
        as if not given."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NONE_MEANS_DEFAULT)}
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _model_path_as_str(cls, value: Any) -> Any:
        # A pathlib.Path (any os.PathLike) is the natural thing to pass; keep the field a str.
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the model path is empty; pass the path of a model directory")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_aliases(cls, value: Any) -> Any:
        # vLLM's other spellings: "half", "float", and torch dtypes themselves (torch.bfloat16).
        value = _dtype_name(value)
        if isinstance(value, str):
            value = _DTYPE_ALIASES.get(value, value)
            if value not in get_args(cls.model_fields["dtype"].annotation):
                raise ValueError(
                    f"{value!r} is not a dtype pluginhost runs: use 'auto', 'float32' (or 'float'), 'float16' (or "
                    "'half') or 'bfloat16', as a string or a torch dtype"
                )
        return value

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _kv_cache_dtype_spellings(cls, value: Any) -> Any:
        value = _dtype_name(value)
        if isinstance(value, str):
            if value not in get_args(cls.model_fields["kv_cache_dtype"].annotation):
                raise ValueError(
                    f"{value!r} is not a KV cache dtype pluginhost runs: use 'auto' (the model's dtype) or 'bfloat16'"
                    + (" (fp8 caches are not run)" if value.startswith("fp8") else "")
                )
        return value

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"unknown device {value!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return value

    @field_validator("model_architecture_override")
    @classmethod
    def _override_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("the architecture override is empty; omit it or name an architecture")
        return value

    def model_post_init(self, context: Any, /) -> None:
        self._provenance = {
            name: ("user" if name in self.model_fields_set else "default") for name in type(self).model_fields
        }

    def __setattr__(self, name: str, value: Any) -> None:
        if self._fixed and name in type(self).model_fields:
            raise ConfigError(
                f"EngineConfig.{name} cannot change once the engine is built (it is {getattr(self, name)!r}): "
                f"the engine would go on as built, and the config would no longer describe it. Build a new engine "
                f"with {name}={value!r} instead."
            )
        before = getattr(self, name, None)
        super().__setattr__(name, value)
        # Whoever set the value keeps the credit when it is set again unchanged (a site policy's dtype "half" over
        # the user's "float16" is the user's float16); not when the same dict or list comes back, which its
        # assigner may have changed in place (hf_overrides).
        changed = getattr(self, name) != before or (value is before and isinstance(value, dict | list | set))
        if name in type(self).model_fields and (name not in self._provenance or changed):
            plugin = current_plugin()
            self._provenance[name] = f"plugin:{plugin.name}" if plugin else "user"

    def settle(self, **values: Any) -> None:
        """Replace settings the engine decided (``device="auto"`` -> ``"cpu"``) by the decision.

        Each value is validated; provenance keeps who asked for the setting, since
        the decision follows from it. The engine calls this before ``pre_load``, so
        plugins see the concrete device, dtype and ``max_model_len``.
        """
        for name, value in values.items():
            source = self._provenance[name]
            setattr(self, name, value)
            self._provenance[name] = source

    def fix(self) -> None:
        """Make every setting read-only: the engine calls this once it is built (after ``post_load``).

        A copy (``model_copy()``, ``copy.deepcopy``) is free again: it describes no engine yet.
        """
        self.__dict__["hf_overrides"] = _BuiltOverrides(self.hf_overrides)
        self._fixed = True

    def __copy__(self) -> EngineConfig:
        copied = super().__copy__()
        copied.__dict__["hf_overrides"] = copy.copy(self.hf_overrides)
        copied._fixed = False
        return copied

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> EngineConfig:
        copied = super().__deepcopy__(memo)
        copied._fixed = False
        return copied

    @property
    def max_sequences_taken(self) -> int:
        """The most sequences the engine ever takes in at once: a whole batch and a whole queue.

        A request of more samples (over the server, prompts x ``n``) could never be served: it is a bad
        request, not one to retry.
        """
        return self.max_num_seqs + self.max_waiting_seqs

    @property
    def provenance(self) -> dict[str, str]:
        """Who set each field last: ``default``, ``user`` or ``plugin:NAME``."""
        return dict(self._provenance)


#: Settings vLLM's ``LLM`` takes as ``None`` for "its default" (lm-eval passes ``max_num_seqs=None`` unless told).
_NONE_MEANS_DEFAULT = frozenset({"max_num_seqs", "max_num_batched_tokens"})


def describe_validation_error(exc: Exception) -> str:
    """One line per problem in a pydantic ``ValidationError``: ``field: message (got value)``."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for error in errors():
        where = ".".join(str(p) for p in error.get("loc", ())) or "value"
        message = error.get("msg", "invalid")
        if error.get("type") in ("extra_forbidden", "no_such_attribute") and where in _TAKEN_ELSEWHERE:
            parts.append(f"{where}: {_TAKEN_ELSEWHERE[where]}")
        elif error.get("type") in ("extra_forbidden", "no_such_attribute"):
            known = ", ".join(EngineConfig.model_fields)
            parts.append(f"{where}: unknown setting (known settings: {known})")
        elif error.get("type") == "value_error":  # our validators' messages say what was given
            parts.append(f"{where}: {message.removeprefix('Value error, ')}")
        else:
            parts.append(f"{where}: {message} (got {error.get('input')!r})")
    return "; ".join(parts)
