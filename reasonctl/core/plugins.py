"""The plugin host: one pluggy manager, built-ins and third-party plugins alike.

Plugins are found through ``importlib.metadata`` entry points in the group ``reasonctl``.
Our own plugins are declared there too, so every run exercises the same discovery path a
third-party plugin uses. A plugin that fails to import or register is recorded with its
distribution, version and traceback and skipped, unless strict mode is on. Names claimed by
two plugins and factories of the wrong shape are kept in the registry as unusable and
reported (strict mode makes them fatal too).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from reasonctl.core import hookspecs, protocols
from reasonctl.core.config.redaction import redact_text
from reasonctl.core.errors import PluginLoadError, ReasonctlError, did_you_mean
from reasonctl.core.lifecycle import LifecycleHooks
from reasonctl.core.registry import KINDS, PluginInfo, Registrar, Registry

PROJECT = "reasonctl"
ENTRY_POINT_GROUP = "reasonctl"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a function as an implementation of a reasonctl hook."""

HOOK_NAMES: tuple[str, ...] = tuple(
    name for name, value in vars(hookspecs).items() if hasattr(value, f"{PROJECT}_spec")
)
"""Every hook a plugin may implement."""

COMPONENT_PROTOCOLS: dict[str, type | tuple[type, ...]] = protocols.PROTOCOLS
"""Component kind -> the Protocol a built component is checked against."""


