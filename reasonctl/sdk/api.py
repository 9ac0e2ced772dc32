"""The programmatic entry points: everything the CLI does is one call away.

Nothing here is global: each :func:`run` builds its own :class:`PluginHost`, adds the
Python objects passed in as a run-local plugin, and discards it afterwards, so two runs in
one process never see each other's components.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from reasonctl.core.config import (
    RunConfig,
    build_config_model,
    deep_merge,
    validate_config,
)
from reasonctl.core.config import load_config as _load_config
from reasonctl.core.plugins import PluginHost, hookimpl
from reasonctl.core.protocols import RunContext
from reasonctl.core.registry import ComponentSpec
from reasonctl.runtime.composition import preflight
from reasonctl.runtime.runner import RunResult
from reasonctl.runtime.runner import run as _run

RewardLike = Callable[..., Any] | tuple[Callable[..., Any], float]
ADHOC_DATASET = "sdk"


def plugin_host(plugins: Iterable[Any] = (), *, strict: bool | None = None) -> PluginHost:
    """A fresh host with installed plugins plus ``plugins`` (modules or objects)."""
    host = PluginHost.load(strict=strict)
    for plugin in plugins:
        host.add_plugin(plugin)
    return host


def load_config(
    paths: str | Path | Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    *,
    plugins: Iterable[Any] = (),
    values: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Load TOML files, environment and ``a.b=value`` overrides into a validated config.

    ``plugins`` are extra plugin objects whose components the config may name.
    """
    host = plugin_host(plugins)
    return _load_config(paths, overrides, registry=host.registry, values=values)


def list_components(kind: str, *, plugins: Iterable[Any] = ()) -> list[str]:
    """Names of the registered components of ``kind`` (``algorithm``, ``reward``, ...)."""
    return plugin_host(plugins).registry.names(kind)


def get_component(kind: str, name: str, *, plugins: Iterable[Any] = ()) -> ComponentSpec:
    """The registration of component ``name`` of ``kind``: its ``owner``, ``config_model``
    and ``description`` (raises a did-you-mean error if unknown). :func:`build_component`
    builds it."""
    return plugin_host(plugins).registry.get(kind, name)


CONFIG_SECTIONS: dict[str, str] = {
    "dataset": "data",
    "algorithm": "algorithm",
    "backend": "backend",
    "rollout_engine": "rollout",
    "logger": "logging",
    "storage": "storage",
}
"""Component kind -> the config section holding ``[<section>.<name>]`` (rewards have none:
their options are the extra keys of a ``[[rewards.components]]`` entry)."""


def build_component(kind: str, name: str, config: Any = None, *, ctx: RunContext | None = None,
                    plugins: Iterable[Any] = ()) -> Any:
    """Build the registered component ``name`` of ``kind`` as a run builds it.

    For a component that builds another (an engine wrapping an engine, a command that
    uploads through a storage scheme). With ``ctx`` (the :class:`RunContext` your factory
    received) the name is looked up among the run's plugins, the factory receives that
    ``ctx`` when it declares one, and ``config`` defaults to the run's own section of the
    component (``[rollout.<name>]``, ``[storage.<name>]`` ...). Without ``ctx`` the
    installed plugins plus ``plugins`` are searched and ``config`` defaults to the config
    model's defaults. ``config`` may be a mapping or an instance of the component's config
    model. The built object is checked against its kind's Protocol.

    Raises :class:`~reasonctl.core.errors.ComponentUnavailableError` (unknown, claimed by
    two plugins, or broken) and :class:`~reasonctl.core.errors.ComponentContractError`.
    """
    if ctx is not None and plugins:
        raise TypeError("build_component: pass plugins only without ctx (a run's context "
                        "already holds its plugins)")
    registry = ctx.registry if ctx is not None else plugin_host(plugins).registry
    spec = registry.get(kind, name)
    section = CONFIG_SECTIONS.get(kind)
    if config is None and ctx is not None and section is not None:
        config = ctx.component_config(section, name)
    return spec.build(config, ctx=ctx)


class _AdhocPlugin:
    """Run-local components passed to :func:`run` as Python objects."""

    def __init__(self, rewards: dict[str, Callable[..., Any]], datasets: dict[str, Any]) -> None:
        self.rewards = rewards
        self.datasets = datasets

    @hookimpl
    def register_rewards(self, register: Any) -> None:
        from reasonctl.core.callables import as_reward

        for name, fn in self.rewards.items():
            register(name, lambda _cfg, fn=fn: as_reward(fn), description="SDK callable")

    @hookimpl
    def register_datasets(self, register: Any) -> None:
        from reasonctl.data.datasets import as_dataset

        for name, obj in self.datasets.items():
            register(name, lambda _cfg, obj=obj: as_dataset(obj), description="SDK dataset")


