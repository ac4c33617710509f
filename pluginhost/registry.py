"""The model registry: architecture name -> model class, and who registered it.

Each engine build collects its own ``ArchitectureRegistry`` through the
``register_models`` hook. ``pluginhost.ModelRegistry`` is the process-wide
default, so plugins written the vLLM way (``ModelRegistry.register_model(...)``
at import, in a ``register()`` function, or in a hook) work too:

* it knows the builtin architectures from the start, so vLLM's guard
  ``if arch not in ModelRegistry.get_supported_archs()`` behaves as in vLLM;
* called while an engine collects registrations (inside a hook), it registers
  into that engine's registry, so two engines never see each other's hooks;
* called while the host runs a plugin's ``register()`` function, it registers
  into that call's own registry: the function runs once per process, and the
  host replays what it registered to every engine that loads the plugin
  (every call is ``record``-ed here, so it is listed: an installed plugin's
  applies where that plugin is selected, an in-process one's only to the
  engines passing the function);
* called anywhere else, it keeps the registration, attributed to the installed
  plugin whose code made it (or, for code that belongs to no installed plugin,
  to the calling module). An engine applies it in its plugin's place in call
  order, beside the ``register_models`` hooks (``ArchitectureRegistry.merged``),
  but only while that plugin is selected: disabling a plugin removes its
  registrations even when its module was imported earlier. Registrations by
  code that belongs to no installed plugin (your own script) always apply, last.

Inside an engine's plugin code (a ``register()`` call, a hook),
``get_supported_archs()`` answers what that engine applies, so vLLM's guard
decides on the engine being built; anywhere else, every registration made so far.

Registering a name that exists replaces the entry; the entry remembers what it
replaced. Registering the same model again from the same source is silent.
Lazy ``"package.module:ClassName"`` targets are imported only when the
architecture is resolved, so listing models never imports torch.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType

from hookspecs import ENTRY_POINT_GROUP
from pluginhost.attribution import (
    PluginRef,
    current_plugin,
    importing_plugin,
    process_independent_name,
    run_only_under_main_guard,
)
from pluginhost.errors import ModelClassError, RegistryError, UnknownArchitectureError

__all__ = [
    "REQUIRED_METHODS",
    "TRANSFORMERS_FALLBACK",
    "ArchitectureRegistry",
    "ModelRegistry",
    "Registration",
    "RegistrySnapshot",
    "builtin_ref",
    "collecting_into",
]

logger = logging.getLogger(__name__)

#: What every model class must provide, besides being a ``torch.nn.Module``.
REQUIRED_METHODS = ("forward", "compute_logits", "load_weights")

#: What the engine passes ``model.forward``, by position (``pluginhost.engine.runner``: ``self.model(...)``).
FORWARD_ARGUMENTS = ("input_ids", "positions", "cache_rows", "mask")
#: The ``forward`` a model class writes (``builtin_models.opt.OPTForCausalLM``'s).
FORWARD_SIGNATURE = "(self, input_ids, positions, cache_rows=None, mask=None)"
#: vLLM's parameters after ``positions``: a forward naming them there would silently drop the cache rows and mask.
VLLM_FORWARD_PARAMETERS = frozenset({"intermediate_tensors", "inputs_embeds"})

#: The name of the always-loaded plugin that registers the builtin architectures.
BUILTIN_PLUGIN = "builtin_models"

#: The architecture name of the transformers fallback, which serves architectures no model is registered for.
TRANSFORMERS_FALLBACK = "TransformersForCausalLM"


def builtin_ref() -> PluginRef:
    """The identity of the builtin architectures' plugin (``builtin_models``, shipped with pluginhost)."""
    from pluginhost import __version__

    return PluginRef(BUILTIN_PLUGIN, "pluginhost", __version__)