@dataclass
class PluginRecord:
    """What ``reasonctl plugins`` shows about one plugin."""

    name: str
    distribution: str | None
    version: str | None
    status: str  # "ok" | "error" | "disabled"
    hooks: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
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
        self.registry = Registry(contracts=COMPONENT_PROTOCOLS)
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
            self._check_hook_names(plugin)
            self.pm.check_pending()
            record.hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            self._collect_components(plugin, record)
        except Exception as exc:
            self.pm.unregister(plugin)
            self.registry.remove_owner(record.name)
            self._fail(record, str(exc), exc)
            return
        self.records.append(record)
        if self.strict:
            self._refuse_unusable(record)

    def _check_hook_names(self, plugin: Any) -> None:
        """Reject hook implementations reasonctl does not define, suggesting the right name."""
        unknown = [
            caller.name for caller in self.pm.get_hookcallers(plugin) or []
            if not caller.has_spec()
            and any(impl.plugin is plugin and not impl.optionalhook
                    for impl in caller.get_hookimpls())
        ]
        unmarked = [
            name for name in HOOK_NAMES
            if callable(getattr(plugin, name, None))
            and not hasattr(getattr(plugin, name), f"{PROJECT}_impl")
        ]
        problems = []
        for name in unknown:
            close = did_you_mean(name, HOOK_NAMES)
            suggestion = f"did you mean {close!r}?" if close else "see reasonctl.core.hookspecs"
            problems.append(f"implements {name!r}, which is not a reasonctl hook ({suggestion})")
        problems += [
            f"defines {name!r} without @reasonctl.hookimpl, so it would never be called"
            for name in unmarked
        ]
        if problems:
            raise PluginLoadError("; ".join(problems))

    def _collect_components(self, plugin: Any, record: PluginRecord) -> None:
        for kind, hook_name in KINDS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    impl.function(register=Registrar(self.registry, kind, record.info))

    def _refuse_unusable(self, record: PluginRecord) -> None:
        """Strict mode: a name conflict or broken factory of this plugin is fatal."""
        problems = [
            str(conflict.error()) for conflict in self.registry.conflicts()
            if any(spec.owner.name == record.name for spec in conflict.specs)
        ]
        problems += [
            f"{spec.label}: {spec.problem}" for spec in self.registry.broken()
            if spec.owner.name == record.name
        ]
        problems += [shadow.message for shadow in self.registry.shadowed()
                     if shadow.spec.owner.name == record.name]
        if problems:
            self._fail(record, "; ".join(problems), PluginLoadError("; ".join(problems)))

    def _fail(self, record: PluginRecord, message: str, exc: BaseException) -> None:
        where = f"{record.distribution} {record.version}" if record.distribution else "ad-hoc"
        record.status = "error"
        record.error = redact_text(f"plugin {record.name!r} ({where}) {message}")
        record.traceback = redact_text("".join(traceback.format_exception(exc)))
        if record not in self.records:
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

    def load_warnings(self) -> list[str]:
        """One line per plugin that failed to load, for the start of ``run`` and ``validate``."""
        return [
            f"warning: {record.error} (skipped; `reasonctl plugins --all` shows the traceback)"
            for record in self.errors
        ]

    def shadow_warnings(self) -> list[str]:
        """One line per registration of a built-in name by another plugin (not used), for
        the start of ``run`` and ``config validate``."""
        return [f"warning: {shadow.message}" for shadow in self.registry.shadowed()]

    def add_commands(self, app: Any) -> None:
        """Let plugins add Typer commands to ``app``; a failing plugin is reported, not fatal.

        The names each plugin added are recorded in its :attr:`PluginRecord.commands`.
        """
        for impl in self.pm.hook.register_commands.get_hookimpls():
            record = next((r for r in self.records if r.name == impl.plugin_name), None)
            before = _command_names(app)
            try:
                impl.function(app=app)
            except Exception as exc:
                if record is None:
                    raise
                self._fail(record, f"failed to add commands: {exc!r}", exc)
                continue
            if record is not None:
                record.commands = [n for n in _command_names(app) if n not in before]

    def describe(self) -> dict[str, Any]:
        """Everything ``reasonctl plugins`` shows, as JSON-friendly data.

        ``plugins``: one entry per plugin (status, hooks, commands, components by kind,
        error and traceback); ``components``: every registration by kind with its owner,
        description, config keys and status (``ok``, ``conflict``, ``shadowed`` or
        ``broken``); ``conflicts``, ``shadowed`` and ``broken``: the registrations that are
        not used and why.
        """
        conflicts = self.registry.conflicts()
        conflicted = {(c.kind, c.name) for c in conflicts}
        shadowed = {id(shadow.spec): shadow for shadow in self.registry.shadowed()}
        components: dict[str, list[dict[str, Any]]] = {}
        for kind, by_name in self.registry.registrations.items():
            for name, specs in sorted(by_name.items()):
                for spec in specs:
                    status = ("shadowed" if id(spec) in shadowed
                              else "conflict" if (kind, name) in conflicted
                              else "broken" if spec.problem else "ok")
                    components.setdefault(kind, []).append({
                        "name": name,
                        "plugin": spec.owner.name,
                        "distribution": spec.owner.distribution,
                        "version": spec.owner.version,
                        "description": spec.description,
                        "status": status,
                        "problem": (shadowed[id(spec)].message if id(spec) in shadowed
                                    else spec.problem or None),
                        "config": spec.config_keys(),
                    })
        plugins = []
        for record in self.records:
            owned: dict[str, list[str]] = {}
            for spec in self.registry.owned_by(record.name):
                owned.setdefault(spec.kind, []).append(spec.name)
            plugins.append({
                "name": record.name,
                "distribution": record.distribution,
                "version": record.version,
                "status": record.status,
                "hooks": record.hooks,
                "commands": record.commands,
                "components": {k: sorted(v) for k, v in sorted(owned.items())},
                "error": record.error or None,
                "traceback": record.traceback or None,
            })
        return {
            "plugins": plugins,
            "components": components,
            "conflicts": [
                {"kind": c.kind, "name": c.name, "plugins": [s.owner.name for s in c.specs],
                 "message": str(c.error())}
                for c in conflicts
            ],
            "broken": [
                {"kind": s.kind, "name": s.name, "plugin": s.owner.name, "problem": s.problem}
                for s in self.registry.broken()
            ],
            "shadowed": [
                {"kind": s.spec.kind, "name": s.spec.name, "plugin": s.spec.owner.name,
                 "message": s.message}
                for s in self.registry.shadowed()
            ],
        }


def _command_names(app: Any) -> list[str]:
    """Names of the commands and groups registered on a ``typer.Typer``."""
    names = []
    for command in app.registered_commands:
        callback = command.callback
        fallback = callback.__name__.lower().replace("_", "-") if callback else "?"
        names.append(command.name or fallback)
    for group in app.registered_groups:
        names.append(group.name or group.typer_instance.info.name or "?")
    return names


def _builtin_first(ep: metadata.EntryPoint) -> tuple[int, str]:
    dist = ep.dist.name if ep.dist is not None else ""
    return (0 if dist == PROJECT else 1, ep.name)


__all__ = ["PluginHost", "PluginRecord", "hookimpl", "ReasonctlError"]
