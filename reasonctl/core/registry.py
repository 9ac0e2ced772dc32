"""Named components per kind, each owned by the plugin that registered it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from reasonctl.core.errors import DuplicateComponentError, UnknownComponentError

KINDS: dict[str, str] = {
    "dataset": "register_datasets",
    "reward": "register_rewards",
    "algorithm": "register_algorithms",
    "backend": "register_backends",
    "storage": "register_storage",
    "rollout_engine": "register_rollout_engines",
    "logger": "register_loggers",
}
"""Component kind -> the hook that registers it."""


@dataclass(frozen=True)
class PluginInfo:
    """Who registered a component: the plugin name and its distribution, if installed."""

    name: str
    distribution: str | None = None
    version: str | None = None

    def label(self) -> str:
        """Short owner label such as ``reasonctl`` or ``reasonctl-foo 0.3``."""
        if self.distribution is None:
            return self.name
        if self.distribution == "reasonctl":
            return "reasonctl"
        return f"{self.distribution} {self.version}" if self.version else self.distribution


@dataclass
class ComponentSpec:
    """A registered component: how to build it and what config it accepts."""

    kind: str
    name: str
    factory: Callable[..., Any]
    owner: PluginInfo
    config_model: type[BaseModel] | None = None
    description: str = ""

    def make_config(self, values: dict[str, Any] | BaseModel | None = None) -> BaseModel | None:
        """Validate ``values`` with the component's config model (``None`` without one)."""
        if self.config_model is None:
            return None
        if isinstance(values, self.config_model):
            return values
        if isinstance(values, BaseModel):
            values = values.model_dump()
        return self.config_model.model_validate(values or {})

    def build(self, config: dict[str, Any] | BaseModel | None = None, *, ctx: Any = None) -> Any:
        """Call the factory with the validated config (and ``ctx`` when it takes one)."""
        if ctx is not None and _accepts_ctx(self.factory):
            return self.factory(self.make_config(config), ctx=ctx)
        return self.factory(self.make_config(config))


@dataclass
class Registry:
    """All components known to a plugin manager, by kind and name."""

    components: dict[str, dict[str, ComponentSpec]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS}
    )
    unavailable_hint: str = ""

    def add(self, spec: ComponentSpec) -> None:
        """Add a component; a name already taken for that kind raises an error naming both."""
        existing = self.components[spec.kind].get(spec.name)
        if existing is not None:
            raise DuplicateComponentError(
                f"{spec.kind} {spec.name!r} is registered twice: by {existing.owner.name} "
                f"({existing.owner.label()}) and by {spec.owner.name} ({spec.owner.label()}). "
                "Rename one of them or disable a plugin with REASONCTL_DISABLE_PLUGINS."
            )
        self.components[spec.kind][spec.name] = spec

    def remove_owner(self, plugin_name: str) -> None:
        """Forget every component registered by ``plugin_name``."""
        for by_name in self.components.values():
            for name in [n for n, s in by_name.items() if s.owner.name == plugin_name]:
                del by_name[name]

    def get(self, kind: str, name: str) -> ComponentSpec:
        """Look up a component or raise :class:`UnknownComponentError` with suggestions."""
        try:
            return self.components[kind][name]
        except KeyError:
            raise UnknownComponentError(
                kind.replace("_", " "), name, self.available(kind), self.unavailable_hint
            ) from None

    def available(self, kind: str) -> dict[str, str]:
        """Registered names of ``kind`` mapped to their owner labels."""
        return {n: s.owner.label() for n, s in self.components[kind].items()}

    def names(self, kind: str) -> list[str]:
        """Sorted registered names of ``kind``."""
        return sorted(self.components[kind])

    def all(self) -> list[ComponentSpec]:
        """Every registered component."""
        return [s for by_name in self.components.values() for s in by_name.values()]


class Registrar:
    """The ``register`` callable handed to a plugin's ``register_<kinds>`` hook."""

    def __init__(self, registry: Registry, kind: str, owner: PluginInfo) -> None:
        self._registry = registry
        self._kind = kind
        self._owner = owner

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        config_model: type[BaseModel] | None = None,
        description: str = "",
    ) -> None:
        """Register ``factory`` under ``name`` for this hook's component kind."""
        if not name or not isinstance(name, str):
            raise ValueError(f"{self._owner.name}: component names must be non-empty strings")
        if not description:
            doc = (getattr(factory, "__doc__", None) or "").strip()
            description = doc.splitlines()[0] if doc else ""
        self._registry.add(
            ComponentSpec(self._kind, name, factory, self._owner, config_model, description)
        )


def _accepts_ctx(factory: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "ctx" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