@dataclass(frozen=True)
class Registration:
    """One architecture entry."""

    architecture: str
    #: ``"module:Class"``, whether registered lazily or as a class.
    implementation: str
    registered_by: PluginRef
    #: The class itself when it was registered as a class; lazy entries import on resolve.
    model_class: type | None = None
    #: The entry this one replaced, if any (and through it, the whole chain).
    replaced: Registration | None = None

    @property
    def overrides(self) -> list[Registration]:
        """Entries this one replaced, most recent first."""
        chain, entry = [], self.replaced
        while entry is not None:
            chain.append(entry)
            entry = entry.replaced
        return chain

    def same_as(self, implementation: str, model_class: type | None, source: PluginRef) -> bool:
        """Whether registering ``implementation`` from ``source`` again would change nothing."""
        return (
            self.implementation == implementation and self.model_class is model_class and self.registered_by == source
        )


@dataclass(frozen=True)
class RegistrySnapshot:
    """A registry's entries at one moment, for ``ArchitectureRegistry.restore``."""

    entries: MappingProxyType[str, Registration]
    #: ``ModelRegistry``'s recorded ``register()`` calls (``_ProcessRegistry.record``).
    recorded: tuple[ArchitectureRegistry, ...] = ()

    def holds(self, entry: Registration) -> bool:
        """Whether ``entry`` was in the registry then, current or replaced, or recorded (by identity: not one since)."""
        latest_entries = [*self.entries.values(), *(e for r in self.recorded for e in r.entries())]
        return any(entry is held for latest in latest_entries for held in (latest, *latest.overrides))


def _registering() -> PluginRef:
    """Who makes a registration now: the plugin whose code makes it.

    In a hook call, the hook's plugin (code it calls acts for it). While the host imports a plugin or
    calls its ``register()``, the installed plugin owning the innermost plugin module on the stack
    (``owner_of_module``): a plugin importing another's module does not make that module's
    registrations its own, and a package's own code belongs to the entry point naming that package
    even when a sibling entry point (``pkg.extra``) imported it. Code of the running plugin's package
    that no entry point names (``pkg.models`` beside ``pkg.plugin``) is the running plugin's, and so is
    anything else. Otherwise, the code on the stack (``_caller_ref``).
    """
    importing = importing_plugin()
    if importing is not None:
        return _caller_ref(running=importing) or importing
    return current_plugin() or _caller_ref()


def _caller_ref(*, running: PluginRef | None = None) -> PluginRef | None:
    """Who made a registration outside hook calls: the code on the stack.

    The innermost frame whose module belongs to an installed plugin (``owner_of_module``; ``running``,
    the plugin the host runs, is preferred among plugins sharing a package) attributes the
    registration to that plugin, however the module came to be imported; otherwise it is the calling
    module's (with ``running``: ``None``).
    """
    from pluginhost.discovery import discover_installed, owner_of_module

    installed = discover_installed()
    prefer = (running.name, running.distribution) if running is not None else None
    frame = sys._getframe(1)
    caller = None
    while frame is not None:
        # The script's own registrations are __main__'s on every rank (a spawned one imports it as __mp_main__).
        module = process_independent_name(frame.f_globals.get("__name__", ""))
        if module == BUILTIN_PLUGIN or module.startswith(f"{BUILTIN_PLUGIN}."):  # the builtins' own registrations
            return builtin_ref()
        if not module.startswith("pluginhost.") and module != "pluginhost":
            caller = caller or module
            owner = (
                owner_of_module(module, installed, prefer=prefer, file=frame.f_code.co_filename) if installed else None
            )
            if owner is not None:
                return PluginRef(owner.name, owner.distribution, owner.version)
        frame = frame.f_back
    return None if running is not None else PluginRef(name=caller or "<unknown>")


