"""Named components per kind, each owned by the plugin that registered it.

A name is usable when exactly one plugin registered it for its kind and its factory has the
contract's shape. A name registered by several plugins is a conflict (none of them is used,
whatever the load order), except that reasonctl's own names are never taken over: when
reasonctl registers a name, the registrations of other plugins are *shadowed* (kept out of
use and reported), so installing a plugin never changes what an unchanged config runs. A
factory of the wrong shape makes its component broken. All of these are kept and reported,
and looking an unusable name up raises an error saying why.

The kind -> Protocol mapping (``contracts``) is handed in by the plugin host, so this module
does not import :mod:`reasonctl.core.protocols`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from reasonctl.core.contracts import contract_problem, inspect_factory, product_problem
from reasonctl.core.errors import (
    BrokenComponentError,
    ComponentContractError,
    DuplicateComponentError,
    UnknownComponentError,
)

KINDS: dict[str, str] = {
    "dataset": "register_datasets",
    "reward": "register_rewards",
    "algorithm": "register_algorithms",
    "backend": "register_backends",
    "storage": "register_storage",
    "rollout_engine": "register_rollout_engines",
    "logger": "register_loggers",
    "environment": "register_environments",
}
"""Component kind -> the hook that registers it."""

FIRST_PARTY = "reasonctl"
"""The distribution whose component names other plugins cannot take over."""


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
    """A registered component: how to build it, what config it accepts, what it must be.

    ``contract`` is the Protocol built objects are checked against (``None``: unchecked);
    ``takes_ctx`` whether the factory declares ``ctx``; ``problem`` why the factory cannot
    be called as the contract says (empty when it can).
    """

    kind: str
    name: str
    factory: Callable[..., Any]
    owner: PluginInfo
    config_model: type[BaseModel] | None = None
    description: str = ""
    contract: type | tuple[type, ...] | None = None
    takes_ctx: bool = False
    problem: str = ""

    @property
    def label(self) -> str:
        """``kind 'name' (owner)``, as error messages name a component."""
        return f"{self.kind.replace('_', ' ')} {self.name!r} ({self.owner.label()})"

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
        """Validate ``config``, call the factory and check the result against ``contract``.

        The factory gets ``ctx`` only when it declares it. Raises
        :class:`~reasonctl.core.errors.BrokenComponentError` for a factory of the wrong
        shape and :class:`~reasonctl.core.errors.ComponentContractError` naming every
        member the built object lacks.
        """
        if self.problem:
            raise BrokenComponentError(
                self.kind.replace("_", " "), self.name, self.owner.label(), self.problem
            )
        validated = self.make_config(config)
        built = self.factory(validated, ctx=ctx) if self.takes_ctx else self.factory(validated)
        if self.contract is not None:
            problem = contract_problem(built, self.contract)
            if problem:
                raise ComponentContractError(f"{self.label}: {problem}")
        return built

    def config_keys(self) -> list[dict[str, Any]]:
        """The options of ``config_model``: key, type, default and description of each."""
        if self.config_model is None:
            return []
        from pydantic_core import PydanticUndefined, to_jsonable_python

        keys = []
        for field_name, info in self.config_model.model_fields.items():
            if info.default is not PydanticUndefined:
                default = to_jsonable_python(info.default, fallback=repr)
            elif info.default_factory is not None:
                default = to_jsonable_python(_call_default_factory(info.default_factory),
                                             fallback=repr)
            else:
                default = None
            keys.append({
                "key": info.alias or field_name,
                "type": _type_name(info.annotation),
                "required": info.is_required(),
                "default": default,
                "description": info.description or "",
            })
        return keys


def _call_default_factory(factory: Callable[..., Any]) -> Any:
    try:
        return factory()
    except TypeError:  # a factory of the validated data: no value without a config
        return None


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


@dataclass(frozen=True)
class Conflict:
    """One name of one kind registered by several plugins (so none of them is used)."""

    kind: str
    name: str
    specs: tuple[ComponentSpec, ...]

    def error(self) -> DuplicateComponentError:
        """The error a lookup of this name raises."""
        owners = {spec.owner.name: spec.owner.label() for spec in self.specs}
        return DuplicateComponentError(self.kind.replace("_", " "), self.name, owners)


@dataclass(frozen=True)
class Shadowed:
    """A plugin's registration of a name reasonctl itself registers: not used."""

    spec: ComponentSpec
    builtin: ComponentSpec

    @property
    def message(self) -> str:
        """Why the registration is not used and what to do about it."""
        kind, name = self.spec.kind.replace("_", " "), self.spec.name
        return (
            f"{self.spec.label} is not used: {name!r} is a built-in {kind} of reasonctl, and "
            f"configs naming {name!r} keep getting the built-in. Register it under a name of "
            f"its own (e.g. '{self.spec.owner.name.replace('-', '_')}_{name}'), or block "
            f"reasonctl's with REASONCTL_DISABLE_PLUGINS={self.builtin.owner.name} to use "
            "this one instead"
        )


