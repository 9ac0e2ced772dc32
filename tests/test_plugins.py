"""Plugin discovery and the error behaviour that keeps the ecosystem pleasant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import reasonctl
from reasonctl.core.errors import (
    ComponentUnavailableError,
    DuplicateComponentError,
    MissingDependencyError,
    PluginLoadError,
    UnknownComponentError,
    require,
)
from reasonctl.core.plugins import PluginHost
from tests.fake_dist import make_distribution


def reward_a(completion, sample):
    return 1.0


class RewardPlugin:
    def __init__(self, name: str) -> None:
        self.name = name

    @reasonctl.hookimpl
    def register_rewards(self, register):
        register(self.name, lambda cfg: reward_a, description="test reward")


class TwoRewardPlugin:
    """Registers the shared name ``same`` and a name of its own."""

    def __init__(self, own: str) -> None:
        self.own = own

    @reasonctl.hookimpl
    def register_rewards(self, register):
        register("same", lambda cfg: reward_a)
        register(self.own, lambda cfg: reward_a)


def test_builtin_plugins_come_from_entry_points():
    host = PluginHost.load()
    builtin = [r for r in host.records if r.distribution == "reasonctl"]
    assert builtin, "no built-in plugin found through entry points"
    assert all(r.version == reasonctl.__version__ for r in builtin)


def test_builtin_entry_points_are_named_kind_dash_name():
    host = PluginHost.load()
    builtin = {r.name for r in host.records if r.distribution == "reasonctl"}
    assert {"algorithm-sft", "algorithm-grpo", "backend-single", "rollout-hf", "rewards",
            "data-jsonl", "storage-s3", "logger-jsonl"} <= builtin
    for spec in host.registry.all():
        if spec.owner.distribution == "reasonctl" and spec.kind != "reward":
            prefix = {"dataset": "data", "rollout_engine": "rollout"}.get(spec.kind, spec.kind)
            assert spec.owner.name == f"{prefix}-{spec.name.replace('_', '-')}"


def test_unknown_component_lists_available_and_suggests():
    host = PluginHost.load(entry_points=False)
    host.add_plugin(RewardPlugin("exact_match"), name="p1")
    with pytest.raises(UnknownComponentError) as info:
        host.registry.get("reward", "exact_mach")
    message = str(info.value)
    assert "Unknown reward 'exact_mach'" in message
    assert "exact_match (p1)" in message
    assert "Did you mean 'exact_match'?" in message
    assert isinstance(info.value, ComponentUnavailableError) and isinstance(info.value, KeyError)


@pytest.mark.parametrize("order", [("first", "second"), ("second", "first")])
def test_duplicate_name_is_unavailable_whatever_the_order(order):
    host = PluginHost.load(entry_points=False)
    for name in order:
        record = host.add_plugin(TwoRewardPlugin(f"only_{name}"), name=name)
        assert record.status == "ok"
    with pytest.raises(DuplicateComponentError) as info:
        host.registry.get("reward", "same")
    message = str(info.value)
    assert "first" in message and "second" in message and "none of them is used" in message
    assert "REASONCTL_DISABLE_PLUGINS=first" in message
    assert "REASONCTL_DISABLE_PLUGINS=second" in message
    assert isinstance(info.value, ComponentUnavailableError)
    # both plugins' other components keep working; the clash is not offered as available
    assert host.registry.get("reward", "only_first").build()("x", None) == 1.0
    assert host.registry.get("reward", "only_second").owner.name == "second"
    assert "same" not in host.registry.names("reward")
    [conflict] = host.registry.conflicts()
    assert (conflict.kind, conflict.name) == ("reward", "same")
    assert {s.owner.name for s in conflict.specs} == {"first", "second"}


def test_duplicate_name_is_fatal_in_strict_mode():
    strict = PluginHost.load(entry_points=False, strict=True)
    strict.add_plugin(RewardPlugin("same"), name="first")
    with pytest.raises(PluginLoadError, match="registered by several plugins"):
        strict.add_plugin(RewardPlugin("same"), name="second")


def test_disabling_one_side_of_a_conflict_resolves_it(tmp_path, monkeypatch):
    code = (
        "import reasonctl\n"
        "@reasonctl.hookimpl\n"
        "def register_rewards(register):\n"
        "    register('same', lambda cfg: (lambda completions, samples: [{score}]))\n"
    )
    for dist, module, score in (("reasonctl-one", "one_plugin", 1.0),
                                ("reasonctl-two", "two_plugin", 2.0)):
        site = make_distribution(tmp_path / dist, dist, "1.0", {module: code.format(score=score)},
                                 {module.replace("_plugin", ""): module})
        monkeypatch.syspath_prepend(str(site))
    with pytest.raises(DuplicateComponentError, match="reasonctl-one 1.0.*reasonctl-two 1.0"):
        PluginHost.load().registry.get("reward", "same")
    monkeypatch.setenv("REASONCTL_DISABLE_PLUGINS", "one")  # by entry-point name
    reward = PluginHost.load().registry.get("reward", "same").build()
    assert reward(["c"], [None]) == [2.0]
    monkeypatch.setenv("REASONCTL_DISABLE_PLUGINS", "reasonctl-two")  # by distribution
    assert PluginHost.load().registry.get("reward", "same").owner.distribution == "reasonctl-one"


def test_misspelled_hook_is_an_error_with_a_suggestion():
    class Misspelled:
        @reasonctl.hookimpl
        def register_reward(self, register):  # missing "s"
            pass

    host = PluginHost.load(entry_points=False)
    record = host.add_plugin(Misspelled(), name="typo")
    assert record.status == "error"
    assert "'register_reward', which is not a reasonctl hook" in record.error
    assert "did you mean 'register_rewards'?" in record.error


def test_hook_without_the_marker_is_an_error():
    class Unmarked:
        def register_rewards(self, register):
            register("never", lambda cfg: reward_a)

    host = PluginHost.load(entry_points=False)
    record = host.add_plugin(Unmarked(), name="unmarked")
    assert record.status == "error"
    assert "'register_rewards' without @reasonctl.hookimpl" in record.error


def test_hook_that_raises_leaves_no_components_behind():
    class Halfway:
        @reasonctl.hookimpl
        def register_rewards(self, register):
            register("registered_first", lambda cfg: reward_a)
            raise RuntimeError("second registration failed")

    host = PluginHost.load(entry_points=False)
    record = host.add_plugin(Halfway(), name="halfway")
    assert record.status == "error" and "second registration failed" in record.error
    with pytest.raises(UnknownComponentError, match="failed to load \\(halfway\\)"):
        host.registry.get("reward", "registered_first")


@pytest.fixture
def broken_site(tmp_path, monkeypatch):
    site = make_distribution(
        tmp_path / "site", "reasonctl-broken", "0.3.1",
        {"broken_plugin": "raise RuntimeError('boom at import')\n"},
        {"broken": "broken_plugin"},
    )
    monkeypatch.syspath_prepend(str(site))
    return site


def test_broken_plugin_is_reported_not_fatal(broken_site):
    host = PluginHost.load(strict=False)
    record = next(r for r in host.records if r.name == "broken")
    assert record.status == "error"
    assert "reasonctl-broken 0.3.1" in record.error
    assert "boom at import" in record.traceback
    with pytest.raises(PluginLoadError, match="boom at import"):
        PluginHost.load(strict=True)


def test_failed_plugins_give_one_warning_each(broken_site):
    host = PluginHost.load()
    [warning] = host.load_warnings()
    assert warning.startswith("warning: plugin 'broken' (reasonctl-broken 0.3.1)")
    assert "boom at import" in warning and "reasonctl plugins --all" in warning


def test_disabled_plugins(broken_site, monkeypatch):
    monkeypatch.setenv("REASONCTL_DISABLE_PLUGINS", "broken")
    host = PluginHost.load()
    record = next(r for r in host.records if r.name == "broken")
    assert record.status == "disabled"
    assert host.load_warnings() == []
    assert PluginHost.load(strict=True)  # a disabled broken plugin does not count


def test_commands_are_recorded_per_plugin():
    import typer

    class Commands:
        @reasonctl.hookimpl
        def register_commands(self, app):
            @app.command("say-hi")
            def say_hi() -> None:
                """Say hi."""

            app.add_typer(typer.Typer(), name="tools")

    class FailingCommands:
        @reasonctl.hookimpl
        def register_commands(self, app):
            raise RuntimeError("no commands today")

    host = PluginHost.load(entry_points=False)
    host.add_plugin(Commands(), name="cmds")
    host.add_plugin(FailingCommands(), name="failing")
    host.add_commands(typer.Typer())
    by_name = {r.name: r for r in host.records}
    assert by_name["cmds"].commands == ["say-hi", "tools"]
    assert by_name["failing"].status == "error"
    assert "no commands today" in by_name["failing"].error
    assert [r.name for r in host.records].count("failing") == 1


def test_require_names_the_distribution_of_a_third_party_caller(tmp_path, monkeypatch):
    code = (
        "import reasonctl\n"
        "def load_video():\n"
        "    return reasonctl.require('no_such_package_xyz', 'video', 'the foo video format')\n"
    )
    site = make_distribution(tmp_path / "site", "reasonctl-foo", "0.2", {"foo_plugin": code},
                             {"foo": "foo_plugin"})
    monkeypatch.syspath_prepend(str(site))
    import foo_plugin

    with pytest.raises(MissingDependencyError) as info:
        foo_plugin.load_video()
    assert "pip install 'reasonctl-foo[video]'" in str(info.value)
    assert "needed by the foo video format" in str(info.value)
    assert info.value.distribution == "reasonctl-foo"


@pytest.mark.parametrize(
    ("caller", "expected"),
    [("reasonctl.data.somewhere",  # reasonctl is installed from its clone: an editable install
      f"pip install -e '{Path(reasonctl.__file__).resolve().parents[1]}[video]'"),
     ("a_script_of_no_distribution", "install 'no_such_package_xyz' (the 'video' extra")],
)
def test_require_from_reasonctl_or_an_unknown_caller(caller, expected):
    namespace = {"__name__": caller, "require": require}
    exec("def load():\n    return require('no_such_package_xyz', 'video')", namespace)
    with pytest.raises(MissingDependencyError) as info:
        namespace["load"]()
    assert expected in str(info.value)


def test_lifecycle_facade_calls_plugins():
    seen = []

    class Observer:
        @reasonctl.hookimpl
        def on_run_end(self, ctx, status, error):
            seen.append((ctx, status, error))

    host = PluginHost.load(entry_points=False)
    host.add_plugin(Observer(), name="observer")
    host.hooks.on_run_end("ctx", "completed", None)
    assert seen == [("ctx", "completed", None)]


def test_importing_reasonctl_does_not_import_torch():
    import subprocess

    code = "import reasonctl, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_run_warns_about_failed_plugins_at_its_start(broken_site, tmp_path, capsys):
    from tests.toy_components import ToyPlugin

    plugin = ToyPlugin()
    config = reasonctl.load_config(
        [], ["algorithm.name=toy", "backend.name=toybackend", "logging.loggers=[]",
             "train.max_steps=1", f"run.output_dir='{tmp_path}'"], plugins=[plugin])
    result = reasonctl.run(config, plugins=[plugin])
    assert result.status == "completed"
    first_line = capsys.readouterr().err.splitlines()[0]
    assert first_line.startswith("warning: plugin 'broken' (reasonctl-broken 0.3.1)")
    assert "boom at import" in first_line
