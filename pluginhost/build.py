"""Building an engine's model: one straight line, each step once, cheapest errors first.

1. plugins load (``PluginHost.load``);
2. ``register_models`` collects this engine's architecture registry, and
   ``register_logits_processors`` its logits processors;
3. ``modify_config`` adjusts the ``EngineConfig`` (the user's settings are in);
4. the model directory is checked and its ``config.json`` read, then
   ``hf_overrides`` and the architecture override applied;
5. the architecture is picked from the registry, by ``model_impl``: the
   registered model, or the transformers fallback; ``max_model_len`` is
   decided (the model's positions unless set, never more) and written into
   the config, and settings that cannot run together are refused;
6. (``LLM``) the tokenizer is loaded and the weight files found, so a broken
   tokenizer or missing weights fail before anything heavy; the model class
   is resolved (imported and checked); device and dtype are decided and
   written into the config; ``pre_load`` sees all of it;
7. (``LLM``) the model is constructed on the meta device (no memory yet), its
   weights are loaded straight onto the target device and dtype, and
   ``post_load`` sees the loaded model.

``plan_build`` is steps 1 to 5; ``pluginhost config`` goes on through step 6
but the tokenizer and the weight files (``loader.settle_for_pre_load``), so it
shows the settings the engine runs with, device, dtype and ``pre_load``'s
changes included, without reading weights (only ``post_load``, which needs the
built model, may change more). An exception anywhere aborts the build;
nothing is kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pluginhost.config import EngineConfig
from pluginhost.errors import ConfigError, UnknownArchitectureError
from pluginhost.host import PluginHost
from pluginhost.logits_processors import RegisteredProcessor
from pluginhost.model_dir import (
    apply_overrides,
    generation_defaults,
    generation_eos_ids,
    load_hf_config,
    model_directory,
    read_generation_config,
    text_config,
)
from pluginhost.registry import TRANSFORMERS_FALLBACK, ArchitectureRegistry, ModelRegistry, Registration, builtin_ref

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

__all__ = [
    "TRANSFORMERS_FALLBACK",
    "BuildPlan",
    "check_combination",
    "no_causal_lm",
    "plan_build",
    "transformers_builds",
    "transformers_causal_lms",
]


@dataclass
class BuildPlan:
    """Everything decided before the model class is imported."""

    config: EngineConfig
    model_dir: Path
    hf_config: PretrainedConfig
    registry: ArchitectureRegistry
    registration: Registration
    logits_processors: list[RegisteredProcessor]
    #: End-of-sequence ids of ``generation_config.json``, besides the config's and the tokenizer's.
    generation_eos_ids: frozenset[int] = frozenset()
    #: The default ``SamplingParams`` fields of ``generation_config.json`` (``generation_config="auto"``).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.registration.architecture

    def describe(self) -> dict[str, Any]:
        entry = self.registration
        return {
            "architecture": entry.architecture,
            "implementation": entry.implementation,
            "registered_by": entry.registered_by.name,
        }


def plan_build(config: EngineConfig, host: PluginHost) -> BuildPlan:
    """Steps 1 to 5 of the build."""
    host.load()
    registry = host.collect_models()
    processors = host.collect_logits_processors().entries()
    host.call("modify_config", config=config)
    model_dir = model_directory(config.model)
    hf_config = load_hf_config(model_dir, config.hf_overrides)
    generation = read_generation_config(model_dir)
    generation_eos = generation_eos_ids(model_dir, generation)
    sampling_defaults = generation_defaults(model_dir, generation) if config.generation_config == "auto" else {}
    apply_overrides(hf_config, config.hf_overrides, config.model_architecture_override)
    try:
        registration = _pick_architecture(
            registry, hf_config.architectures, config.model_impl, getattr(hf_config, "model_type", None)
        )
    except UnknownArchitectureError as exc:
        elsewhere = _registered_by_plugins_not_loaded(hf_config.architectures, host)
        if elsewhere:
            raise UnknownArchitectureError(f"{exc} {elsewhere}") from None
        if getattr(hf_config, "auto_map", None):
            raise UnknownArchitectureError(
                f"{exc} config.json names code of its own (auto_map), which pluginhost never runs from a model "
                "directory: install a plugin that registers the architecture."
            ) from None
        left_out = host.left_out_message()
        if left_out is None:
            raise
        raise UnknownArchitectureError(f"{exc} {left_out}") from None
    config.settle(max_model_len=_max_model_len(config, hf_config))
    check_combination(config)
    if sampling_defaults:
        logger.warning(
            "Default sampling parameters are those %s/generation_config.json recommends: %s (as vLLM's "
            "generation_config='auto'); a request's own values win. For SamplingParams' own defaults, pass "
            "generation_config='vllm' (--generation-config vllm).",
            model_dir,
            ", ".join(f"{k}={v}" for k, v in sampling_defaults.items()),
        )
    return BuildPlan(
        config, model_dir, hf_config, registry, registration, processors, generation_eos, sampling_defaults
    )


def check_combination(config: EngineConfig, hf_config: Any = None) -> None:
    """Settings valid alone that the engine cannot run together, or (given ``hf_config``) with the model.

    Checked again after each build hook that may change them (``pre_load``, ``post_load``).
    """
    if hf_config is not None:
        if config.max_model_len is None:
            raise ConfigError(
                f"max_model_len was set to None by {config.provenance['max_model_len']} after the engine had settled "
                "it from the model: give a number, or leave it as it was"
            )
        _max_model_len(config, hf_config)
    if config.compile_decode and config.tensor_parallel_size > 1:
        raise ConfigError(
            f"compile_decode cannot be combined with tensor parallelism (tensor_parallel_size is "
            f"{config.tensor_parallel_size}): the split model's collectives are not compiled yet. "
            "Leave one of them out."
        )


def _position_limit(hf_config: Any) -> int | None:
    """The longest sequence the model takes: its positions, stretched by RoPE scaling that stretches them.

    As in vLLM: ``linear``, ``dynamic`` and ``yarn`` scaling multiply the trained
    length by their factor; ``llama3`` and ``longrope`` configs already give the
    stretched length.
    """
    hf_config = text_config(hf_config)  # a multimodal checkpoint's language model
    limit = getattr(hf_config, "max_position_embeddings", None)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if limit is None or not isinstance(rope, dict):
        return limit
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind in ("linear", "dynamic") and factor:
        return int(limit * factor)
    if kind == "yarn" and factor:
        return int(rope.get("original_max_position_embeddings", limit) * factor)
    return limit


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = _position_limit(hf_config)
    if config.max_model_len is None:
        if limit is None:
            raise ConfigError("The model config has no max_position_embeddings; set max_model_len.")
        return int(limit)
    if limit is not None and config.max_model_len > limit:
        rope = getattr(text_config(hf_config), "rope_parameters", None)
        stretched = ", stretched by its RoPE scaling" if rope else ""
        raise ConfigError(
            f"max_model_len={config.max_model_len} is more than the model's {limit} positions "
            f"(max_position_embeddings{stretched}); lower it."
        )
    return config.max_model_len


def _registered_by_plugins_not_loaded(architectures: list[str], host: PluginHost) -> str:
    """Why an architecture this process registered does not count here: its plugin is not loaded by this engine.

    A script calling an installed plugin's ``register()`` itself, with the plugin excluded
    (``load_installed_plugins=False``, a selection): the registration is that plugin's, and applies
    only where the plugin is loaded.
    """
    loaded = {(r.name, r.distribution) for r in host.records if r.kind == "installed" and r.status == "loaded"}
    registered = [ModelRegistry.get(arch) for arch in architectures if arch in ModelRegistry]
    found = [
        r
        for r in registered
        if r.registered_by.distribution is not None
        and (r.registered_by.name, r.registered_by.distribution) not in loaded
    ]
    if not found:
        # Not an installed plugin's, yet listed and not applied: an in-process plugin's (a register() passed to
        # another engine), which applies only to the engines given it.
        elsewhere = [r for r in registered if r.registered_by.distribution is None]
        if not elsewhere:
            return ""
        entry = elsewhere[0]
        return (
            f"{entry.architecture} was registered in this process by the in-process plugin "
            f"{entry.registered_by.name!r}, which this engine is not given: its registrations apply only to the "
            "engines it is passed to. Pass it to this one too: LLM(model, plugins=[...])."
        )
    entry = found[0]
    return (
        f"{entry.architecture} was registered in this process by code of {entry.registered_by.describe()}, which "
        "this engine does not load (load_installed_plugins=False, or the plugin selection): its registrations apply "
        "only where it is loaded. Load it, or pass its register function in-process: LLM(model, plugins=[register])."
    )


def _pick_architecture(
    registry: ArchitectureRegistry, architectures: list[str], model_impl: str, model_type: object = None
) -> Registration:
    """The registration that builds the model, by ``model_impl``.

    "native": the first of the config's architectures that is registered.
    "transformers": the fallback (``TransformersForCausalLM``, or what a plugin
    registered under that name). "auto": native when registered, else the
    fallback when transformers can build the model, else an error naming both.
    """
    native = [a for a in architectures if a in registry and a != TRANSFORMERS_FALLBACK]
    if model_impl == "auto" and not native and transformers_builds(architectures):
        return registry.get(TRANSFORMERS_FALLBACK)
    if model_impl == "transformers":
        fallback = registry.get(TRANSFORMERS_FALLBACK)
        if fallback.registered_by == builtin_ref() and not transformers_builds(architectures, model_type):
            raise UnknownArchitectureError(f"model_impl='transformers', but {no_causal_lm(architectures, model_type)}")
        return fallback
    if native:
        return registry.get(native[0])
    try:
        return registry.get(architectures[0])  # raises, naming close matches
    except UnknownArchitectureError as exc:
        if model_impl == "native" and transformers_builds(architectures):
            raise UnknownArchitectureError(
                f"{exc} transformers could build it: pass model_impl='auto' (--model-impl auto) to use the "
                "transformers fallback."
            ) from None
        raise


def transformers_causal_lms() -> set[str]:
    """The causal-LM classes transformers' ``AutoModelForCausalLM`` can build (imports transformers, and torch)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        name
        for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        for name in ([names] if isinstance(names, str) else names)
    }


def no_causal_lm(architectures: list[str], model_type: object) -> str:
    """Why transformers cannot build the checkpoint (``transformers_builds`` said no)."""
    return (
        f"transformers has no causal LM for this checkpoint: none of its architectures "
        f"({', '.join(architectures) or 'none'}) is a transformers causal-LM class, and AutoModelForCausalLM maps "
        f"no class to model_type {model_type!r}."
    )


def transformers_builds(architectures: list[str], model_type: object = None) -> bool:
    """Whether transformers has a causal-LM class of one of these names (or, given, for this ``model_type``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return bool(set(architectures) & transformers_causal_lms()) or (
        isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
