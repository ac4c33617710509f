"""pytest fixtures for plugin authors, enabled automatically when pluginhost is installed.

* ``tiny_opt_dir``: a tiny random OPT model directory with a tokenizer, built
  offline once per test session (transformers' own ``save_pretrained``).
* ``make_engine(*plugins, **settings)``: an ``LLM`` on ``tiny_opt_dir`` (or
  ``model=...``) that loads only the plugins under test, whatever else is
  installed; pass your plugin module or object. What the test registers
  through ``ModelRegistry`` itself (calling a plugin's ``register()``, as vLLM
  tests do) applies too, whether that plugin is installed or not.
* ``make_host(*plugins)``: the same isolation without building a model, for
  registry and configuration checks (``make_host(p).collect_models()``).
* ``hook_recorder``: every hook call made by engines and hosts from the two
  factories above, with its arguments, through pluggy's hook call monitoring.
* ``model_registry``: the process-wide ``pluginhost.ModelRegistry``, restored
  after the test to what it held before: registrations a test makes (at a
  plugin's import, in a ``register()`` function, in your own code) do not
  leak into later tests. During the test it shows what the kit's engines
  apply (installed plugins' registrations from before the test, made by
  engines that loaded them, are hidden), so a vLLM guard the test runs decides
  as they would. ``make_host`` and ``make_engine`` use it.

Example::

    import my_plugin
    from hookspecs import BUILD_HOOKS
    from pluginhost import SamplingParams

    def test_my_architecture(make_engine, hook_recorder):
        llm = make_engine(my_plugin, model_architecture_override="MyOPT")
        out = llm.generate([[2, 5]], SamplingParams(max_tokens=3, temperature=0))
        assert hook_recorder.names() == list(BUILD_HOOKS)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pluginhost.engine import LLM
    from pluginhost.host import PluginHost
    from pluginhost.registry import ArchitectureRegistry, RegistrySnapshot

__all__ = ["HookCall", "HookRecorder", "hook_recorder", "make_engine", "make_host", "model_registry", "tiny_opt_dir"]


@dataclass(frozen=True)
class HookCall:
    """One hook call: its name, its arguments, and the plugins whose implementations ran."""

    name: str
    kwargs: Mapping[str, Any]
    plugins: tuple[str, ...]


@dataclass
class HookRecorder:
    """Hook calls in the order they happened."""

    calls: list[HookCall] = field(default_factory=list)

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def last(self, name: str) -> HookCall:
        """The most recent call of hook ``name``."""
        for call in reversed(self.calls):
            if call.name == name:
                return call
        raise LookupError(f"hook {name!r} was not called; calls so far: {self.names()}")

    def attach(self, host: PluginHost) -> None:
        """Record the hook calls of ``host`` (loads its plugins)."""

        def before(hook_name: str, hook_impls: Any, kwargs: Mapping[str, Any]) -> None:
            plugins = tuple(impl.plugin_name for impl in reversed(hook_impls))
            self.calls.append(HookCall(hook_name, dict(kwargs), plugins))

        def after(outcome: Any, hook_name: str, hook_impls: Any, kwargs: Any) -> None:
            pass

        host.plugin_manager.add_hookcall_monitoring(before, after)


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random OPT (2 layers, hidden 32, vocab 384) with a byte-level tokenizer."""
    from pluginhost.testing.models import make_tiny_opt

    return make_tiny_opt(tmp_path_factory.mktemp("pluginhost-tiny-opt"))


@pytest.fixture
def hook_recorder() -> HookRecorder:
    return HookRecorder()


@pytest.fixture
def _model_registry_at_start() -> Iterator[RegistrySnapshot]:
    """What ``ModelRegistry`` held when the test started, put back when it ends; meanwhile it shows what kit engines
    apply: the builtins, registrations by code of no installed plugin, and everything registered during the test."""
    from pluginhost.registry import ModelRegistry, Registration, builtin_ref

    snapshot = ModelRegistry.snapshot()
    builtin = builtin_ref()

    def applied(entry: Registration) -> bool:
        ref = entry.registered_by
        return ref == builtin or ref.distribution is None or not snapshot.holds(entry)

    try:
        with ModelRegistry.showing_only(applied):
            yield snapshot
    finally:
        ModelRegistry.restore(snapshot)


@pytest.fixture
def model_registry(_model_registry_at_start: RegistrySnapshot) -> ArchitectureRegistry:
    """``pluginhost.ModelRegistry``, with every registration made during the test undone afterwards."""
    from pluginhost.registry import ModelRegistry

    return ModelRegistry


@pytest.fixture
def make_host(hook_recorder: HookRecorder, _model_registry_at_start: RegistrySnapshot) -> Callable[..., PluginHost]:
    def factory(*plugins: object) -> PluginHost:
        from pluginhost.host import PluginHost

        # Installed plugins stay out, but not what the test registered itself: an installed plugin's code
        # registers as that plugin, and the test would otherwise pass from a source checkout only.
        host = PluginHost(plugins=plugins, load_installed=False, apply_registrations_since=_model_registry_at_start)
        hook_recorder.attach(host)
        return host

    return factory


@pytest.fixture
def make_engine(make_host: Callable[..., PluginHost], tiny_opt_dir: Path) -> Callable[..., LLM]:
    def factory(*plugins: object, **settings: Any) -> LLM:
        from pluginhost.engine import LLM

        settings.setdefault("model", str(tiny_opt_dir))
        settings.setdefault("device", "cpu")
        return LLM._from_host(make_host(*plugins), **settings)

    return factory