def run(
    config: RunConfig | str | Path | Mapping[str, Any],
    *,
    rewards: Sequence[RewardLike] | Mapping[str, Callable[..., Any]] = (),
    datasets: Any = None,
    plugins: Iterable[Any] = (),
    plugin_manager: PluginHost | None = None,
    overrides: Iterable[str] = (),
) -> RunResult:
    """Run training and return a :class:`~reasonctl.runtime.runner.RunResult`.

    ``config`` is a :class:`RunConfig`, a TOML path or a plain mapping. ``rewards`` are
    Python callables (optionally ``(callable, weight)`` pairs, or a name -> callable
    mapping); each is added to ``[[rewards.components]]`` unless the config already names
    it. ``datasets`` is a dataset object or list of samples (used as ``data.format = "sdk"``)
    or a name -> dataset mapping. ``plugins`` are extra plugin objects;
    ``plugin_manager`` replaces the default host entirely.
    """
    resolved, host = resolve_run_config(config, rewards=rewards, datasets=datasets,
                                        plugins=plugins, plugin_manager=plugin_manager,
                                        overrides=overrides)
    preflight(resolved, host.registry)
    return _run(resolved, host=host)


def resolve_run_config(
    config: RunConfig | str | Path | Mapping[str, Any],
    *,
    rewards: Sequence[RewardLike] | Mapping[str, Callable[..., Any]] = (),
    datasets: Any = None,
    plugins: Iterable[Any] = (),
    plugin_manager: PluginHost | None = None,
    overrides: Iterable[str] = (),
) -> tuple[RunConfig, PluginHost]:
    """The validated config and the plugin host of :func:`run`'s arguments (the Python
    rewards and datasets registered as a run-local plugin, overrides applied)."""
    host = plugin_manager or plugin_host(plugins)
    reward_fns, reward_weights = _normalise_rewards(rewards)
    dataset_map: dict[str, Any] = {}
    if datasets is not None:
        dataset_map = dict(datasets) if isinstance(datasets, Mapping) else {ADHOC_DATASET: datasets}
    registered = host.registry.available("reward")
    for name in reward_fns:
        if name in registered:  # it would not be used (a built-in) or clash (a plugin's)
            raise ValueError(f"the Python reward {name!r} has the name of the registered reward "
                             f"{name!r} ({registered[name]}); pass it under a name of its own, "
                             f"e.g. rewards={{'my_{name}': {name}}}")
    if reward_fns or dataset_map:
        host.add_plugin(_AdhocPlugin(reward_fns, dataset_map), name="sdk")

    if isinstance(config, RunConfig):
        data = config.model_dump(mode="json", by_alias=True, exclude_unset=True)
    elif isinstance(config, (str, Path)):
        from reasonctl.core.config import read_toml

        data = read_toml(config)
    else:
        data = deep_merge({}, config)
    named = {c.get("name") for c in data.get("rewards", {}).get("components", [])}
    extra = [{"name": n, "weight": reward_weights[n]} for n in reward_fns if n not in named]
    if extra:
        data.setdefault("rewards", {}).setdefault("components", []).extend(extra)
    if datasets is not None and not isinstance(datasets, Mapping):
        data.setdefault("data", {})["format"] = ADHOC_DATASET
    model = build_config_model(host.registry)
    if overrides:
        from reasonctl.core.config import parse_override, set_path

        for text in overrides:
            key, value = parse_override(text)
            set_path(data, key, value)
    return validate_config(_strip_none(data), model, host.registry), host


def _normalise_rewards(
    rewards: Sequence[RewardLike] | Mapping[str, Callable[..., Any]],
) -> tuple[dict[str, Callable[..., Any]], dict[str, float]]:
    fns: dict[str, Callable[..., Any]] = {}
    weights: dict[str, float] = {}
    items: Iterable[Any] = rewards.items() if isinstance(rewards, Mapping) else rewards
    for item in items:
        if isinstance(rewards, Mapping):
            name, fn = item
            weight = 1.0
        elif isinstance(item, tuple):
            fn, weight = item
            name = getattr(fn, "__name__", type(fn).__name__)
        else:
            fn, weight = item, 1.0
            name = getattr(fn, "__name__", type(fn).__name__)
        if name in fns:
            raise ValueError(f"two SDK rewards are both named {name!r}; pass a mapping to rename")
        fns[name] = fn
        weights[name] = float(weight)
    return fns, weights


def _strip_none(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _strip_none(v) for k, v in data.items() if v is not None}
    if isinstance(data, list):
        return [_strip_none(v) for v in data]
    return data