def _target_of(model: type | str) -> str:
    if isinstance(model, str):
        module, sep, qualname = model.partition(":")
        if not sep or not module.strip() or not qualname.strip():
            raise ValueError(f'{model!r} is not of the form "package.module:ClassName"')
        return f"{module.strip()}:{qualname.strip()}"
    if inspect.isclass(model):
        # A class of the script is __main__'s in every process: a spawned one imports it as __mp_main__.
        return f"{process_independent_name(model.__module__)}:{model.__qualname__}"
    raise ValueError(f"expected a class or a 'package.module:ClassName' string, got {type(model).__name__}")


class ArchitectureRegistry:
    """Architecture names mapped to model classes, with their provenance."""

    def __init__(self, *, log_replacements: bool = False) -> None:
        self._entries: dict[str, Registration] = {}
        self._resolved: dict[str, type] = {}
        # Only the registry an engine uses (``merged``) logs a replacement: once, not per registry it passed.
        self._log_replacements = log_replacements

    def register_model(self, architecture: str, model: type | str) -> None:
        """Register ``model`` (a class, or a lazy ``"package.module:ClassName"``) as ``architecture``.

        An existing entry of the same name is replaced, and the replacement
        logged; the same model registered again by the same source changes
        nothing.
        """
        self._add(architecture, model, _registering())

    def _add(self, architecture: str, model: type | str, source: PluginRef) -> None:
        if not isinstance(architecture, str) or not architecture.strip():
            raise RegistryError(
                f"register_model() got architecture {architecture!r}: "
                "it must be a non-empty string such as 'OPTForCausalLM'"
            )
        try:
            implementation = _target_of(model)
        except ValueError as exc:
            raise RegistryError(f"register_model({architecture!r}, ...) got a bad target: {exc}") from None
        model_class = model if inspect.isclass(model) else None
        previous = self._entries.get(architecture)
        if previous is not None and previous.same_as(implementation, model_class, source):
            return
        self._entries[architecture] = Registration(architecture, implementation, source, model_class, previous)
        self._resolved.pop(architecture, None)
        if previous is not None and self._log_replacements:
            # Two installed plugins claiming one name deserve a warning; overriding a builtin is what
            # registration is for, and is only logged.
            builtin = builtin_ref()
            conflict = all(r.distribution and r != builtin for r in (previous.registered_by, source))
            log = logger.warning if conflict else logger.info
            log(
                "architecture %r: %s (%s) replaces %s (%s)",
                architecture,
                implementation,
                source.describe(),
                previous.implementation,
                previous.registered_by.describe(),
            )

    @classmethod
    def merged(
        cls,
        sources: Iterable[tuple[Iterable[Registration], Callable[[Registration], int | None]]],
        *,
        log_replacements: bool = True,
    ) -> ArchitectureRegistry:
        """One registry replaying ``sources``: each is (current entries, ``place``), ``place`` giving an entry's rank.

        Every registration (each entry's whole history) that its source places (``None``: not
        applied) is replayed in that rank, stably: a plugin's registrations keep their own order,
        and of two plugins registering one name, the one ranked later wins, whether it used a hook,
        ``ModelRegistry`` directly or a ``register()`` function.
        """
        replay = [
            (rank, entry)
            for latest_entries, place in sources
            for latest in latest_entries
            for entry in reversed([latest, *latest.overrides])
            if (rank := place(entry)) is not None
        ]
        merged = cls(log_replacements=log_replacements)
        for _, entry in sorted(replay, key=lambda ranked: ranked[0]):
            merged._add(entry.architecture, entry.model_class or entry.implementation, entry.registered_by)
        return merged

    def get_supported_archs(self) -> list[str]:
        """Registered architecture names, sorted.

        The registry an engine's ``register_models`` hook is given lists, beside its own, what the
        engine applies from elsewhere (``collecting_into``'s ``listed``: register() functions, direct
        ``ModelRegistry`` calls), as ``ModelRegistry`` does there: a default registered only when
        absent must not replace an earlier plugin's model.
        """
        return sorted({*self._entries, *self._listed_beside()})

    def _listed_beside(self) -> Iterable[str]:
        collecting = _collecting.get()
        if collecting is None or collecting.registry is not self or collecting.listed is None:
            return ()
        return collecting.listed()

    def entries(self) -> list[Registration]:
        """All current entries, in registration order."""
        return list(self._entries.values())

    def get(self, architecture: str) -> Registration:
        """The entry for ``architecture``; an unknown name raises with close matches.

        Inside its hook, a name listed beside this registry's own (``get_supported_archs``) is answered
        as ``ModelRegistry`` answers it there.
        """
        try:
            return self._entries[architecture]
        except KeyError:
            if architecture in self._listed_beside():
                return ModelRegistry.get(architecture)
            raise UnknownArchitectureError(self._unknown_message(architecture)) from None

    def __contains__(self, architecture: object) -> bool:
        """Whether ``architecture`` is registered (inside its hook, listed: see ``get_supported_archs``)."""
        return architecture in self._entries or architecture in self._listed_beside()

    def _unknown_message(self, architecture: str) -> str:
        names = [name for name in self._entries if name != TRANSFORMERS_FALLBACK]
        base = architecture.removesuffix("Model")
        with_head = [n for n in names if base and architecture != base and n.startswith(base)]
        if with_head:  # OPTModel, GPT2Model: the model without its head, which generation needs
            hint = (
                f" {architecture} is a model without its language-modelling head, which generation needs; "
                f"the architecture with it is {with_head[0]!r} (--model-architecture-override {with_head[0]}, "
                "if the checkpoint holds the head's weights)."
            )
        else:
            close = difflib.get_close_matches(architecture, names, n=3, cutoff=0.7)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        return (
            f"Architecture {architecture!r} is not registered.{hint} "
            "Run `pluginhost models` to list every registered architecture; "
            f"a plugin can add one with registry.register_model().{_vllm_leftovers()}"
        )

    def resolve(self, architecture: str) -> type:
        """Import (if lazy) and check the model class of ``architecture``."""
        if architecture in self._resolved:
            return self._resolved[architecture]
        entry = self.get(architecture)
        cls = entry.model_class or _import_target(entry)
        _check_model_class(entry, cls)
        self._resolved[architecture] = cls
        return cls

    def snapshot(self) -> RegistrySnapshot:
        """The registry's entries now; ``restore`` brings them back (tests undo registrations with it)."""
        return RegistrySnapshot(MappingProxyType(dict(self._entries)))

    def restore(self, snapshot: RegistrySnapshot) -> None:
        """Put back the entries of ``snapshot``, forgetting every registration made since."""
        self._entries = dict(snapshot.entries)
        self._resolved.clear()


