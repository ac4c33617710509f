"""Building an engine's model, hook by hook.

The order, each step seeing what the earlier ones did:

1. plugins load (``PluginHost.load``);
2. ``register_models`` collects this engine's architecture registry;
3. ``modify_config`` adjusts the ``EngineConfig`` (the user's settings are in);
4. ``config.json`` is read, then ``hf_overrides`` and the architecture override
   are applied to it;
5. the architecture is resolved to a class, and ``pre_load`` sees it;
6. the model is constructed on the meta device (no memory yet), its weights
   are loaded straight onto the target device and dtype;
7. ``post_load`` sees the loaded model.

``plan_build`` stops after step 4 plus the lookup of the registry entry, so
``pluginhost config`` can show what would be built without importing torch.
An exception anywhere aborts the build; nothing is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pluginhost.config import EngineConfig
from pluginhost.host import PluginHost
from pluginhost.model_dir import apply_overrides, load_hf_config
from pluginhost.registry import ArchitectureRegistry, Registration

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["BuildPlan", "plan_build"]


@dataclass
class BuildPlan:
    """Everything decided before the model class is imported."""

    config: EngineConfig
    hf_config: PretrainedConfig
    registry: ArchitectureRegistry
    registration: Registration

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
    """Steps 1 to 4 of the build, and the registry entry that step 5 will use."""
    host.load()
    registry = host.collect_models()
    host.call("modify_config", config=config)
    hf_config = load_hf_config(config.model)
    apply_overrides(hf_config, config.hf_overrides, config.model_architecture_override)
    return BuildPlan(config, hf_config, registry, _pick_architecture(registry, hf_config.architectures))


def _pick_architecture(registry: ArchitectureRegistry, architectures: list[str]) -> Registration:
    """The first of the config's architectures that is registered."""
    for architecture in architectures:
        if architecture in registry:
            return registry.get(architecture)
    return registry.get(architectures[0])  # raises, naming close matches
