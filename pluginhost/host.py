"""The plugin host: one pluggy ``PluginManager`` per engine, and the plugins in it.

Loading, in order:

1. ``builtin_models`` (always; it registers the builtin architectures);
2. installed plugins (entry-point group ``pluginhost.plugins``), sorted by
   name, filtered by the selection (blocked ones go through ``set_blocked``),
   each imported with its import time measured;
3. in-process plugin objects, in the order given.

A plugin is a module or object holding hook implementations, or a function
taking no arguments (vLLM's ``register()`` shape). Anything else, holding no
hook implementation, is a broken plugin. A function is called once per
process, as vLLM calls its general plugins (a second call would patch what the
first patched again), acting as its plugin: what it registers through
``ModelRegistry`` is attributed to it and kept with the call, and every engine
that loads that function, installed or in-process, applies it in the plugin's
place; engines that do not load it never do.

Each plugin is checked when it is registered: pluggy's own argument check at
``register``, ``check_pending`` for unknown hooks, and the one check pluggy
does not make (parameters with defaults, which pluggy would silently never
pass). Everything else pluggy offers works as in pluggy: ``tryfirst``,
``trylast``, ``specname``, and wrappers (``wrapper=True``).

Plugins are registered in reverse of the order above, because pluggy calls
the most recently registered implementation first: hooks therefore run
builtin, installed (by name), in-process (as given), and a later plugin
overrides an earlier one. The host remembers which plugin owns each hook
implementation (``HookOwners``) and dispatches through pluggy untouched: an
exception is traced back to the plugin and hook that raised it, config
changes record ``plugin:NAME`` and registrations record the plugin,
distribution and version (see ``pluginhost.attribution``).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pluggy

import hookspecs
from pluginhost import distributed
from pluginhost.attribution import (
    HookOwners,
    PluginRef,
    acting_as,
    end_dispatch,
    start_dispatch,
)
from pluginhost.discovery import InstalledPlugin, discover_installed
from pluginhost.envflags import env_flag
from pluginhost.errors import (
    ConfigError,
    PluginError,
    PluginHookError,
    PluginLoadError,
    PluginSelectionError,
    RequestRefusedError,
)
from pluginhost.plugin_names import import_by_name, importable_name, in_process_name, type_name
from pluginhost.registry import (
    BUILTIN_PLUGIN,
    ArchitectureRegistry,
    ModelRegistry,
    Registration,
    RegistrySnapshot,
    builtin_ref,
    collecting_into,
)
from pluginhost.selection import SKIP_BROKEN_ENV, PluginSelection, normalize_name

if TYPE_CHECKING:
    from pluginhost.logits_processors import LogitsProcessorRegistry

__all__ = ["BUILTIN_PLUGIN", "REGISTER_FUNCTION_HOOK", "PluginHost", "PluginRecord"]

logger = logging.getLogger(__name__)

#: What ``PluginRecord.hooks`` lists for a plugin that is a ``register()`` function.
REGISTER_FUNCTION_HOOK = "register"

Kind = Literal["builtin", "installed", "in-process"]
Status = Literal["builtin", "loaded", "blocked", "failed"]


@dataclass(frozen=True)
class PluginRecord:
    """What the host knows about one plugin, loaded or not."""

    name: str
    kind: Kind
    status: Status
    distribution: str | None = None
    version: str | None = None
    #: Hooks the plugin implements (or tried to, when it failed validation).
    hooks: tuple[str, ...] = ()
    #: Why it is blocked or failed.
    reason: str | None = None
    #: Seconds its import took (installed plugins that were imported).
    import_seconds: float | None = None
    #: The entry point's target, for installed plugins.
    target: str | None = None

    @property
    def ref(self) -> PluginRef:
        return PluginRef(self.name, self.distribution, self.version)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"hooks": list(self.hooks)}


def _remedy(record: PluginRecord, *, broken: bool = False, by_distribution: bool = False) -> str:
    """What the user can do; ``broken`` (failed to load) adds the skip-broken switch."""
    if record.kind == "in-process":
        return "Fix it, or leave it out of LLM(plugins=...)."
    skip = f" Or set {SKIP_BROKEN_ENV}=1 to skip broken plugins." if broken else ""
    return record.ref.remedy(by_distribution=by_distribution) + skip


@dataclass(frozen=True)
class _Call:
    """The one call of a ``register()`` function in this process: what it registered, or why it failed."""

    registrations: ArchitectureRegistry
    failure: str | None
    seconds: float
    #: Made as an in-process plugin: what it registered belongs to the engines passing the function.
    in_process: bool = False


# Each register() function's call that succeeded, by function: made by the first load that needs it, replayed
# by the others. One that failed is not kept: the next load calls it again (the cause may have been fixed since).
_CALLS: dict[object, _Call] = {}
_CALLS_LOCK = threading.RLock()  # two engines built at once in two threads call a function once


@dataclass(frozen=True)
class _Impl:
    hook: str
    function: Any


def _hookimpls_of(pm: pluggy.PluginManager, plugin: object) -> list[_Impl]:
    """Every hookimpl-marked function of ``plugin``, with the hook it implements."""
    found = []
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is not None:
            found.append(_Impl(opts.get("specname") or attr, getattr(plugin, attr)))
    return found


def _unmarked_hooks(pm: pluggy.PluginManager, record: PluginRecord, plugin: object, impls: list[_Impl]) -> list[str]:
    """Warnings for functions of ``plugin`` named as a hook it does not implement, but not marked ``@hookimpl``.

    pluggy registers marked functions only: a forgotten marker beside other hooks loads fine and the
    function never runs. Only a plugin with other hook implementations is looked at (one with none is
    already refused), and only hooks it does not implement otherwise (``specname``).
    """
    implemented = {impl.hook for impl in impls}
    names = set(dir(plugin))  # what pluggy looks at: never a lazy module __getattr__ (PEP 562), which may import
    warnings = []
    for name in sorted(dir(pm.hook)):
        caller = getattr(pm.hook, name, None)
        if name.startswith("_") or name in implemented or not getattr(caller, "has_spec", lambda: False)():
            continue
        if name not in names:
            continue
        try:
            function = getattr(plugin, name, None)
        except Exception:  # noqa: BLE001 - a plugin's attribute may raise anything; pluggy skips it too
            continue
        if callable(function) and pm.parse_hookimpl_opts(plugin, name) is None:
            warnings.append(
                f"{record.ref.describe()}: {name}() is named as the hook {_spec_signature(pm, name)} but is not "
                "marked with @hookimpl, so it is never called: add @hookimpl above it (or rename it)"
            )
    return warnings


def _methods_needing_an_instance(pm: pluggy.PluginManager, cls: type) -> list[str]:
    """The hook implementations of a class that are plain methods (pluggy would call them without ``self``)."""
    return sorted(
        attr
        for attr in dir(cls)
        if pm.parse_hookimpl_opts(cls, attr) is not None and inspect.isfunction(inspect.getattr_static(cls, attr, None))
    )


def _spec_signature(pm: pluggy.PluginManager, hook: str) -> str:
    caller = getattr(pm.hook, hook)
    return f"{hook}({', '.join(caller.spec.argnames)})"


class PluginHost:
    """The plugins of one engine, and the way to call their hooks.

    Nothing is loaded until ``load()``; loading again is a no-op.
    """

    def __init__(
        self,
        *,
        plugins: Sequence[object] = (),
        load_installed: bool = True,
        selection: PluginSelection | None = None,
        skip_broken: bool | None = None,
        apply_registrations_since: RegistrySnapshot | None = None,
    ) -> None:
        """``apply_registrations_since``: also apply what ``ModelRegistry`` gained since that snapshot, whoever's
        code registered it (the test kit's engines: what the test registered itself, as vLLM tests do)."""
        self._in_process = _checked_in_process(plugins)
        self._passed: set[tuple[str, str | None]] | None = None  # _passed_in_process, once read
        self._installed_names: set[str] = set()  # every installed plugin's name, loaded or not
        self._load_installed = load_installed
        self._selection = selection
        self._skip_broken = skip_broken
        self._pm: pluggy.PluginManager | None = None
        self._records: list[PluginRecord] = []
        self._owners = HookOwners()
        self._warned_returns: set[str] = set()
        # The register() functions this host loads: the plugin each is loaded as, and its call.
        self._calls: list[tuple[PluginRef, _Call]] = []
        self._kit_snapshot = apply_registrations_since
        self._selection_used: PluginSelection | None = None  # the selection the installed plugins were loaded with
        # record_stats: the caller without the plugins whose implementation raised.
        self._stats_caller: Any = None
        self._stats_dropped: list[object] = []
        #: (rank, world size) of the engine this host builds, set by it: what ``pluginhost.distributed`` tells
        #: this host's hooks (``None``: the process's value).
        self.ranks: tuple[int, int] | None = None

    # -- other processes (tensor-parallel ranks) -------------------------------

    def replica_args(self) -> dict[str, Any]:
        """Picklable arguments that build an equal host in another process (``from_replica_args``).

        That process loads its plugins itself: installed ones with this host's
        selection, in-process ones by importable name. An in-process plugin
        that has no such name is a ``ConfigError`` saying what would work.
        """
        plugins = [importable_name(i, plugin) for i, plugin in enumerate(self._in_process)]
        self._check_script_registrations()
        return {
            "plugins": plugins,
            "plugin_types": [type_name(plugin) for plugin in self._in_process],
            "load_installed": self._load_installed,
            "selection": self._selection or PluginSelection.from_env(),
            "skip_broken": self._skip_broken,
        }

    def _check_script_registrations(self) -> None:
        """A ``ConfigError`` for a registration this engine applies that the script made under its main guard.

        The other ranks import the script without running that block: the architecture would be
        missing there ("not registered" on rank 1). Under torchrun every rank runs the whole script.
        """
        if distributed.torchrun_rank() is not None:
            return
        for entry, line in ModelRegistry.made_under_main_guard():
            if self._applies_directly(entry):
                raise ConfigError(
                    f"architecture {entry.architecture!r} is registered inside the script's `if __name__ == "
                    f'"__main__":` block (line {line}), which the other processes of a tensor-parallel engine do '
                    "not run when they import the script: register it above that block, at the top level."
                )

    @classmethod
    def from_replica_args(cls, args: dict[str, Any]) -> PluginHost:
        """The host ``replica_args`` describes; importing the in-process plugins (any error is theirs)."""
        plugins = [import_by_name(name) for name in args["plugins"]]
        for name, plugin, expected in zip(args["plugins"], plugins, args["plugin_types"], strict=True):
            if type_name(plugin) != expected:  # rebound at run time: this rank imported what the top level made
                raise ConfigError(
                    f"in-process plugin {name} is {plugin!r:.80} where this rank imports it, but a {expected} in the "
                    "process that started the ranks: the script binds the name at run time (in a function, with "
                    "`global`, or under its main guard), and the other ranks import the script, getting what its "
                    "top level binds. Make the plugin where its module's top level makes it."
                )
        return cls(
            plugins=plugins,
            load_installed=args["load_installed"],
            selection=args["selection"],
            skip_broken=args["skip_broken"],
        )

    # -- loading ---------------------------------------------------------------

    @property
    def records(self) -> list[PluginRecord]:
        """Every plugin the host considered, in hook call order."""
        return list(self._records)

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        """The underlying pluggy manager (loads plugins on first use)."""
        if self._pm is None:
            self.load()
        assert self._pm is not None
        return self._pm

    def load(self, *, strict: bool = True) -> list[PluginRecord]:
        """Import, check and register every selected plugin; idempotent.

        ``strict`` (engines): a broken installed plugin raises ``PluginLoadError``
        unless ``PLUGINHOST_SKIP_BROKEN_PLUGINS=1``. Not strict (listings): it is
        only recorded with status ``failed``. A broken in-process plugin always
        raises, and so does an allow-list naming nothing installed.
        """
        # Read first: a malformed switch is an error whether or not a plugin is broken.
        skip = strict and (self._skip_broken if self._skip_broken is not None else env_flag(SKIP_BROKEN_ENV))
        if self._pm is None:
            self._pm = self._load()
        failed = [r for r in self._records if r.status == "failed"]
        if failed and strict:
            if not skip:
                raise PluginLoadError("\n".join(self._failure_message(r) for r in failed))
            for record in failed:
                logger.warning("skipping broken %s: %s", record.ref.describe(), record.reason)
        return self.records

    def left_out_message(self) -> str | None:
        """For an unknown architecture's error: the installed plugins the selection left out, one of which may
        register it; ``None`` when it left none out.

        Plugins an empty allow-list left out all at once (``--no-plugins``, ``PLUGINHOST_PLUGINS=""``) are
        counted, not listed (that is every installed plugin, each with the same reason; ``pluginhost plugins``
        lists them). Those an allow-list or a deny-list left out are listed by name, with the decision.
        """
        blocked = [r for r in self._records if r.status == "blocked"]
        if not blocked:
            return None
        selection = self._selection_used
        switch, source = None, ""
        if selection is not None and selection.allow == ():
            switch, source = selection.none_allowed_reason, selection.allow_source
        counted = [r for r in blocked if r.reason == switch]
        if len(counted) < 2:  # one is named like the others
            counted = []
        named = [f"{r.name} ({r.distribution}: {r.reason})" for r in blocked if r not in counted]
        if counted:
            summary = f"{len(counted)} installed plugins were left out by {source}"
            if not named:
                return f"{summary}, one of which may register it (see `pluginhost plugins`)."
            named.insert(0, f"{summary} (see `pluginhost plugins`)")
        return f"Installed plugins left out by the selection, one of which may register it: {', '.join(named)}."

    def _failure_message(self, record: PluginRecord) -> str:
        # Two plugins of one name: only the distribution name tells them apart on the command line.
        shared = any(r.name == record.name and r is not record for r in self._records)
        remedy = _remedy(record, broken=True, by_distribution=shared)
        return f"Cannot start: {record.ref.describe()} is broken: {record.reason}. {remedy}"

    def _load(self) -> pluggy.PluginManager:
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        import builtin_models

        builtin = builtin_ref()
        records: list[tuple[PluginRecord, object | None]] = [
            (PluginRecord(BUILTIN_PLUGIN, "builtin", "builtin", builtin.distribution, builtin.version), builtin_models)
        ]
        if self._load_installed:
            records += self._import_installed(pm)
        twins: set[str] = set()  # installed plugins also passed in-process: loaded once, as installed
        records += self._in_process_records({id(p): record for record, p in records if p is not None}, twins)
        # The records so far: a guarded register() sees the installed plugins loaded beside it (``_active``).
        self._records = [record for record, _ in records]
        # register() functions run once per process, as their plugin, in hook call order (replayed after that).
        records = [self._run_if_function_safely(pm, record, plugin) for record, plugin in records]

        # pluggy calls the last registered first: register in reverse call order.
        registered = [
            self._register_safely(pm, record, plugin) if plugin is not None else record
            for record, plugin in reversed(records)
        ]
        self._records = registered[::-1]
        for record in self._records:
            if (record.kind == "in-process" or record.name in twins) and record.status == "failed":
                raise PluginError(f"{record.ref.describe()} is broken: {record.reason}. {_remedy(record)}")
        return pm

    def _import_installed(self, pm: pluggy.PluginManager) -> list[tuple[PluginRecord, object | None]]:
        installed = discover_installed()
        self._installed_names = {p.name for p in installed}
        selection = self._selection or PluginSelection.from_env()
        self._selection_used = selection
        builtin_name = normalize_name(BUILTIN_PLUGIN)
        if builtin_name in selection.deny:
            raise PluginSelectionError(
                f"{selection.deny[builtin_name]} names {BUILTIN_PLUGIN!r}, pluginhost's own builtin architectures, "
                "which cannot be disabled. To replace a builtin architecture, register your own under the same "
                "name from a plugin (it overrides the builtin); to skip installed plugins, use --no-plugins."
            )
        pairs = [(p.name, p.distribution) for p in installed]
        # The builtins always load: naming them in an allow-list is not a mistake.
        unmatched = [n for n in selection.unmatched_allowed(pairs) if normalize_name(n) != builtin_name]
        if unmatched:
            names = ", ".join(f"{p.name} ({p.distribution})" for p in installed) or "none"
            raise PluginSelectionError(
                f"{selection.allow_source} names {', '.join(map(repr, unmatched))}, which matches no installed "
                f"plugin. Installed plugins: {names}. Names are entry-point or distribution names."
            )
        for name in selection.unmatched_denied(pairs):
            source = selection.deny[normalize_name(name)]
            logger.warning("%r is disabled (%s) but no installed plugin has that name", name, source)

        out: list[tuple[PluginRecord, object | None]] = []
        decisions = [selection.decide(p.name, p.distribution) for p in installed]
        selected_names = {p.name for p, blocked in zip(installed, decisions, strict=True) if not blocked}
        seen: dict[str, InstalledPlugin] = {}
        for plugin, blocked in zip(installed, decisions, strict=True):
            base = PluginRecord(
                plugin.name, "installed", "loaded", plugin.distribution, plugin.version, target=plugin.value
            )
            if blocked:  # a blocked plugin takes no name: it cannot clash with one that loads
                if plugin.name not in selected_names and plugin.name != BUILTIN_PLUGIN:
                    pm.set_blocked(plugin.name)
                out.append((replace(base, status="blocked", reason=blocked), None))
                continue
            if plugin.name == BUILTIN_PLUGIN or plugin.name in seen:
                other = seen.get(plugin.name)
                owner = f"distribution {other.distribution}" if other else "pluginhost itself"
                reason = f"the plugin name {plugin.name!r} is already taken by {owner}; rename the entry point"
                out.append((replace(base, status="failed", reason=reason), None))
                continue
            seen[plugin.name] = plugin
            malformed = _malformed_target(plugin.value)
            if malformed is not None:
                out.append((replace(base, status="failed", reason=malformed), None))
                continue
            start = time.perf_counter()
            try:
                with acting_as(base.ref):
                    obj = plugin.entry_point.load()
            except BaseException as exc:  # noqa: BLE001 - a plugin's import may raise anything
                if isinstance(exc, KeyboardInterrupt):
                    raise
                where = _raised_at(exc, plugin.value.partition(":")[0])
                reason = f"import of {plugin.value} failed: {_describe_exception(exc)}{where}"
                out.append((replace(base, status="failed", reason=reason, import_seconds=_since(start)), None))
                continue
            out.append((replace(base, import_seconds=_since(start)), obj))
        return out

    def _run_if_function_safely(
        self, pm: pluggy.PluginManager, record: PluginRecord, plugin: object | None
    ) -> tuple[PluginRecord, object | None]:
        """``_run_if_function``; a plugin object that raises when inspected (its ``dir()``, an attribute) failed."""
        try:
            return self._run_if_function(pm, record, plugin)
        except Exception as exc:  # noqa: BLE001 - a plugin object's __dir__ or __getattr__ may raise anything
            return _uninspectable(record, exc), None

    def _register_safely(self, pm: pluggy.PluginManager, record: PluginRecord, plugin: object) -> PluginRecord:
        """``_register``; a plugin object that raises when inspected failed, and nothing of it stays registered."""
        try:
            return self._register(pm, record, plugin)
        except Exception as exc:  # noqa: BLE001 - a plugin object's __dir__ or __getattr__ may raise anything
            if pm.get_plugin(record.name) is plugin:  # pluggy takes the name before it reads the object
                pm.unregister(plugin, name=record.name)
            return _uninspectable(record, exc)

    def _run_if_function(
        self, pm: pluggy.PluginManager, record: PluginRecord, plugin: object | None
    ) -> tuple[PluginRecord, object | None]:
        """Call a ``register()``-function plugin (once per process); refuse a plugin with no hook implementation.

        What the function registered applies to this host, in the plugin's place, and to
        every later host loading the same function, which does not call it again. Every call
        is listed by ``ModelRegistry`` (process-wide, as in vLLM); an installed plugin's
        applies where that plugin is selected, an in-process plugin's only to the engines
        passing it, like everything else they pass. Returns the record and what is left to
        register with pluggy (``None`` for a function plugin, which has no hooks, or a failed one).
        """
        if plugin is None:
            return record, plugin
        if inspect.isclass(plugin):
            methods = _methods_needing_an_instance(pm, plugin)
            if methods:
                name = plugin.__name__
                reason = (
                    f"{f'{record.target} is' if record.target else 'it is'} the class {name}, whose hook "
                    f"implementations ({', '.join(methods)}) are methods: register an instance of it "
                    f"(LLM(plugins=[{name}()]); an entry point names a module-level instance, such as "
                    f"`plugin = {name}()`)"
                )
                return replace(record, status="failed", reason=reason), None
        impls = _hookimpls_of(pm, plugin)
        if impls:
            for warning in [self._uncalled_register(record, plugin), *_unmarked_hooks(pm, record, plugin, impls)]:
                if warning is not None:
                    logger.warning("%s", warning)
            return record, plugin
        if not inspect.isroutine(plugin):
            target = record.target or record.name
            if inspect.isclass(plugin) and _is_logits_processor(plugin):
                where = "a module the entry point names" if record.kind == "installed" else "a plugin passed instead"
                reason = (
                    f"{target} is the logits processor class {plugin.__name__}, not a plugin: add it from a "
                    f"register_logits_processors hook (registry.add(...)) in {where}, as "
                    "docs/porting-from-vllm.md shows for vLLM's logits processors"
                )
                return replace(record, status="failed", reason=reason), None
            what = (
                "a module"
                if inspect.ismodule(plugin)
                else f"the class {plugin.__name__}"
                if inspect.isclass(plugin)
                else f"an instance of {type(plugin).__name__}"
            )
            reason = (
                f"{target} is {what} that holds no hook implementation: mark its functions "
                "with @hookimpl, or point the entry point at a function taking no arguments that does the "
                "registering (vLLM's register() shape)"
            )
            return replace(record, status="failed", reason=reason), None
        function = getattr(plugin, "__qualname__", repr(plugin))
        if inspect.iscoroutinefunction(plugin) or inspect.isasyncgenfunction(plugin):
            reason = f"its register function {function}() is async: plugin functions are called, not awaited; use def"
            return replace(record, status="failed", reason=reason), None
        required = _required_parameters(plugin)
        if required:
            reason = (
                f"its register function {function}() takes argument(s) {', '.join(required)}; a plugin function "
                "is called with none (mark hook implementations with @hookimpl instead)"
            )
            return replace(record, status="failed", reason=reason), None
        with _CALLS_LOCK:
            call = _CALLS.get(plugin)
            if call is None:
                call = self._call(record, plugin, function)
                if call.failure is None:
                    _CALLS[plugin] = call
        if call.failure is not None:
            return replace(record, status="failed", reason=call.failure), None
        self._calls.append((record.ref, call))
        ModelRegistry.record(call.registrations)  # listed, whoever made it; applied as ``_merged`` says
        seconds = (record.import_seconds or 0.0) + call.seconds
        return replace(record, hooks=(REGISTER_FUNCTION_HOOK,), import_seconds=round(seconds, 6)), None

    def _uncalled_register(self, record: PluginRecord, module: object) -> str | None:
        """The warning for a module plugin with hook implementations and a ``register()`` that nothing calls.

        The host calls a ``register()`` function only when it is the plugin (an entry point
        ``name = "pkg:register"``, or the function passed in-process); a module plugin's hooks run,
        its ``register()`` would be skipped without a word, and its architectures missing later.
        """
        if not inspect.ismodule(module):
            return None
        register = vars(module).get("register")  # not getattr: a lazy module __getattr__ (PEP 562) may import
        if not inspect.isfunction(register) or _required_parameters(register):
            return None
        target = f"{module.__name__}:register"
        # Defined here, or imported from the module an entry point names (``from .models import register``).
        names = {target, f"{register.__module__}:{register.__qualname__}"}
        if any(p is register for p in self._in_process) or any(
            p.value.replace(" ", "") in names for p in discover_installed()
        ):
            return None  # loaded as a plugin of its own (if selected)
        if record.kind == "installed":
            fix = f'add an entry point for it beside this one, such as {record.name}_register = "{target}"'
        else:
            fix = f"pass it too: plugins=[{module.__name__}, {module.__name__}.register]"
        return (
            f"{record.ref.describe()}: module {module.__name__} has a register() function besides its hook "
            "implementations, and pluginhost does not call register() for a module plugin (only for a plugin "
            f"that is the function itself): {fix}"
        )

    def _call(self, record: PluginRecord, plugin: Any, function: str) -> _Call:
        """Call ``plugin()`` as ``record``'s plugin, its registrations kept apart; the process's one call of it."""
        registrations = ArchitectureRegistry()
        start = time.perf_counter()
        try:
            with acting_as(record.ref), collecting_into(registrations, listed=self._applied_architectures):
                plugin()
        except BaseException as exc:  # noqa: BLE001 - a plugin's code may raise anything
            if isinstance(exc, KeyboardInterrupt):
                raise
            return _Call(registrations, f"its register function {function}() failed: {_describe_exception(exc)}", 0.0)
        return _Call(registrations, None, _since(start), in_process=record.kind == "in-process")

    @property
    def _active(self) -> set[tuple[str, str | None]]:
        """(name, distribution) of the installed plugins loaded: their direct ModelRegistry registrations apply."""
        return {(r.name, r.distribution) for r in self._records if r.kind == "installed" and r.status == "loaded"}

    def _applies_directly(self, entry: Registration) -> bool:
        """Whether a registration made directly through ``ModelRegistry`` applies here (builtins come by hook).

        An installed plugin's code's applies where the plugin is loaded, or its entry point's object is passed
        in-process (``plugins=[register]``, the plugin not loaded): a script that called ``register()`` itself
        first had it register everything, and the engine's call of it, under vLLM's guard, nothing.
        """
        ref = entry.registered_by
        if self._kit_snapshot is not None and not self._kit_snapshot.holds(entry):
            return True
        return ref.distribution is None or (ref.name, ref.distribution) in self._active | self._passed_in_process()

    def _passed_in_process(self) -> set[tuple[str, str | None]]:
        """The installed plugins (name, distribution) whose entry point's object is passed in-process here."""
        if self._passed is None:
            installed = discover_installed() if self._in_process else []
            self._passed = {
                (p.name, p.distribution)
                for p in installed
                if any(plugin is _imported_target(p.value) for plugin in self._in_process)
            }
        return self._passed

    def _recorded_since(self) -> list[ArchitectureRegistry]:
        """Installed plugins' calls ``ModelRegistry`` lists since ``apply_registrations_since`` (that this host does
        not replay itself). An in-process plugin's call stays with the engines passing it."""
        if self._kit_snapshot is None:
            return []
        with _CALLS_LOCK:
            in_process = [call.registrations for call in _CALLS.values() if call.in_process]
        skipped = [call.registrations for _, call in self._calls] + in_process
        return [
            r
            for r in ModelRegistry.recorded()
            if all(r is not held for held in self._kit_snapshot.recorded) and all(r is not s for s in skipped)
        ]

    def _applied_architectures(self) -> set[str]:
        """The architectures this engine applies so far: what ``get_supported_archs()`` lists inside its plugins."""
        builtin = builtin_ref()
        names = {
            entry.architecture
            for latest in ModelRegistry.direct_entries()
            for entry in (latest, *latest.overrides)
            if entry.registered_by == builtin or self._applies_directly(entry)
        }
        for registrations in [call.registrations for _, call in self._calls] + self._recorded_since():
            names.update(registrations.get_supported_archs())
        return names

    def _in_process_records(
        self, already: dict[int, PluginRecord], twins: set[str]
    ) -> list[tuple[PluginRecord, object | None]]:
        """Records of the in-process plugins; one that is an installed plugin loaded here (``already``) is skipped.

        ``LLM(path, plugins=[pluginhost_int8_quant])`` with that package installed and selected passes the
        module the entry point loaded: it is registered (or its ``register()`` run) once, as the installed plugin,
        and its name goes into ``twins``: broken, it stops the engine as a broken in-process plugin does.
        """
        out: list[tuple[PluginRecord, object | None]] = []
        # Installed plugins' names are theirs (a blocked one's too: pluggy ignores a blocked name's plugins).
        names: set[str] = {BUILTIN_PLUGIN, *self._installed_names}
        for plugin in self._in_process:
            twin = already.get(id(plugin))
            if twin is not None:
                logger.info("%s is loaded once, as the installed %s", in_process_name(plugin), twin.ref.describe())
                twins.add(twin.name)
                continue
            base = in_process_name(plugin)
            if base in self._installed_names and base != BUILTIN_PLUGIN:
                base = f"{base} (in-process)"  # beside the installed plugin of that name
            name, n = base, 1
            while name in names:
                n += 1
                name = f"{base}#{n}"
            names.add(name)
            out.append((PluginRecord(name, "in-process", "loaded"), plugin))
        return out

    def _register(self, pm: pluggy.PluginManager, record: PluginRecord, plugin: object) -> PluginRecord:
        impls = _hookimpls_of(pm, plugin)
        record = replace(record, hooks=tuple(sorted({impl.hook for impl in impls})))
        problem = _signature_problem(pm, impls)
        if problem is not None:
            return replace(record, status="failed", reason=problem)
        try:
            if pm.register(plugin, name=record.name) is None:  # pluggy's answer for a blocked name
                return replace(record, status="failed", reason=f"the plugin name {record.name!r} is blocked")
        except pluggy.PluginValidationError as exc:
            problem = self._describe_mismatch(pm, impls) or str(exc).replace("\n", "; ")
            if pm.get_plugin(record.name) is plugin:
                # pluggy < 1.7 leaves a plugin failing validation half-registered: its
                # implementations checked before the failing one would still run.
                pm.unregister(plugin, name=record.name)
        except ValueError as exc:  # the same object registered twice
            other = pm.get_name(plugin)
            problem = (
                f"it is the object plugin {other!r} already is (two entry points, or the same object passed "
                "twice, name it): keep one"
                if other is not None
                else str(exc).splitlines()[0]
            )
        else:
            problem = self._check_after(pm, plugin, impls)
            if problem is not None:
                pm.unregister(plugin, name=record.name)
        if problem is not None:
            return replace(record, status="failed", reason=problem)
        for impl in impls:
            self._owners.add(impl.function, record.ref)
        return record

    @staticmethod
    def _describe_mismatch(pm: pluggy.PluginManager, impls: list[_Impl]) -> str | None:
        for impl in impls:
            hook, function = impl.hook, impl.function
            caller = getattr(pm.hook, hook, None)
            if caller is None or not caller.has_spec():
                continue
            params = [p.name for p in inspect.signature(function).parameters.values()]
            unknown = [p for p in params if p not in caller.spec.argnames]
            if unknown:
                return (
                    f"its {hook} implementation takes {hook}({', '.join(params)}), but the spec is "
                    f"{_spec_signature(pm, hook)}: unknown argument(s) {', '.join(unknown)}"
                )
        return None

    @staticmethod
    def _check_after(pm: pluggy.PluginManager, plugin: object, impls: list[_Impl]) -> str | None:
        try:
            pm.check_pending()
        except pluggy.PluginValidationError:
            specs = sorted(n for n in vars(pm.hook) if getattr(pm.hook, n).has_spec())
            for hook in (impl.hook for impl in impls):
                caller = getattr(pm.hook, hook)
                if not caller.has_spec():
                    close = difflib.get_close_matches(hook, specs, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    return (
                        f"it implements {hook!r}, which is not a pluginhost hook{hint}; "
                        f"the hooks are {', '.join(specs)}"
                    )
            raise
        for caller in pm.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and impl.kwargnames:
                    return (
                        f"its {caller.name} implementation gives parameter(s) {', '.join(impl.kwargnames)} a "
                        f"default value, so pluggy would never pass them; the spec is "
                        f"{_spec_signature(pm, caller.name)}: drop the defaults"
                    )
        return None

    # -- calling hooks ---------------------------------------------------------

    def call(self, hook: str, *, consequence: str = "The engine was not built.", **kwargs: Any) -> Any:
        """Call every implementation of ``hook`` (loading plugins first if needed).

        An exception from an implementation (any ``BaseException`` but Ctrl-C:
        a plugin's ``sys.exit()`` too) becomes a ``PluginHookError`` naming the
        plugin and the hook, followed by ``consequence``. An ``on_request``
        implementation raising ``ValueError`` (or ``PermissionError``, a refusal
        by policy) refuses the request, and so does an ``on_output`` one raising
        ``PermissionError`` (a policy withholding the output): a
        ``RequestRefusedError``, which is a ``ValueError``.
        """
        return self._dispatch(getattr(self.plugin_manager.hook, hook), hook, consequence, kwargs)

    def _dispatch(self, caller: Any, hook: str, consequence: str, kwargs: dict[str, Any]) -> Any:
        token = start_dispatch(self._owners)
        ranks = distributed._in_hook.set(self.ranks) if self.ranks is not None else None
        try:
            results = caller(**kwargs)
            if results:  # pluggy leaves out the None every hook of this project returns
                self._warn_returned(caller, hook, results)
            return results
        except PluginHookError:
            raise
        except BaseException as exc:  # noqa: BLE001 - a plugin's code may raise anything, exit included
            if isinstance(exc, KeyboardInterrupt):
                raise
            plugin = self._owners.in_traceback(exc.__traceback__) or self._implementer_of(caller, hook, exc)
            if plugin is None:
                raise
            raise self._hook_error(plugin, hook, exc, consequence) from exc
        finally:
            if ranks is not None:
                distributed._in_hook.reset(ranks)
            end_dispatch(token)

    def _implementer_of(self, caller: Any, hook: str, exc: BaseException) -> PluginRef | None:
        """The plugin to blame for ``exc`` when no frame of a plugin's is in its traceback (``None``: no plugin
        implements the hook).

        pluggy's own errors about an implementation (a wrapper that never yields: ``wrap_controller at 'on_output'
        /path/plugin.py:12 did not yield``) name its file; else the only plugin implementing the hook, or the first
        (re-raised as it was, the error escaped the engine's step: a request's stream never ended, or every running
        request failed).
        """
        refs = {record.name: record.ref for record in self._records}
        impls = [impl for impl in reversed(caller.get_hookimpls()) if impl.plugin_name in refs]
        impls = [impl for impl in impls if refs[impl.plugin_name] != builtin_ref()] or impls
        if not impls:
            return None
        text = str(exc)
        for impl in impls:
            source = inspect.getsourcefile(inspect.unwrap(impl.function)) or ""
            if source and source in text:
                return refs[impl.plugin_name]
        return refs[impls[0].plugin_name]

    def _warn_returned(self, caller: Any, hook: str, results: list[Any]) -> None:
        """Once per hook: an implementation returned a value, which nothing reads (a porting slip, usually)."""
        if hook in self._warned_returns:
            return
        self._warned_returns.add(hook)
        names = [impl.plugin_name for impl in caller.get_hookimpls() if impl.plugin_name != BUILTIN_PLUGIN]
        who = f"plugin {names[0]!r}" if len(names) == 1 else f"one of the plugins {', '.join(map(repr, names))}"
        logger.warning(
            "%s returned %s from its %s hook; the value is ignored: hooks change what they are given in place "
            "(the config, the model, the request) and return None",
            who,
            type(results[0]).__name__,
            hook,
        )

    def _hook_error(self, plugin: PluginRef, hook: str, exc: BaseException, consequence: str) -> PluginHookError:
        record = next((r for r in self._records if r.name == plugin.name), None)
        remedy = _remedy(record) if record is not None else ""
        if hook == "on_request" and isinstance(exc, ValueError | PermissionError):
            # A refusal of the request (a PermissionError: by policy), told to its caller (a 400, as any ValueError
            # there); the engine and the server go on. Not a fault of the plugin's to fix or disable.
            return RequestRefusedError(f"{plugin.describe()} refused the request: {exc}", plugin=plugin.name, hook=hook)
        if hook == "on_output" and isinstance(exc, PermissionError):
            # A policy withholding what was generated (a content filter): the request's refusal, a 400 as in
            # on_request, not a fault of the plugin's (a 500). A ValueError here is a fault: the request was valid.
            return RequestRefusedError(
                f"{plugin.describe()} refused the request's output: {exc}", plugin=plugin.name, hook=hook
            )
        if isinstance(exc, PermissionError):  # a policy said no, as it should: not a fault to fix or disable
            message = f"{plugin.describe()} refused, in its {hook} hook: {_sentence(str(exc))} {consequence}".strip()
            return PluginHookError(message, plugin=plugin.name, hook=hook)
        message = f"{plugin.describe()} failed in its {hook} hook: {_sentence(_describe_exception(exc))}"
        return PluginHookError(
            f"{message} {consequence} {remedy}".replace("  ", " ").strip(), plugin=plugin.name, hook=hook
        )

    # -- runtime hooks ---------------------------------------------------------------

    def plugins_of_file(self, filename: str) -> list[PluginRef]:
        """The loaded plugins whose hook implementations are in ``filename``: what runs code from it."""
        return self._owners.plugins_of_file(filename)

    def implementers(self, hook: str) -> list[PluginRef]:
        """The plugins implementing ``hook``, in the order their implementations run."""
        refs = {record.name: record.ref for record in self.records}
        impls = getattr(self.plugin_manager.hook, hook).get_hookimpls()
        return [refs[impl.plugin_name] for impl in reversed(impls) if impl.plugin_name in refs]

    def has_implementations(self, hook: str) -> bool:
        """Whether any loaded plugin implements ``hook`` (so the engine can skip calling it)."""
        return bool(getattr(self.plugin_manager.hook, hook).get_hookimpls())

    def record_stats(self, stats: Any) -> None:
        """Call ``record_stats``; an implementation that raises is logged once, naming its plugin, and dropped."""
        pm = self.plugin_manager
        if self._stats_caller is None:
            self._stats_caller = pm.hook.record_stats
        caller = self._stats_caller
        while True:
            try:
                self._dispatch(caller, "record_stats", "", {"stats": stats})
                return
            except PluginHookError as exc:
                logger.error("%s Its record_stats is not called again by this engine.", str(exc).rstrip())
                failed = pm.get_plugin(exc.plugin)
                self._stats_dropped.append(failed)
                self._stats_caller = pm.subset_hook_caller("record_stats", remove_plugins=self._stats_dropped)
                # Those after it in pluggy's call order (the last registered first) have not seen this step yet.
                order = [impl.plugin for impl in reversed(caller.get_hookimpls())]
                ran = order[: order.index(failed) + 1] if failed in order else order
                if len(ran) == len(order):
                    return
                caller = pm.subset_hook_caller("record_stats", remove_plugins=[*self._stats_dropped, *ran])

    def collect_logits_processors(self) -> LogitsProcessorRegistry:
        """This engine's logits processors: the ``register_logits_processors`` hook."""
        from pluginhost.logits_processors import LogitsProcessorRegistry

        registry = LogitsProcessorRegistry()
        self.call("register_logits_processors", registry=registry)
        return registry

    def register_routes(self, app: Any, engine: Any, builtin_paths: Sequence[str]) -> None:
        """Call each ``register_routes`` implementation in turn; a path already taken stops with an error.

        A route may not take a builtin path, nor a path and method another
        plugin's route took: the error names the plugin (and the other one).
        """
        caller = self.plugin_manager.hook.register_routes
        builtin = set(builtin_paths)
        late = [path for path in builtin_paths if path not in {getattr(r, "path", None) for r in app.routes}]
        taken: dict[tuple[str, str], str] = {}  # (path, method) -> the plugin whose route it is
        for impl in reversed(caller.get_hookimpls()):  # pluggy's call order
            if impl.hookwrapper or getattr(impl, "wrapper", False):
                logger.warning("%s: wrapper implementations of register_routes are not called", impl.plugin_name)
                continue
            before = {id(route) for route in app.routes}
            arguments = {name: {"app": app, "engine": engine}[name] for name in impl.argnames}
            self._dispatch(impl.function, "register_routes", "The server was not started.", arguments)
            plugin = next((r.ref for r in self._records if r.name == impl.plugin_name), PluginRef(impl.plugin_name))
            for route in [r for r in app.routes if id(r) not in before]:
                path, route_methods = getattr(route, "path", ""), getattr(route, "methods", None) or {"*"}
                shadowed = _builtin_answered_by(route, builtin, late)
                if shadowed is not None:
                    holder = "the server itself" if shadowed == path else f"the server itself ({shadowed})"
                else:
                    mine = plugin.name
                    others = {taken[(path, m)] for m in route_methods if taken.get((path, m), mine) != mine}
                    holder = f"plugin {sorted(others)[0]!r}" if others else None
                if holder is not None:
                    raise PluginHookError(
                        f"{plugin.describe()} failed in its register_routes hook: route {path or '/'} is already "
                        f"taken by {holder}. The server was not started. {plugin.remedy()}",
                        plugin=plugin.name,
                        hook="register_routes",
                    )
                taken.update({(path, m): plugin.name for m in route_methods})

    def collect_models(self, *, strict: bool = True) -> ArchitectureRegistry:
        """A fresh registry: the ``register_models`` hooks and direct ``ModelRegistry`` registrations, in call order.

        Not ``strict`` (listings): a plugin whose hook raises is marked failed,
        unregistered, and the collection starts again without it.
        """
        pm = self.plugin_manager  # load first: registrations made at import are process-wide
        while True:
            hooked = ArchitectureRegistry()
            try:
                with collecting_into(hooked, listed=self._applied_architectures):
                    self.call("register_models", registry=hooked)
            except PluginHookError as exc:
                if strict or exc.plugin == BUILTIN_PLUGIN:
                    raise
                self._records = [
                    replace(r, status="failed", reason=str(exc)) if r.name == exc.plugin and r.status == "loaded" else r
                    for r in self._records
                ]
                pm.unregister(name=exc.plugin)
                continue
            return self._merged(hooked)

    def _merged(self, hooked: ArchitectureRegistry) -> ArchitectureRegistry:
        """This engine's registry: its hooks' registrations (``hooked``) and those made outside them.

        Direct ModelRegistry registrations: from your own code (always), or from an installed
        plugin's code (only where that plugin is loaded); the builtins came through the hook
        already. Then what the register() functions this host loads registered, in their one
        call. Every registration takes its plugin's place in call order (your own code's last):
        the plugin called later wins, however it registered. Within the hook, the order it really
        called its implementations in decides (``tryfirst``/``trylast``, a wrapper's code after its
        ``yield``): a hook registration ranks at least as late as the one it replaced there.
        """
        order = {r.ref: i for i, r in enumerate(self._records)}
        last = len(order)

        def ranked(entry: Registration) -> int:
            return order.get(entry.registered_by, last)

        def at(rank: int) -> Callable[[Registration], int]:
            return lambda entry: rank

        # id(entry) -> its rank, never below an earlier one's of its architecture; but the builtins keep theirs,
        # the first: any plugin overrides them, a tryfirst one too (its implementation runs before theirs).
        builtin = builtin_ref()
        in_hook: dict[int, int] = {}
        for latest in hooked.entries():
            rank = -1
            for entry in reversed([latest, *latest.overrides]):  # in the order the hook made them
                if entry.registered_by == builtin:
                    in_hook[id(entry)] = ranked(entry)
                else:
                    rank = in_hook[id(entry)] = max(rank, ranked(entry))

        sources: list[tuple[list[Registration], Callable[[Registration], int | None]]] = [
            (hooked.entries(), lambda entry: in_hook[id(entry)]),
            (ModelRegistry.direct_entries(), lambda e: ranked(e) if self._applies_directly(e) else None),
        ]
        sources += [(call.registrations.entries(), at(order.get(ref, last))) for ref, call in self._calls]
        sources += [(r.entries(), at(last)) for r in self._recorded_since()]
        return ArchitectureRegistry.merged(sources)


def _uninspectable(record: PluginRecord, exc: Exception) -> PluginRecord:
    """``record`` failed: its plugin object raised while the host read its hook implementations."""
    where = _raised_at(exc, record.target.partition(":")[0]) if record.target else ""
    reason = f"reading its plugin object for hook implementations failed: {_describe_exception(exc)}{where}"
    return replace(record, status="failed", reason=reason)


def _signature_problem(pm: pluggy.PluginManager, impls: list[_Impl]) -> str | None:
    """What pluggy would take but never call rightly: an async hook, keyword-only parameters, a star for arguments.

    pluggy passes a hook's arguments only to parameters named as the spec's: ``*args`` and
    ``**kwargs`` stay empty, so ``modify_config(**kwargs)`` would run and change nothing.
    """
    for impl in impls:
        function = inspect.unwrap(impl.function)
        if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
            return f"its {impl.hook} implementation is async: hooks are called, not awaited; use def"
        try:
            params = inspect.signature(impl.function).parameters.values()
        except (TypeError, ValueError):
            continue
        caller = getattr(pm.hook, impl.hook, None)
        if caller is None or not caller.has_spec():  # an unknown hook: pluggy's check_pending names it
            continue
        keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        if keyword_only:
            return (
                f"its {impl.hook} implementation takes {', '.join(keyword_only)} as keyword-only parameters (after "
                f"*), which pluggy never passes; the spec is {_spec_signature(pm, impl.hook)}: make them plain "
                "parameters"
            )
        starred = [
            {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}[p.kind] + p.name
            for p in params
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        # Taking none of the arguments is legal pluggy (a hook that only needs to run), and so is a star beside
        # some named ones (on_output(output, **kwargs): the arguments it uses): a star with none named meant to
        # reach them through it, and never will.
        lost = [name for name in caller.spec.argnames if name not in {p.name for p in params}]
        if starred and lost and len(lost) == len(caller.spec.argnames):
            return (
                f"its {impl.hook} implementation takes {' and '.join(starred)}, which pluggy leaves empty (it passes "
                f"a hook's arguments only to parameters of their names), so it never gets {', '.join(lost)}: write "
                f"{_spec_signature(pm, impl.hook)}, naming the arguments you use"
            )
    return None


def _builtin_answered_by(route: Any, builtin: set[str], late: Sequence[str]) -> str | None:
    """The builtin path a plugin's route takes: the same path, or a ``late`` one it would answer first.

    Routes answer in the order they were added. The builtins come before the plugins' routes, except
    the ``late`` ones (``/v1/models/{model:path}``, which would take every path below it): a route
    or mount answering a GET for one of those (``/v1/models/{name}``, ``app.mount("/v1", ...)``) takes it.
    """
    path = getattr(route, "path", "")
    if path in builtin:
        return path
    matches = getattr(route, "matches", None)  # Starlette's routes and mounts
    if matches is None:
        return None
    for taken in late:
        sample = re.sub(r"\{[^}]*\}", "x", taken)  # a URL the builtin answers: /v1/models/{model:path} -> /v1/models/x
        scope = {"type": "http", "path": sample, "root_path": "", "method": "GET", "path_params": {}}
        try:
            match, _ = matches(scope)
        except Exception:  # noqa: BLE001, S112 - a route type that cannot be asked: only its path is compared
            continue
        if match.name == "FULL":  # PARTIAL: the path, for another method (DELETE /v1/models/{name})
            return taken
    return None


#: What importlib.metadata can load: ``module`` or ``module:attribute``, dotted names, optional [extras].
_ENTRY_POINT_VALUE = re.compile(r"[\w.]+\s*(:\s*[\w.]+\s*)?(\[.*\]\s*)?$")


def _malformed_target(value: str) -> str | None:
    """Why an entry point's value cannot be loaded (``my-plugin``: importlib fails with an AttributeError), if so."""
    if _ENTRY_POINT_VALUE.match(value):
        return None
    fixed = value.replace("-", "_")
    hint = f", such as {fixed!r} (import names use underscores)" if _ENTRY_POINT_VALUE.match(fixed) else ""
    return (
        f"its entry point's value {value!r} is not of the form 'package.module' or 'package.module:attribute' "
        f"(dotted Python names){hint}: fix it in the distribution's entry points and reinstall"
    )


def _raised_at(exc: BaseException, module: str) -> str:
    """`` (at file:line)``: the innermost line of the plugin's own code (``module``'s package) it came through."""
    if isinstance(exc, SyntaxError):  # its own message says where
        return ""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None and spec.origin else None
    if origin is None:
        return ""
    own = Path(origin).parent if Path(origin).name == "__init__.py" else Path(origin)
    where = ""
    for frame, line in traceback.walk_tb(exc.__traceback__):
        filename = Path(frame.f_code.co_filename)
        if filename == own or own in filename.parents:
            where = f" (at {filename}:{line})"
    return where


def _sentence(text: str) -> str:
    """``text`` ended with a full stop, unless it ends a sentence already (a plugin's message often does)."""
    return text if text.rstrip().endswith((".", "!", "?")) else f"{text}."


def _describe_exception(exc: BaseException) -> str:
    if "pydantic" in sys.modules:  # only a configuration change can raise its ValidationError
        from pydantic import ValidationError

        from pluginhost.config import describe_validation_error

        if isinstance(exc, ValidationError):
            return f"invalid value: {describe_validation_error(exc)}"
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


def _is_logits_processor(cls: type) -> bool:
    from pluginhost.logits_processors import LogitsProcessor

    return issubclass(cls, LogitsProcessor) or all(
        callable(getattr(cls, name, None)) for name in ("apply", "update_state", "is_argmax_invariant")
    )


def _checked_in_process(plugins: Sequence[object]) -> list[object]:
    """``plugins`` as a list, or one ``ConfigError`` (a ``ValueError``) saying what is wrong with it."""
    if isinstance(plugins, str | bytes | Mapping) or not isinstance(plugins, Iterable):
        raise ConfigError(
            f"plugins must be a list of plugin objects (modules, classes or instances with @hookimpl "
            f"functions, or register() functions), got {type(plugins).__name__}: {plugins!r:.80}"
        )
    plugins = list(plugins)  # once: a generator would be used up by the checks below
    for i, plugin in enumerate(plugins):
        if plugin is None or isinstance(plugin, str | bytes | int | float | bool):
            raise ConfigError(
                f"plugins[{i}] is {plugin!r:.80}, not a plugin: pass the plugin object itself (a module, class or "
                "instance with @hookimpl functions, or a register() function); installed plugins are chosen by "
                "name with PLUGINHOST_PLUGINS or --plugins instead"
            )
    return plugins


def _imported_target(value: str) -> object | None:
    """What entry point ``value`` (``"module:attr"``) names, if its module is imported already (nothing is imported
    here); by identity, a function re-exported by a package's ``__init__`` is the one its entry point names."""
    module_name, _, attrs = value.replace(" ", "").partition(":")
    target: object | None = sys.modules.get(module_name)
    for attr in filter(None, attrs.split(".")):
        target = inspect.getattr_static(target, attr, None) if target is not None else None
    return target


def _required_parameters(function: Any) -> list[str]:
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 6)
