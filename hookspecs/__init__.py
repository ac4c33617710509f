"""The pluginhost hook contract.

Every hook a plugin may implement is specified here, and each spec's docstring
is its contract: when the host calls it, what an implementation may change and
what it must not do. Argument names are part of the contract: an implementation
may accept any subset of a spec's arguments, by the same names, and none of
them may have a default value (pluggy would silently never pass it).

The hooks run once per engine build, in this order::

    register_models(registry)            # collect architectures
    modify_config(config)                # adjust the EngineConfig
    pre_load(config, model_class)        # inspect or refuse the resolved class
    post_load(config, model)             # wrap, patch or check the loaded model

Within one hook, implementations run builtin first, then installed plugins in
alphabetical order of entry-point name, then in-process plugins in the order
given; a later implementation sees, and may override, what an earlier one did.
``tryfirst``/``trylast`` move an implementation to the front or the back, and
``wrapper=True`` generators wrap the others, as in pluggy.

This module must stay importable without torch or transformers: the listing
commands import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from pluginhost.config import EngineConfig
    from pluginhost.registry import ArchitectureRegistry

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "modify_config",
    "post_load",
    "pre_load",
    "register_models",
]

#: The pluggy project name: markers of other projects are ignored.
PROJECT_NAME = "pluginhost"

#: Installed plugins are found through this entry-point group.
ENTRY_POINT_GROUP = "pluginhost.plugins"

#: Marks a hook specification (used by this module only).
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

#: Marks a hook implementation in a plugin: ``@hookimpl def register_models(registry): ...``
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_models(registry: ArchitectureRegistry) -> None:
    """Register model architectures.

    Called once per engine build, before the architecture is resolved, and by
    ``pluginhost models``. The builtin architectures are registered first, so
    registering an existing architecture name replaces it (the replacement is
    logged with both sources and shown by ``pluginhost models``).

    May: call ``registry.register_model(architecture, model)`` any number of
    times, where ``model`` is a class or a lazy ``"package.module:ClassName"``
    string that is imported only when that architecture is used.

    Must not: import torch or build anything (listing models must stay cheap;
    prefer the lazy string form), or keep the registry for later use.

    Example::

        @hookimpl
        def register_models(registry):
            registry.register_model("MyOPT", "my_plugin.model:MyOPT")
    """


@hookspec
def modify_config(config: EngineConfig) -> None:
    """Adjust the engine configuration.

    Called once per engine build, after the user's settings are applied and
    before the model directory is read or anything is resolved.

    May: assign fields of ``config`` (an ``EngineConfig``) in place. Every
    assignment is validated at once, and ``pluginhost config`` reports the
    field as set by ``plugin:NAME``. Assign whole values (``config.hf_overrides
    = {...}``) rather than mutating them, so provenance stays correct.

    Must not: replace the object, or raise unless the configuration must be
    refused (the build then stops with an error naming this plugin).

    Example::

        @hookimpl
        def modify_config(config):
            if config.max_model_len is None or config.max_model_len > 1024:
                config.max_model_len = 1024
    """


@hookspec
def pre_load(config: EngineConfig, model_class: type[torch.nn.Module]) -> None:
    """Inspect the resolved model class before any parameter is allocated.

    Called once per engine build, after ``config.json`` is read, overrides are
    applied and the architecture is resolved to ``model_class``, and before
    the model is constructed.

    May: inspect ``config`` and ``model_class``; raise an exception to refuse
    the build (its message reaches the user, naming this plugin).

    Must not: construct the model or allocate device memory.

    Example::

        @hookimpl
        def pre_load(config, model_class):
            if model_class.__name__ in {"UntrustedForCausalLM"}:
                raise RuntimeError(f"{model_class.__name__} is not allowed on this site")
    """


@hookspec
def post_load(config: EngineConfig, model: torch.nn.Module) -> None:
    """Wrap, patch or check the model after its weights are loaded.

    Called once per engine build, after every weight is loaded and the model
    is in eval mode on its device, before the first forward pass.

    May: patch ``model`` in place (register forward hooks, replace
    submodules, check parameters); raise to refuse the model.

    Must not: replace the object (the engine keeps the one it built), move it
    to another device, or change its dtype.

    Example::

        @hookimpl
        def post_load(config, model):
            n = sum(p.numel() for p in model.parameters())
            print(f"{type(model).__name__}: {n / 1e6:.1f}M parameters")
    """