#: Where vLLM finds its general plugins, and its selection variable: pluginhost reads neither.
VLLM_PLUGIN_GROUP = "vllm.general_plugins"
VLLM_PLUGINS_ENV = "VLLM_PLUGINS"


def _vllm_leftovers() -> str:
    """`` ...``: vLLM general plugins installed and vLLM's selection variable set, which pluginhost ignores.

    Read from package metadata: nothing is imported (listing commands stay free of torch).
    """
    found = sorted(
        {
            f"{ep.name} = {ep.value} (distribution {ep.dist.metadata['Name'] if ep.dist else '?'})"
            for ep in metadata.entry_points(group=VLLM_PLUGIN_GROUP)
        }
    )
    hint = ""
    if found:
        hint += (
            f" Installed entry points in vLLM's group {VLLM_PLUGIN_GROUP}, which pluginhost does not read: "
            f"{'; '.join(found)}. If one registers this architecture, move it to the group {ENTRY_POINT_GROUP} "
            f'([project.entry-points."{ENTRY_POINT_GROUP}"], the same name and value) and reinstall it.'
        )
    if os.environ.get(VLLM_PLUGINS_ENV):
        hint += f" {VLLM_PLUGINS_ENV} is set but not read: pluginhost's selection is PLUGINHOST_PLUGINS."
    return hint


