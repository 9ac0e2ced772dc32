"""Sections contributed by plugins, validated strictly, and the JSON Schema of it all.

The ``config_model`` a component registers becomes ``[algorithm.<name>]``,
``[backend.<name>]``, ``[data.<name>]``, ``[rollout.<name>]``, ``[logging.<name>]``,
``[storage.<name>]`` or ``[environment.<name>]``; a reward's model validates the extra
keys of its ``[[rewards.components]]`` entry. Unknown keys are errors in every one of them, nested
models included, even when the plugin's model does not say ``extra="forbid"``; only a model
that says ``extra="allow"`` itself accepts free keys. A NaN or infinite number is an error
in every one of them too. Factories still receive an instance of the plugin's own model
class.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
)
from pydantic.json_schema import models_json_schema

from reasonctl.core.config.schema import (
    AlgorithmSection,
    BackendSection,
    DataSection,
    EnvironmentSection,
    LoggingSection,
    RewardComponent,
    RolloutSection,
    RunConfig,
    Section,
    StorageSection,
    field_name,
)
from reasonctl.core.errors import ConfigError

if TYPE_CHECKING:
    from reasonctl.core.registry import Registry

SECTION_KINDS: dict[str, tuple[str, type[Section]]] = {
    "algorithm": ("algorithm", AlgorithmSection),
    "backend": ("backend", BackendSection),
    "data": ("dataset", DataSection),
    "rollout": ("rollout_engine", RolloutSection),
    "logging": ("logger", LoggingSection),
    "storage": ("storage", StorageSection),
    "environment": ("environment", EnvironmentSection),
}
"""Config section -> (component kind whose config models it holds, base section model)."""

ALWAYS_CHECKED = ("algorithm", "backend")
"""Selectors checked even at their defaults; others only when the config sets them (the
component that uses them checks its own default when it builds it)."""

SELECTORS: dict[str, tuple[str, str]] = {
    "algorithm.name": ("algorithm", "algorithm"),
    "backend.name": ("backend", "backend"),
    "data.format": ("dataset", "dataset format"),
    "rollout.engine": ("rollout_engine", "rollout engine"),
    "environment.name": ("environment", "environment"),
}


def validate_strictly(model: type[BaseModel], values: Any) -> BaseModel:
    """``values`` validated by ``model`` with unknown keys forbidden at every level and no
    NaN or infinity in any number the values set.

    Models that set ``extra="allow"`` themselves keep accepting free keys. Raises
    pydantic's ``ValidationError``.
    """
    extra = None if model.model_config.get("extra") == "allow" else "forbid"
    instance = model.model_validate(values, extra=extra)
    bad = list(_non_finite(instance, ()))
    if bad:
        raise ValidationError.from_exception_data(
            model.__name__,
            [{"type": "finite_number", "loc": loc, "input": value} for loc, value in bad],
        )
    return instance


def _non_finite(value: Any, loc: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], float]]:
    """Locations of NaN or infinite floats among the fields set in ``value`` (not defaults)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield loc, value
    elif isinstance(value, BaseModel):
        fields = type(value).model_fields
        for name in value.model_fields_set:
            key = fields[name].alias or name if name in fields else name
            yield from _non_finite(getattr(value, name, None), (*loc, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _non_finite(item, (*loc, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, (*loc, key))


def strict_field(model: type[BaseModel]) -> Any:
    """The annotation of a plugin section: ``model | None``, validated strictly."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, Mapping):
            return validate_strictly(model, value)
        return handler(value)

    return Annotated[model | None, WrapValidator(validate)]


def build_config_model(registry: Registry) -> type[RunConfig]:
    """A :class:`RunConfig` subclass with a typed sub-section for every registered component."""
    fields: dict[str, Any] = {}
    for section, (kind, base) in SECTION_KINDS.items():
        extra: dict[str, Any] = {}
        for spec in registry.all():
            if spec.kind != kind or spec.config_model is None:
                continue
            name = field_name(spec.name)
            if name in base.model_fields:
                raise ConfigError(
                    [f"{section}.{spec.name}: component name collides with a built-in key "
                     f"of [{section}] (registered by {spec.owner.label()})"]
                )
            extra[name] = (
                strict_field(spec.config_model),
                Field(default=None, alias=spec.name, description=spec.description),
            )
        if extra:
            model = create_model(  # type: ignore[call-overload]
                f"{base.__name__}WithPlugins", __base__=base, __config__=None, **extra
            )
            model.model_config["populate_by_name"] = True
            model.model_rebuild(force=True)
            fields[section] = (model, Field(default_factory=model))
    return create_model("RunConfigWithPlugins", __base__=RunConfig, **fields)  # type: ignore[call-overload]


def config_json_schema(registry: Registry) -> dict[str, Any]:
    """JSON Schema of the config, plugin sections and every reward's options included.

    Each ``[[rewards.components]]`` entry matches one registered reward (its ``name``, its
    ``weight`` and its options) or a ``module:function`` reward without options; every table
    but a reward entry forbids unknown keys, as validation does.
    """
    model = build_config_model(registry)
    rewards = [s for s in registry.all() if s.kind == "reward"]
    with_options = [s for s in rewards if s.config_model is not None]
    keyed, schema = models_json_schema(
        [(model, "validation"), *((s.config_model, "validation") for s in with_options)],
        by_alias=True,
    )
    defs = schema.get("$defs", {})
    for definition in defs.values():
        if definition.get("type") == "object":
            definition.setdefault("additionalProperties", False)
    entry = defs.get(RewardComponent.__name__)
    if entry is not None:
        variants = [_reward_variant(s.name, s.description, entry) for s in rewards
                    if s.config_model is None]
        for spec in with_options:
            ref = keyed[(spec.config_model, "validation")]["$ref"]
            options = defs[ref.rsplit("/", 1)[-1]]
            variants.append(_reward_variant(spec.name, spec.description, entry, options))
        variants.append(_reward_variant(None, "A module:function reward (no options).", entry))
        defs[RewardComponent.__name__] = {"anyOf": variants,
                                         "description": RewardComponent.__doc__}
    root = keyed[(model, "validation")]["$ref"].rsplit("/", 1)[-1]
    return {**defs.pop(root), "$defs": defs}


def _reward_variant(name: str | None, description: str, entry: dict[str, Any],
                    options: dict[str, Any] | None = None) -> dict[str, Any]:
    properties = dict(entry.get("properties", {}))
    properties["name"] = {"const": name} if name else {"type": "string", "pattern": ":"}
    properties.update((options or {}).get("properties", {}))
    return {
        "type": "object",
        "title": name or "module:function",
        "description": description,
        "properties": properties,
        "required": sorted({"name", *(options or {}).get("required", [])}),
        "additionalProperties": False,
    }
