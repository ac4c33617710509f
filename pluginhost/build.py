"""Building an engine's model: one straight line, each step once, cheapest errors first.

1. plugins load (``PluginHost.load``);
2. ``register_models`` collects this engine's architecture registry, and
   ``register_logits_processors`` its logits processors;
3. ``modify_config`` adjusts the ``EngineConfig`` (the user's settings are in);
4. the model directory is checked and its ``config.json`` read, then
   ``hf_overrides`` and the architecture override applied;
5. the architecture is picked from the registry;
6. (``LLM``) the tokenizer is loaded and the weight files found, so a broken
   tokenizer or missing weights fail before anything heavy; the model class
   is resolved (imported and checked); device, dtype and ``max_model_len``
   are decided and written into the config; ``pre_load`` sees all of it;
7. (``LLM``) the model is constructed on the meta device (no memory yet), its
   weights are loaded straight onto the target device and dtype, and
   ``post_load`` sees the loaded model.

``plan_build`` is steps 1 to 5, so ``pluginhost config`` can show what would
be built without reading weights or importing the model class (transformers'
config classes, and with them torch, are imported). An exception anywhere
aborts the build; nothing is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pluginhost.config import EngineConfig
from pluginhost.host import PluginHost
from pluginhost.logits_processors import RegisteredProcessor
from pluginhost.model_dir import apply_overrides, load_hf_config, model_directory
from pluginhost.registry import ArchitectureRegistry, Registration

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["BuildPlan", "plan_build"]


@dataclass
class BuildPlan:
    """Everything decided before the model class is imported."""

    config: EngineConfig
    model_dir: Path
    hf_config: PretrainedConfig
    registry: ArchitectureRegistry
    registration: Registration
    logits_processors: list[RegisteredProcessor]

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
    hf_config = load_hf_config(model_dir)
    apply_overrides(hf_config, config.hf_overrides, config.model_architecture_override)
    registration = _pick_architecture(registry, hf_config.architectures)
    return BuildPlan(config, model_dir, hf_config, registry, registration, processors)


def _pick_architecture(registry: ArchitectureRegistry, architectures: list[str]) -> Registration:
    """The first of the config's architectures that is registered."""
    for architecture in architectures:
        if architecture in registry:
            return registry.get(architecture)
    return registry.get(architectures[0])  # raises, naming close matches