def _import_target(entry: Registration) -> type:
    module_name, _, qualname = entry.implementation.partition(":")
    where = f"architecture {entry.architecture!r} registered by {entry.registered_by.describe()}"
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelClassError(
            f"{where} points to {entry.implementation}, but module {module_name!r} failed to import: "
            f"{type(exc).__name__}: {exc}. {entry.registered_by.remedy()}"
        ) from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelClassError(
                f"{where} points to {entry.implementation}, but module {module_name!r} has no {qualname!r}. "
                f"{entry.registered_by.remedy()}"
            ) from None
    if not inspect.isclass(obj):
        raise ModelClassError(
            f"{where} points to {entry.implementation}, which is not a class. {entry.registered_by.remedy()}"
        )
    return obj


def _check_model_class(entry: Registration, cls: type) -> None:
    import torch  # only when a model is really about to be built

    where = (
        f"{entry.implementation} (architecture {entry.architecture!r}, registered by {entry.registered_by.describe()})"
    )
    if not issubclass(cls, torch.nn.Module):
        raise ModelClassError(f"{where} is not a torch.nn.Module subclass. {entry.registered_by.remedy()}")
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(cls, name, None))]
    if "forward" not in missing and cls.forward is torch.nn.Module.forward:
        missing.insert(0, "forward")
    if missing:
        raise ModelClassError(
            f"{where} does not implement {', '.join(missing)}: a model class needs "
            f"{', '.join(REQUIRED_METHODS)} (see builtin_models.opt.OPTForCausalLM). {entry.registered_by.remedy()}"
        )
    signature = _one_argument_problem(cls.__init__)
    if signature is not None:
        raise ModelClassError(
            f"{where} defines __init__{signature}, but pluginhost constructs a model with the Hugging Face config "
            f"alone, as {cls.__name__}(config) (vLLM v1's __init__(self, *, vllm_config, prefix='') does not port): "
            "take the config (a transformers PretrainedConfig) as the first parameter and give any other a default; "
            "see 'What does not port' in docs/porting-from-vllm.md. "
            f"{entry.registered_by.remedy()}"
        )
    signature = _one_argument_problem(cls.compute_logits)
    if signature is not None:
        raise ModelClassError(
            f"{where} defines compute_logits{signature}, but pluginhost calls compute_logits(hidden_states) with "
            "the hidden states alone (vLLM's older compute_logits(hidden_states, sampling_metadata) does not "
            "port): drop the other parameters or give them defaults. "
            f"{entry.registered_by.remedy()}"
        )
    # The engine calls the module, which calls forward; a class answering the call itself is its own judge.
    problem = _forward_problem(cls.forward) if cls.__call__ is torch.nn.Module.__call__ else None
    if problem is not None:
        signature, why = problem
        raise ModelClassError(
            f"{where} defines forward{signature}, but the engine calls the model as "
            f"model({', '.join(FORWARD_ARGUMENTS)}), four arguments by position: {why}. "
            f"Write forward{FORWARD_SIGNATURE} and pass all four on "
            "(super().forward(input_ids, positions, cache_rows, mask)); see 'What does not port' in "
            f"docs/porting-from-vllm.md. {entry.registered_by.remedy()}"
        )


def _forward_problem(forward: Callable[..., object]) -> tuple[str, str] | None:
    """``(signature, why)`` when the engine's call would not reach ``forward`` as meant, else ``None``.

    That is when it cannot bind ``FORWARD_ARGUMENTS`` by position (``*args`` forwarding can), or when
    the cache rows or the mask would land in a parameter named as vLLM's (``VLLM_FORWARD_PARAMETERS``):
    such a forward runs, drops them, and generates wrong tokens without an error.
    """
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return None
    try:
        bound = signature.bind(None, *FORWARD_ARGUMENTS)  # None stands for self
    except TypeError as exc:
        return _signature_text(signature), f"it cannot take them ({exc})"
    vllm = [name for name in bound.arguments if name in VLLM_FORWARD_PARAMETERS]
    if vllm:
        why = (
            f"the cache rows and the mask would arrive as {' and '.join(vllm)} (vLLM's forward(input_ids, positions, "
            "intermediate_tensors=None, inputs_embeds=None) does not port) and be lost, giving wrong tokens"
        )
        return _signature_text(signature), why
    return None


