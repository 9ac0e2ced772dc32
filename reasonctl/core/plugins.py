"""The plugin host: one pluggy manager, built-ins and third-party plugins alike.

Plugins are found through ``importlib.metadata`` entry points in the group ``reasonctl``.
Our own plugins are declared there too, so every run exercises the same discovery path a
third-party plugin uses. A plugin that fails to import or register is recorded with its
distribution, version and traceback and skipped, unless strict mode is on.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from reasonctl.core import hookspecs
from reasonctl.core.errors import PluginLoadError, ReasonctlError
from reasonctl.core.lifecycle import LifecycleHooks
from reasonctl.core.registry import KINDS, PluginInfo, Registrar, Registry

PROJECT = "reasonctl"
ENTRY_POINT_GROUP = "reasonctl"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a function as an implementation of a reasonctl hook."""


@dataclass
class PluginRecord:
    """What ``reasonctl plugins`` shows about one plugin."""

    name: str
    distribution: str | None
    version: str | None
    status: str  # "ok" | "error" | "disabled"
    hooks: list[str] = field(default_factory=list)
    error: str = ""
    traceback: str = ""

    @property
    def info(self) -> PluginInfo:
        """The owner identity given to this plugin's components."""
        return PluginInfo(self.name, self.distribution, self.version)


def env_flag(name: str) -> bool:
    """True when environment variable ``name`` is set to a truthy value."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def disabled_from_env() -> set[str]:
    """Plugin or distribution names listed in ``REASONCTL_DISABLE_PLUGINS``."""
    raw = os.environ.get("REASONCTL_DISABLE_PLUGINS", "")
    return {part.strip() for part in raw.split(",") if part.strip()}


class PluginHost:
    """Loads plugins into one ``pluggy.PluginManager`` and collects their components.

    Create one per run (or per CLI invocation) with :meth:`load`; nothing is global, so two
    runs in one process never see each other's ad-hoc plugins.
    """

    scoped_plugins: list[tuple[Any, str]] = []
    """Plugins added to every host created by :meth:`load` (managed by the testing kit's
    ``register_plugin`` fixture, which removes them when the test ends)."""

    def __init__(self, *, strict: bool = False, disabled: Iterable[str] = ()) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.records: list[PluginRecord] = []
        self.strict = strict
        self.disabled = set(disabled)
        self.hooks = LifecycleHooks(self.pm)

    @classmethod
    def load(
        cls,
        *,
        strict: bool | None = None,
        disabled: Iterable[str] | None = None,
        entry_points: bool = True,
    ) -> PluginHost:
        """A host with every installed plugin loaded.

        ``strict`` defaults to ``REASONCTL_STRICT_PLUGINS``; ``disabled`` to
        ``REASONCTL_DISABLE_PLUGINS``.
        """
        host = cls(
            strict=env_flag("REASONCTL_STRICT_PLUGINS") if strict is None else strict,
            disabled=disabled_from_env() if disabled is None else disabled,
        )
        if entry_points:
            host.load_entry_points()
        for plugin, name in cls.scoped_plugins:
            host.add_plugin(plugin, name=name)
        return host

    # --- loading --------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Import and register every plugin in the ``reasonctl`` entry-point group."""
        seen: set[str] = set()
        eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=_builtin_first)
        for ep in eps:
            if ep.name in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(ep.name)
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            record = PluginRecord(ep.name, dist, version, "ok")
            if ep.name in self.disabled or (dist is not None and dist in self.disabled):
                record.status = "disabled"
                self.pm.set_blocked(ep.name)
                self.records.append(record)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the CLI down
                self._fail(record, f"failed to import {ep.value!r}: {exc!r}", exc)
                continue
            self._add(plugin, record)

    def add_plugin(self, plugin: Any, name: str | None = None) -> PluginRecord:
        """Register a plugin object or module directly (tests, SDK, ad-hoc plugins)."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        record = PluginRecord(name, None, None, "ok")
        self._add(plugin, record)
        return record

    def _add(self, plugin: Any, record: PluginRecord) -> None:
        try:
            self.pm.register(plugin, name=record.name)
        except Exception as exc:
            self._fail(record, f"could not be registered: {exc}", exc)
            return
        try:
            self.pm.check_pending()
            record.hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            self._collect_components(plugin, record)
        except Exception as exc:
            self.pm.unregister(plugin)
            self.registry.remove_owner(record.name)
            self._fail(record, str(exc), exc)
            return
        self.records.append(record)

    def _collect_components(self, plugin: Any, record: PluginRecord) -> None:
        for kind, hook_name in KINDS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    impl.function(register=Registrar(self.registry, kind, record.info))

    def _fail(self, record: PluginRecord, message: str, exc: BaseException) -> None:
        where = f"{record.distribution} {record.version}" if record.distribution else "ad-hoc"
        record.status = "error"
        record.error = f"plugin {record.name!r} ({where}) {message}"
        record.traceback = "".join(traceback.format_exception(exc))
        self.records.append(record)
        if self.strict:
            raise PluginLoadError(
                f"{record.error}\n(strict plugin mode: REASONCTL_STRICT_PLUGINS / "
                "--strict-plugins; unset it to skip broken plugins)"
            ) from exc
        broken = ", ".join(r.name for r in self.records if r.status == "error")
        self.registry.unavailable_hint = (
            f"Some plugins failed to load ({broken}); `reasonctl plugins` shows why."
        )

    # --- queries --------------------------------------------------------------------------

    @property
    def errors(self) -> list[PluginRecord]:
        """Plugins that failed to load."""
        return [r for r in self.records if r.status == "error"]

    def add_commands(self, app: Any) -> None:
        """Let plugins add Typer commands to ``app``; a failing plugin is reported, not fatal."""
        for impl in self.pm.hook.register_commands.get_hookimpls():
            try:
                impl.function(app=app)
            except Exception as exc:
                record = next((r for r in self.records if r.name == impl.plugin_name), None)
                if record is None:
                    raise
                self._fail(record, f"failed to add commands: {exc!r}", exc)

    def describe(self) -> list[dict[str, Any]]:
        """Plugins and their components as JSON-friendly dicts (for ``reasonctl plugins``)."""
        out = []
        for record in self.records:
            components: dict[str, list[str]] = {}
            for spec in self.registry.all():
                if spec.owner.name == record.name:
                    components.setdefault(spec.kind, []).append(spec.name)
            out.append(
                {
                    "name": record.name,
                    "distribution": record.distribution,
                    "version": record.version,
                    "status": record.status,
                    "hooks": record.hooks,
                    "components": {k: sorted(v) for k, v in sorted(components.items())},
                    "error": record.error or None,
                }
            )
        return out


def _builtin_first(ep: metadata.EntryPoint) -> tuple[int, str]:
    dist = ep.dist.name if ep.dist is not None else ""
    return (0 if dist == PROJECT else 1, ep.name)


__all__ = ["PluginHost", "PluginRecord", "hookimpl", "ReasonctlError"]
