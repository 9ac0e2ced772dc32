"""The factory contract: checked at registration; built objects checked against Protocols."""

from __future__ import annotations

import functools
from typing import Any, Protocol

import pytest
from pydantic import BaseModel

import reasonctl
from reasonctl.core.contracts import inspect_factory, missing_members, required_members
from reasonctl.core.errors import (
    BrokenComponentError,
    ComponentContractError,
    ComponentUnavailableError,
    PluginLoadError,
)
from reasonctl.core.plugins import PluginHost
from reasonctl.core.protocols import Algorithm, Dataset, Reward
from reasonctl.testing import build_component


class Options(BaseModel):
    scale: float = 1.0


class RLOO:
    """An algorithm that forgot the resume half of the protocol."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def setup(self, ctx: Any) -> None:
        pass

    def step(self, ctx: Any) -> dict[str, float]:
        return {}


class CompleteAlgorithm(RLOO):
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def scaled_reward(config: Options) -> Any:
    return lambda completions, samples: [config.scale] * len(completions)


def reward_needing_a_tokenizer(config: Any, tokenizer: Any) -> Any:
    return lambda completions, samples: [0.0] * len(completions)


class MixedPlugin:
    """One good reward, one broken factory, one algorithm missing members."""

    @reasonctl.hookimpl
    def register_rewards(self, register):
        register("scaled", scaled_reward, config_model=Options)
        register("needs_tokenizer", reward_needing_a_tokenizer)
        register("not_callable", 42)

    @reasonctl.hookimpl
    def register_algorithms(self, register):
        register("rloo", lambda config: RLOO(config))  # what it builds is known only then
        register("rloo_class", RLOO)
        register("complete", CompleteAlgorithm)
        register("forgot_return", lambda config: None)


@pytest.fixture
def host() -> PluginHost:
    host = PluginHost.load(entry_points=False)
    record = host.add_plugin(MixedPlugin(), name="mixed")
    assert record.status == "ok"
    return host


def test_broken_factory_is_reported_and_siblings_work(host):
    with pytest.raises(BrokenComponentError) as info:
        host.registry.get("reward", "needs_tokenizer")
    message = str(info.value)
    assert "reward 'needs_tokenizer' (mixed) cannot be used" in message
    assert "requires 'tokenizer'" in message and "reward_needing_a_tokenizer" in message
    assert isinstance(info.value, ComponentUnavailableError)
    with pytest.raises(BrokenComponentError, match="42 is not callable"):
        host.registry.get("reward", "not_callable")
    reward = host.registry.get("reward", "scaled").build({"scale": 0.5})
    assert reward(["a", "b"], [None, None]) == [0.5, 0.5]
    assert host.registry.names("reward") == ["scaled"]
    assert {s.name for s in host.registry.broken()} == {"needs_tokenizer", "not_callable",
                                                        "rloo_class"}
    report = host.describe()
    assert {b["name"] for b in report["broken"]} == {"needs_tokenizer", "not_callable",
                                                     "rloo_class"}
    statuses = {c["name"]: c["status"] for c in report["components"]["reward"]}
    assert statuses == {"needs_tokenizer": "broken", "not_callable": "broken", "scaled": "ok"}


def test_broken_factory_is_fatal_in_strict_mode():
    strict = PluginHost.load(entry_points=False, strict=True)
    with pytest.raises(PluginLoadError, match="requires 'tokenizer'"):
        strict.add_plugin(MixedPlugin(), name="mixed")


def test_built_object_is_checked_against_its_protocol(host):
    with pytest.raises(ComponentContractError) as info:
        host.registry.get("algorithm", "rloo").build()
    assert str(info.value).startswith(
        "algorithm 'rloo' (mixed): RLOO lacks state_dict, load_state_dict required by the "
        "Algorithm protocol"
    )
    assert isinstance(host.registry.get("algorithm", "complete").build(), CompleteAlgorithm)
    with pytest.raises(ComponentContractError, match="returned None instead of a Algorithm"):
        host.registry.get("algorithm", "forgot_return").build()


def test_owner_label_names_the_distribution(tmp_path, monkeypatch):
    from tests.fake_dist import make_distribution

    code = (
        "import reasonctl\n"
        "class RLOO:\n"
        "    def __init__(self, config): pass\n"
        "    def setup(self, ctx): pass\n"
        "    def step(self, ctx): return {}\n"
        "@reasonctl.hookimpl\n"
        "def register_algorithms(register):\n"
        "    register('rloo', RLOO)\n"
    )
    site = make_distribution(tmp_path / "site", "reasonctl-rloo", "0.1", {"rloo_plugin": code},
                             {"rloo": "rloo_plugin"})
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(BrokenComponentError,
                       match=r"^algorithm 'rloo' \(reasonctl-rloo 0.1\) cannot be used: its "
                             r"class RLOO lacks state_dict, load_state_dict required by the "
                             r"Algorithm protocol"):
        PluginHost.load().registry.get("algorithm", "rloo")


def test_ctx_is_passed_only_to_factories_that_declare_it():
    calls: list[tuple[Any, ...]] = []

    def plain(config):
        calls.append(("plain", config))
        return lambda completions, samples: []

    def with_ctx(config, ctx):
        calls.append(("with_ctx", config, ctx))
        return lambda completions, samples: []

    def keyword_ctx(config, *, ctx=None):
        calls.append(("keyword_ctx", config, ctx))
        return lambda completions, samples: []

    def any_keywords(config, **kwargs):
        calls.append(("any_keywords", config, kwargs))
        return lambda completions, samples: []

    class Plugin:
        @reasonctl.hookimpl
        def register_rewards(self, register):
            for factory in (plain, with_ctx, keyword_ctx, any_keywords):
                register(factory.__name__, factory)

    for name in ("plain", "with_ctx", "keyword_ctx", "any_keywords"):
        build_component(Plugin(), "reward", name, ctx="the-context")
    assert calls == [
        ("plain", None),
        ("with_ctx", None, "the-context"),
        ("keyword_ctx", None, "the-context"),
        ("any_keywords", None, {"ctx": "the-context"}),
    ]


@pytest.mark.parametrize(
    ("factory", "takes_ctx", "problem"),
    [
        (lambda config: None, False, ""),
        (lambda config, ctx: None, True, ""),
        (lambda config, *, ctx: None, True, ""),
        (lambda config, extra=1, **kwargs: None, True, ""),
        (lambda *args: None, False, ""),
        (RLOO, False, ""),
        (functools.partial(lambda config, tokenizer: None, tokenizer=1), False, ""),
        (lambda: None, False, "no positional parameter to receive the config"),
        (lambda *, config: None, False, "no positional parameter to receive the config"),
        (lambda ctx: None, False, "is named 'ctx' but receives the config"),
        (lambda config, ctx, /: None, False, "requires 'ctx'"),
        (lambda config, tokenizer, *, model: None, False, "requires 'tokenizer', 'model'"),
        ("not a function", False, "is not callable"),
    ],
)
def test_inspect_factory(factory, takes_ctx, problem):
    shape = inspect_factory(factory)
    assert shape.takes_ctx == takes_ctx
    if problem:
        assert problem in shape.problem
    else:
        assert shape.problem == ""


def test_a_config_model_that_is_not_a_pydantic_model_breaks_the_component():
    class Plugin:
        @reasonctl.hookimpl
        def register_rewards(self, register):
            register("dict_config", scaled_reward, config_model=dict)

    with pytest.raises(BrokenComponentError, match="not a pydantic BaseModel subclass"):
        build_component(Plugin(), "reward", "dict_config")


def test_required_members_follow_the_protocol():
    assert required_members(Algorithm) == ("setup", "step", "state_dict", "load_state_dict")
    assert set(required_members(Dataset)) == {"__len__", "__getitem__"}
    assert required_members(Reward) == ("__call__",)

    class Sized(Protocol):
        size: int

        def __len__(self) -> int: ...

        def _private_helper(self) -> None: ...

    class Grown(Sized, Protocol):
        @property
        def shape(self) -> tuple[int, ...]: ...

        def resize(self, n: int) -> None: ...

    assert required_members(Grown) == ("size", "__len__", "shape", "resize")

    class HasAll:
        size = 1
        shape = (1,)

        def __len__(self) -> int:
            return 1

        def resize(self, n: int) -> None:
            pass

    class Proxy:  # members served by __getattr__ count as present
        def __getattr__(self, name: str) -> Any:
            if name in {"size", "shape", "resize"}:
                return 1
            raise AttributeError(name)

    assert missing_members(HasAll(), Grown) == []
    assert missing_members(Proxy(), Grown) == ["__len__"]
    proxy = Proxy()
    proxy.__len__ = lambda: 1  # dunders are looked up on the type, as len() does
    assert missing_members(proxy, Grown) == ["__len__"]
    assert missing_members(object(), Grown) == ["size", "__len__", "shape", "resize"]


def test_builtin_components_satisfy_their_protocols():
    host = PluginHost.load()
    reward = host.registry.get("reward", "exact_match").build()
    assert missing_members(reward, Reward) == []
    storage = host.registry.get("storage", "file").build()
    assert type(storage).__name__ == "LocalStorage"
    for spec in host.registry.all():  # every built-in factory passed the registration check
        assert spec.problem == ""


class HalfwayLogger:
    """A logger that forgot ``close``."""

    def __init__(self, config: Any) -> None:
        pass

    def log(self, metrics: Any, step: int) -> None:
        pass


class NoWeightsEngine:
    def generate(self, prompts: Any, params: Any) -> list[Any]:
        return []


def build_no_weights_engine(config: Any, ctx: Any) -> NoWeightsEngine:
    return NoWeightsEngine()


class ProxyLogger:
    """Serves its members through ``__getattr__``: only the built object can tell."""

    def __init__(self, config: Any) -> None:
        self.inner = HalfwayLogger(config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class StreamOfNothing:
    """A streamed dataset (``StreamsSamples``): ``samples_per_epoch`` is set per instance."""

    def __init__(self, config: Any) -> None:
        self.samples_per_epoch = None

    def iterate(self, rank: int, world_size: int, state: Any) -> Any:
        return iter(())


class IncompletePlugin:
    @reasonctl.hookimpl
    def register_loggers(self, register):
        register("halfway", HalfwayLogger)
        register("proxy", ProxyLogger)

    @reasonctl.hookimpl
    def register_rollout_engines(self, register):
        register("no_weights", build_no_weights_engine)

    @reasonctl.hookimpl
    def register_datasets(self, register):
        register("nothing", StreamOfNothing)


def test_a_component_missing_a_method_is_refused_when_registered():
    host = PluginHost.load(entry_points=False)
    host.add_plugin(IncompletePlugin(), name="incomplete")
    broken = {spec.name: spec.problem for spec in host.registry.broken()}
    assert broken == {
        "halfway": "its class HalfwayLogger lacks close required by the Logger protocol (see "
                   "reasonctl.Logger)",
        "no_weights": "its class NoWeightsEngine lacks update_weights required by the "
                      "RolloutEngine protocol (see reasonctl.RolloutEngine)",
    }
    assert sorted(host.registry.names("logger")) == ["proxy"]
    assert host.registry.names("dataset") == ["nothing"]
    # a config naming it is refused with every other problem, before anything is built
    with pytest.raises(reasonctl.ConfigError) as info:
        reasonctl.load_config(plugins=[IncompletePlugin()], values={
            "logging": {"loggers": ["console", "halfway"]}, "rollout": {"engine": "no_weights"}})
    problems = "\n".join(info.value.problems)
    assert "logger 'halfway' (IncompletePlugin) cannot be used: its class HalfwayLogger lacks " \
           "close" in problems
    assert "rollout engine 'no_weights' (IncompletePlugin) cannot be used: its class " \
           "NoWeightsEngine lacks update_weights" in problems
