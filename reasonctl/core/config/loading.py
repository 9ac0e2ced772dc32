"""Loading a configuration: merge the sources, validate everything, report every problem.

One pass collects the problems of every kind together, so a single run of
``reasonctl config validate`` lists them all: unreadable files and malformed overrides,
misspelt ``REASONCTL_*`` variables, schema errors (unknown keys with did-you-mean, wrong
types, out-of-range values), unknown component names and the options of every
``[[rewards.components]]`` entry.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from reasonctl.core.config.plugin_sections import (
    ALWAYS_CHECKED,
    SELECTORS,
    build_config_model,
    validate_strictly,
)
from reasonctl.core.config.problems import Issue, validation_issues
from reasonctl.core.config.redaction import remember_secret_variables, secret_variables_named_in
from reasonctl.core.config.schema import RewardComponent, RunConfig
from reasonctl.core.config.sources import ConfigSources, collect_sources
from reasonctl.core.errors import ConfigError, ReasonctlError

if TYPE_CHECKING:
    from reasonctl.core.registry import Registry

REWARD_ENTRY_KEYS = tuple(RewardComponent.model_fields)


class ConfigWarning(UserWarning):
    """Something in the config is legal but probably not what was meant."""


def load_config(
    paths: str | Path | Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    *,
    registry: Registry,
    values: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    on_warning: Callable[[str], None] | None = None,
) -> RunConfig:
    """Load, merge and validate a configuration, reporting all problems at once.

    ``paths`` are TOML files (later wins), ``values`` a mapping such as the CLI's flags
    (``--algo`` ...), ``overrides`` are ``a.b=value`` strings; precedence is ``overrides`` >
    ``values`` > ``REASONCTL_*`` environment (``environ``, default ``os.environ``) > files >
    defaults. ``registry`` holds the plugins' components, whose sections the config may
    set. Warnings (a list a later file replaces) go to ``on_warning``, by default Python's
    :mod:`warnings` as :class:`ConfigWarning`. Raises :class:`ConfigError` listing every
    problem.
    """
    config, _ = load_config_with_sources(paths, overrides, registry=registry, values=values,
                                         environ=environ, on_warning=on_warning)
    return config


def load_config_with_sources(
    paths: str | Path | Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    *,
    registry: Registry,
    values: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    on_warning: Callable[[str], None] | None = None,
) -> tuple[RunConfig, ConfigSources]:
    """:func:`load_config`, also returning where each value came from."""
    model = build_config_model(registry)
    if isinstance(paths, (str, Path)):
        paths = [paths]
    sources = collect_sources(paths, overrides, values=values, environ=environ,
                              sections=list(model.model_fields))
    for message in sources.warnings:
        if on_warning is None:
            warnings.warn(message, ConfigWarning, stacklevel=3)
        else:
            on_warning(message)
    return validate_config(sources.data, model, registry, sources=sources), sources


def validate_config(
    data: dict[str, Any],
    model: type[RunConfig],
    registry: Registry,
    *,
    sources: ConfigSources | None = None,
) -> RunConfig:
    """Validate merged values: source problems, schema errors, unknown component names and
    reward options, all reported together in one :class:`ConfigError`."""
    problems = list(sources.problems) if sources is not None else []
    issues: list[Issue] = []
    config: RunConfig | None = None
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        issues += validation_issues(exc, model)
    issues += component_name_issues(data, registry)
    issues += reward_option_issues(data, registry)
    problems += [issue.format(sources) for issue in issues]
    if problems:
        raise ConfigError(problems)
    assert config is not None
    remember_secret_variables(secret_variables_named_in(config.to_dict(redact=False)))
    return config


def component_name_problems(data: Mapping[str, Any], registry: Registry) -> list[str]:
    """Selector keys (``algorithm.name`` ...) that name no registered component."""
    return [issue.format() for issue in component_name_issues(data, registry)]


def component_name_issues(data: Mapping[str, Any], registry: Registry) -> list[Issue]:
    """:func:`component_name_problems` as located issues."""
    issues = []
    for path, (kind, _label) in SELECTORS.items():
        section, key = path.split(".")
        raw = data.get(section, {})
        name = raw.get(key) if isinstance(raw, Mapping) else None
        if name is None and section in ALWAYS_CHECKED:
            name = getattr(getattr(RunConfig(), section), key)
        if isinstance(name, str) and name:
            issues += _name_issues((section, key), kind, name, registry)
    logging_section = data.get("logging", {})
    loggers = logging_section.get("loggers") if isinstance(logging_section, Mapping) else None
    for index, name in enumerate(loggers if isinstance(loggers, list) else []):
        if isinstance(name, str):
            issues += _name_issues(("logging", "loggers", index), "logger", name, registry)
    for index, entry in _reward_entries(data):
        name = entry.get("name")
        loc = ("rewards", "components", index, "name")
        if isinstance(name, str) and ":" in name:
            issues += _callable_issues(loc, name)
        elif isinstance(name, str) and name:
            issues += _name_issues(loc, "reward", name, registry)
    return issues


def reward_option_issues(data: Mapping[str, Any], registry: Registry) -> list[Issue]:
    """Problems with the options (extra keys) of each ``[[rewards.components]]`` entry."""
    issues = []
    for index, entry in _reward_entries(data):
        name = entry.get("name")
        if not isinstance(name, str):
            continue
        loc = ("rewards", "components", index)
        options = {k: v for k, v in entry.items() if k not in REWARD_ENTRY_KEYS}
        if ":" in name:
            issues += [Issue((*loc, key), f"{name!r} is a module:function reward and takes no "
                                          "options (register it from a plugin with a config "
                                          "model instead)") for key in options]
            continue
        try:
            spec = registry.get("reward", name)
        except ReasonctlError:
            continue  # reported by component_name_issues
        if spec.config_model is None:
            issues += [Issue((*loc, key), f"reward {name!r} takes no options")
                       for key in options]
            continue
        try:
            validate_strictly(spec.config_model, options)
        except ValidationError as exc:
            issues += validation_issues(exc, spec.config_model, loc, REWARD_ENTRY_KEYS)
    return issues


def _reward_entries(data: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    rewards = data.get("rewards", {})
    entries = rewards.get("components") if isinstance(rewards, Mapping) else None
    if not isinstance(entries, list):
        return []
    return [(i, entry) for i, entry in enumerate(entries) if isinstance(entry, Mapping)]


def _name_issues(loc: tuple[Any, ...], kind: str, name: str, registry: Registry) -> list[Issue]:
    try:
        registry.get(kind, name)
    except ReasonctlError as exc:
        return [Issue(loc, str(exc))]
    return []


def _callable_issues(loc: tuple[Any, ...], name: str) -> list[Issue]:
    from reasonctl.core.callables import CallableLoadError, load_callable

    try:
        load_callable(name)
    except CallableLoadError as exc:
        return [Issue(loc, str(exc))]
    return []