def _signature_text(signature: inspect.Signature) -> str:
    """The parameter names as written, without annotations or defaults: ``(self, *, vllm_config, prefix)``."""
    names, starred = [], False
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not starred:
            names.append("*")
        starred = starred or p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY)
        names.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return "(" + ", ".join(names) + ")"


def _one_argument_problem(method: Callable[..., object]) -> str | None:
    """The signature of ``method`` when it cannot be called with one positional argument (besides ``self``)."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return None
    params = list(signature.parameters.values())[1:]  # drop self
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes_one = any(p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    required = [
        p for p in params if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if takes_one and len(required) <= 1 and all(p.kind in positional for p in required):
        return None
    return _signature_text(signature)


@dataclass(frozen=True)
class _Collecting:
    registry: ArchitectureRegistry
    #: The other architectures the engine applies (``None``: every registration in the process).
    listed: Callable[[], Iterable[str]] | None


# Set while an engine runs its register_models hook or a plugin's register() function: the
# process-wide registry forwards registrations into that registry.
_collecting: ContextVar[_Collecting | None] = ContextVar("pluginhost_collecting", default=None)


@contextmanager
def collecting_into(
    registry: ArchitectureRegistry, *, listed: Callable[[], Iterable[str]] | None = None
) -> Iterator[None]:
    """Route ``ModelRegistry.register_model`` calls into ``registry`` inside the block.

    ``listed``: the other architectures the engine being built applies. Inside the block,
    ``ModelRegistry.get_supported_archs()`` lists them and ``registry``'s, no more: a vLLM guard
    (``if arch not in ...get_supported_archs()``) must not skip a registration because of one
    that this engine will not apply. Without it, every registration in the process is listed.
    """
    token = _collecting.set(_Collecting(registry, listed))
    try:
        yield
    finally:
        _collecting.reset(token)


class _ProcessRegistry(ArchitectureRegistry):
    """The process-wide default registry (see the module docstring).

    It holds the registrations made directly through it, and lists beside them the
    ``record``-ed calls of plugins' ``register()`` functions (kept by the host, which
    replays each to the engines loading its plugin).
    """

    def __init__(self) -> None:
        super().__init__()
        self._seeded = False
        self._recorded: tuple[ArchitectureRegistry, ...] = ()
        # Which registrations it lists and answers for (``showing_only``); the engines' own rules are unchanged.
        self._shown: Callable[[Registration], bool] | None = None
        # The script's registrations made under `if __name__ == "__main__":`, and where (``made_under_main_guard``).
        self._under_main_guard: list[tuple[Registration, int]] = []

    def _seed(self) -> None:
        # The builtins, registered through the builtin plugin's own hook, on first use
        # (not at import: pluginhost's version is not known yet while it is imported).
        # Into this registry, even when first used inside an engine's collection.
        if not self._seeded:
            self._seeded = True
            import builtin_models
            from pluginhost.attribution import acting_as

            token = _collecting.set(None)
            try:
                with acting_as(builtin_ref()):
                    builtin_models.register_models(self)
            finally:
                _collecting.reset(token)

    def register_model(self, architecture: str, model: type | str) -> None:
        source = _registering()
        collecting = _collecting.get()
        if collecting is not None:
            collecting.registry._add(architecture, model, source)
            return
        self._seed()
        self._add(architecture, model, source)
        line = run_only_under_main_guard(sys._getframe(1)) if source.name == "__main__" else None
        if line is not None:  # made in this process only: a spawned rank imports the script without the block
            self._under_main_guard.append((self._entries[architecture], line))

    def made_under_main_guard(self) -> list[tuple[Registration, int]]:
        """Current registrations the script made in its ``if __name__ == "__main__":`` block, with the line."""
        held = {id(entry) for latest in self._entries.values() for entry in (latest, *latest.overrides)}
        return [(entry, line) for entry, line in self._under_main_guard if id(entry) in held]

    def record(self, registrations: ArchitectureRegistry) -> None:
        """List ``registrations`` (what a plugin's one ``register()`` call made) from now on (listed, not applied)."""
        if all(r is not registrations for r in self._recorded):
            self._recorded += (registrations,)
            self._resolved.clear()

    def recorded(self) -> tuple[ArchitectureRegistry, ...]:
        """The ``record``-ed registries, oldest first."""
        return self._recorded

    def direct_entries(self) -> list[Registration]:
        """The entries registered through this registry itself (the builtins among them), not recorded ones."""
        self._seed()
        return super().entries()

    @contextmanager
    def showing_only(self, shown: Callable[[Registration], bool]) -> Iterator[None]:
        """Inside the block, list and answer for the registrations ``shown`` accepts, as if they were all.

        The test kit shows what its engines apply: a test's vLLM-style guard then decides as
        those engines would. What an engine applies does not change.
        """
        previous, self._shown = self._shown, shown
        self._resolved.clear()
        try:
            yield
        finally:
            self._shown = previous
            self._resolved.clear()

    def _filtered(self) -> bool:
        return bool(self._recorded) or self._shown is not None

    def _everything(self) -> ArchitectureRegistry:
        """Direct and recorded registrations (those shown) as one registry, a recorded one replacing a direct one."""
        shown = self._shown or (lambda entry: True)

        def at(rank: int) -> Callable[[Registration], int | None]:
            return lambda entry: rank if shown(entry) else None

        sources = [(self.direct_entries(), at(0))]
        sources += [(r.entries(), at(i)) for i, r in enumerate(self._recorded, 1)]
        return ArchitectureRegistry.merged(sources, log_replacements=False)

    def get_supported_archs(self) -> list[str]:
        """The builtin architectures and every registration made so far; inside an engine, what it applies."""
        self._seed()
        collecting = _collecting.get()
        if collecting is not None and collecting.listed is not None:
            return sorted({*collecting.listed(), *collecting.registry.get_supported_archs()})
        extra = collecting.registry.get_supported_archs() if collecting is not None else []
        own = self._everything().get_supported_archs() if self._filtered() else self._entries
        return sorted({*own, *extra})

    def entries(self) -> list[Registration]:
        return self._everything().entries() if self._filtered() else self.direct_entries()

    def get(self, architecture: str) -> Registration:
        self._seed()
        return self._everything().get(architecture) if self._filtered() else super().get(architecture)

    def __contains__(self, architecture: object) -> bool:
        if _collecting.get() is not None:  # inside an engine: what it lists, as get_supported_archs() does
            return architecture in self.get_supported_archs()
        self._seed()
        if self._shown is not None:
            return architecture in self._everything()
        return super().__contains__(architecture) or any(architecture in r for r in self._recorded)

    def snapshot(self) -> RegistrySnapshot:
        self._seed()
        return RegistrySnapshot(MappingProxyType(dict(self._entries)), self._recorded)

    def restore(self, snapshot: RegistrySnapshot) -> None:
        """Put back the entries and the recorded calls of ``snapshot`` (the host still replays forgotten calls)."""
        super().restore(snapshot)
        self._recorded = snapshot.recorded


#: The process-wide default registry (``from pluginhost import ModelRegistry``).
ModelRegistry: _ProcessRegistry = _ProcessRegistry()
