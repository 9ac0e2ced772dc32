"""Loading a configuration: merge the sources, validate everything, report every problem.

One pass collects the problems of every kind together, so a single run of
``reasonctl config validate`` lists them all: unreadable files and malformed overrides,
misspelt ``REASONCTL_*`` variables, schema errors (unknown keys with did-you-mean, wrong
types, out-of-range values), unknown component names and the options of every
``[[rewards.components]]`` entry.
"""

from __future__ import annotations

import copy
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
VALID_PART_ROUNDS = 5
_LEFT_OUT = object()


class ConfigWarning(UserWarning):
    """Something in the config is legal but probably not what was meant."""


class InvalidConfigError(ConfigError):
    """The :class:`ConfigError` of :func:`validate_config`, with what is valid in the config.

    ``valid_part`` is the config with every invalid value left out (defaults in their
    place), so the checks of the outside world can still run on the rest and report their
    problems in the same round; ``left_out`` holds the dotted paths left out. It is
    ``None`` when that config cannot stand for the user's: a config file could not be
    read, or a component name (``algorithm.name`` ...) was invalid.
    """

    def __init__(self, problems: list[str], *, valid_part: RunConfig | None = None,
                 left_out: Iterable[str] = ()) -> None:
        super().__init__(problems)
        self.valid_part = valid_part
        self.left_out = tuple(left_out)

    def covers(self, problem: str) -> bool:
        """Whether ``problem`` (a ``path: message`` line) is about a value left out."""
        return any(problem.startswith(path) and problem[len(path):len(path) + 1] in (":", ".")
                   for path in self.left_out)


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
        valid_part, left_out = None, []
        if sources is None or not sources.unread_files:
            valid_part, left_out = _valid_part(data, model, registry, [i.loc for i in issues])
        if any(path in SELECTORS for path in left_out):
            valid_part = None  # the config would stand for other components than the user's
        raise InvalidConfigError(problems, valid_part=valid_part, left_out=left_out)
    assert config is not None
    remember_secret_variables(secret_variables_named_in(config.to_dict(redact=False)))
    return config


def _valid_part(data: dict[str, Any], model: type[RunConfig], registry: Registry,
                locs: list[tuple[Any, ...]]) -> tuple[RunConfig | None, list[str]]:
    """``data`` validated with the values at ``locs`` left out, and again with what that
    round still finds invalid, for a few rounds; the config (``None`` if none validates)
    and the dotted paths left out."""
    pruned = copy.deepcopy(data)
    left_out: list[str] = []
    for _ in range(VALID_PART_ROUNDS):
        for loc in locs:
            removed = _leave_out(pruned, loc)
            if removed is not None:
                left_out.append(".".join(str(part) for part in removed))
        pruned = _without_left_out(pruned)
        try:
            config = model.model_validate(pruned)
        except ValidationError as exc:
            locs = [issue.loc for issue in validation_issues(exc, model)]
            continue
        issues = component_name_issues(pruned, registry) + reward_option_issues(pruned,
                                                                                registry)
        if not issues:
            return config, left_out
        locs = [issue.loc for issue in issues]
    return None, left_out


def _leave_out(data: Any, loc: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Mark the value at ``loc`` left out (or the nearest enclosing value present, for a
    missing key); the location marked, if any."""
    while loc:
        node = data
        for part in loc[:-1]:
            node = _child(node, part)
        last = loc[-1]
        if isinstance(node, dict) and last in node:
            node[last] = _LEFT_OUT
            return loc
        if isinstance(node, list) and isinstance(last, int) and 0 <= last < len(node):
            node[last] = _LEFT_OUT
            return loc
        loc = loc[:-1]
    return None


def _child(node: Any, part: Any) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def _without_left_out(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _without_left_out(v) for k, v in data.items() if v is not _LEFT_OUT}
    if isinstance(data, list):
        return [_without_left_out(v) for v in data if v is not _LEFT_OUT]
    return data


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
