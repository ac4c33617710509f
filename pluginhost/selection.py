"""Which installed plugins may load: the allow and deny lists.

Sources, highest precedence first:

* CLI: ``--no-plugins``, ``--plugins a,b``, ``--disable-plugin NAME``;
* environment: ``PLUGINHOST_PLUGINS``, ``PLUGINHOST_DISABLED_PLUGINS``.

``PLUGINHOST_PLUGINS`` unset means every installed plugin; empty means none;
otherwise it is a comma-separated allow-list. A CLI allow-list replaces the
environment's. Deny lists add up, except that a plugin the CLI explicitly
allows is no longer denied by the environment, unless the environment names its
distribution and the CLI only an entry-point name other distributions declare too.
Names match an entry-point name or a distribution name, case-insensitively, with
``-``, ``_`` and ``.`` alike.

This module only decides; it reads the environment when asked, never at import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "DISABLED_ENV",
    "PLUGINS_ENV",
    "SKIP_BROKEN_ENV",
    "PluginSelection",
    "normalize_name",
    "parse_name_list",
]

PLUGINS_ENV = "PLUGINHOST_PLUGINS"
DISABLED_ENV = "PLUGINHOST_DISABLED_PLUGINS"
SKIP_BROKEN_ENV = "PLUGINHOST_SKIP_BROKEN_PLUGINS"


def normalize_name(name: str) -> str:
    """Canonical form of a plugin or distribution name (PEP 503 style)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def parse_name_list(text: str) -> tuple[str, ...]:
    """Split a comma-separated list of names; spaces are stripped, empty items dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


@dataclass(frozen=True)
class PluginSelection:
    """The effective allow and deny lists for installed plugins."""

    #: Allowed names as given, or ``None`` when every installed plugin may load.
    allow: tuple[str, ...] | None = None
    #: Where the allow-list came from, for messages (``PLUGINHOST_PLUGINS``, ``--plugins``...).
    allow_source: str = ""
    #: Denied names (normalized) and where each denial came from.
    deny: Mapping[str, str] = field(default_factory=dict)
    #: Each denied name (normalized) as it was given, for messages: ``My_Plugin``, not ``my-plugin``.
    deny_as_given: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginSelection:
        env = os.environ if environ is None else environ
        allow = parse_name_list(env[PLUGINS_ENV]) if PLUGINS_ENV in env else None
        denied = parse_name_list(env.get(DISABLED_ENV, ""))
        return cls(
            allow=allow,
            allow_source=PLUGINS_ENV if allow is not None else "",
            deny={normalize_name(n): DISABLED_ENV for n in denied},
            deny_as_given={normalize_name(n): n for n in denied},
        )

    def with_cli(
        self,
        *,
        plugins: str | None = None,
        no_plugins: bool = False,
        disable: Iterable[str] = (),
    ) -> PluginSelection:
        """Apply CLI flags on top of this (environment) selection."""
        allow, allow_source = self.allow, self.allow_source
        deny, deny_as_given = dict(self.deny), dict(self.deny_as_given)
        if no_plugins:
            allow, allow_source = (), "--no-plugins"
        elif plugins is not None:  # beats the environment's denial too: see decide()
            allow, allow_source = parse_name_list(plugins), "--plugins"
        for value in disable:
            for name in parse_name_list(value):
                deny[normalize_name(name)] = "--disable-plugin"
                deny_as_given[normalize_name(name)] = name
        return PluginSelection(allow=allow, allow_source=allow_source, deny=deny, deny_as_given=deny_as_given)

    def decide(
        self,
        entry_point: str,
        distribution: str | None,
        *,
        installed: Iterable[tuple[str, str | None]] | None = None,
    ) -> str | None:
        """Return ``None`` when the plugin may load, else why it is blocked.

        ``installed`` (every installed entry point and its distribution) tells whether another
        distribution declares the same entry-point name; it is read from the package metadata
        when needed and not given.
        """
        names = _names_of([(entry_point, distribution)])
        allowed = {normalize_name(n) for n in self.allow or ()} if self.allow_source == "--plugins" else set()
        by_distribution = distribution is not None and normalize_name(distribution) in allowed
        for name in sorted(names):
            if name not in self.deny:
                continue
            # Named by --plugins: an explicit CLI choice beats the environment's denial, by either name...
            overridden = self.deny[name] == DISABLED_ENV and (by_distribution or normalize_name(entry_point) in allowed)
            # ...but a name other distributions share does not choose this one over a denial of its distribution
            # (the conflict error's own advice, PLUGINHOST_DISABLED_PLUGINS=<distribution>, would do nothing).
            if overridden and not by_distribution and name != normalize_name(entry_point):
                overridden = not _declared_by_others(entry_point, distribution, installed)
            if not overridden:
                return f"disabled by {self.deny[name]}"
        if self.allow is None:
            return None
        if not self.allow:
            return self.none_allowed_reason
        if names.isdisjoint(normalize_name(n) for n in self.allow):
            return f"not in the allow-list ({self.allow_source}={','.join(self.allow)})"
        return None

    @property
    def none_allowed_reason(self) -> str:
        """Why ``decide`` blocks each plugin an empty allow-list (``--no-plugins``) leaves out, all at once."""
        return f"installed plugins disabled by {self.allow_source}"

    def unmatched_allowed(self, installed: Iterable[tuple[str, str | None]]) -> list[str]:
        """Allow-list names that match no installed (entry point, distribution)."""
        known = _names_of(installed)
        return [n for n in self.allow or () if normalize_name(n) not in known]

    def unmatched_denied(self, installed: Iterable[tuple[str, str | None]]) -> list[str]:
        """Deny-list names that match nothing installed (probably typos), as they were given.

        ``deny[normalize_name(name)]`` says where each came from.
        """
        known = _names_of(installed)
        return [self.deny_as_given.get(n, n) for n in self.deny if n not in known]


def _declared_by_others(
    entry_point: str, distribution: str | None, installed: Iterable[tuple[str, str | None]] | None
) -> bool:
    """Whether a distribution other than ``distribution`` declares the entry-point name ``entry_point``."""
    if installed is None:
        from pluginhost.discovery import discover_installed

        installed = [(p.name, p.distribution) for p in discover_installed()]
    own = normalize_name(distribution or "")
    return any(
        normalize_name(name) == normalize_name(entry_point) and normalize_name(dist or "") != own
        for name, dist in installed
    )


def _names_of(installed: Iterable[tuple[str, str | None]]) -> set[str]:
    names: set[str] = set()
    for entry_point, distribution in installed:
        names.add(normalize_name(entry_point))
        if distribution:
            names.add(normalize_name(distribution))
    return names