def _in_use(specs: list[ComponentSpec]) -> list[ComponentSpec]:
    """The registrations of one name that compete for it: reasonctl's own if it has one,
    else all of them (one is usable; several are a conflict)."""
    first_party = [s for s in specs if s.owner.distribution == FIRST_PARTY]
    return first_party or specs


@dataclass
class Registry:
    """All components known to a plugin host, by kind and name.

    ``contracts`` maps a kind to the Protocol its built components are checked against.
    """

    contracts: Mapping[str, type | tuple[type, ...]] = field(default_factory=dict)
    registrations: dict[str, dict[str, list[ComponentSpec]]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS}
    )
    unavailable_hint: str = ""

    def add(self, spec: ComponentSpec) -> None:
        """Record a registration; a second one of the same kind and name makes a conflict."""
        self.registrations[spec.kind].setdefault(spec.name, []).append(spec)

    def remove_owner(self, plugin_name: str) -> None:
        """Forget every component registered by ``plugin_name``."""
        for by_name in self.registrations.values():
            for name, specs in list(by_name.items()):
                kept = [s for s in specs if s.owner.name != plugin_name]
                if kept:
                    by_name[name] = kept
                else:
                    del by_name[name]

    def get(self, kind: str, name: str) -> ComponentSpec:
        """The usable component ``name`` of ``kind``.

        Raises a :class:`~reasonctl.core.errors.ComponentUnavailableError` subclass: unknown
        (with suggestions), claimed by several plugins, or broken.
        """
        specs = self.registrations[kind].get(name)
        if not specs:
            raise UnknownComponentError(
                kind.replace("_", " "), name, self.available(kind), self.unavailable_hint
            )
        competing = _in_use(specs)
        if len(competing) > 1:
            raise Conflict(kind, name, tuple(competing)).error()
        spec = competing[0]
        if spec.problem:
            raise BrokenComponentError(
                kind.replace("_", " "), name, spec.owner.label(), spec.problem
            )
        return spec

    def available(self, kind: str) -> dict[str, str]:
        """Usable names of ``kind`` mapped to their owner labels."""
        return {spec.name: spec.owner.label() for spec in self.all() if spec.kind == kind}

    def names(self, kind: str) -> list[str]:
        """Sorted usable names of ``kind``."""
        return sorted(self.available(kind))

    def all(self) -> list[ComponentSpec]:
        """Every usable component (conflicting, shadowed and broken ones left out)."""
        usable = []
        for by_name in self.registrations.values():
            for specs in by_name.values():
                competing = _in_use(specs)
                if len(competing) == 1 and not competing[0].problem:
                    usable.append(competing[0])
        return usable

    def conflicts(self) -> list[Conflict]:
        """Every name registered by more than one plugin, none of them reasonctl."""
        return [
            Conflict(kind, name, tuple(_in_use(specs)))
            for kind, by_name in self.registrations.items()
            for name, specs in by_name.items() if len(_in_use(specs)) > 1
        ]

    def shadowed(self) -> list[Shadowed]:
        """Every registration by another plugin of a name reasonctl registers."""
        out = []
        for by_name in self.registrations.values():
            for specs in by_name.values():
                competing = _in_use(specs)
                if len(competing) == 1 and len(specs) > 1:
                    out += [Shadowed(spec, competing[0]) for spec in specs
                            if spec is not competing[0]]
        return out

    def broken(self) -> list[ComponentSpec]:
        """Every component whose factory cannot be called as the contract says."""
        return [
            spec for by_name in self.registrations.values()
            for specs in by_name.values() for spec in specs if spec.problem
        ]

    def owned_by(self, plugin_name: str) -> list[ComponentSpec]:
        """Every registration made by ``plugin_name``, usable or not."""
        return [
            spec for by_name in self.registrations.values()
            for specs in by_name.values() for spec in specs if spec.owner.name == plugin_name
        ]


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
        """Register ``factory`` under ``name`` for this hook's component kind.

        A factory that cannot be called as ``factory(config)`` (plus ``ctx=`` when it
        declares ``ctx``) is recorded as broken with the reason; the plugin's other
        components are unaffected.
        """
        if not name or not isinstance(name, str):
            raise ValueError(f"{self._owner.name}: component names must be non-empty strings")
        if not description:
            doc = (getattr(factory, "__doc__", None) or "").strip()
            description = doc.splitlines()[0] if doc else ""
        shape = inspect_factory(factory)
        problem = shape.problem
        if config_model is not None and not (
            isinstance(config_model, type) and issubclass(config_model, BaseModel)
        ):
            config_model, problem = None, (
                f"its config_model {config_model!r} is not a pydantic BaseModel subclass"
            )
        contract = self._registry.contracts.get(self._kind)
        if not problem and contract is not None:
            problem = product_problem(factory, contract)
        self._registry.add(
            ComponentSpec(
                self._kind, name, factory, self._owner, config_model, description,
                contract=contract, takes_ctx=shape.takes_ctx, problem=problem,
            )
        )
