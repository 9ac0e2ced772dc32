"""Plugin discovery and the error behaviour that keeps the ecosystem pleasant."""

from __future__ import annotations

import sys

import pytest

import reasonctl
from reasonctl.core.errors import PluginLoadError, UnknownComponentError
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


def test_builtin_plugins_come_from_entry_points():
    host = PluginHost.load()
    builtin = [r for r in host.records if r.distribution == "reasonctl"]
    assert builtin, "no built-in plugin found through entry points"
    assert all(r.version == reasonctl.__version__ for r in builtin)


def test_unknown_component_lists_available_and_suggests():
    host = PluginHost.load(entry_points=False)
    host.add_plugin(RewardPlugin("exact_match"), name="p1")
    with pytest.raises(UnknownComponentError) as info:
        host.registry.get("reward", "exact_mach")
    message = str(info.value)
    assert "Unknown reward 'exact_mach'" in message
    assert "exact_match (p1)" in message
    assert "Did you mean 'exact_match'?" in message


def test_duplicate_names_report_both_owners():
    host = PluginHost.load(entry_points=False)
    host.add_plugin(RewardPlugin("same"), name="first")
    record = host.add_plugin(RewardPlugin("same"), name="second")
    assert record.status == "error"
    assert "first" in record.error and "second" in record.error
    assert host.registry.get("reward", "same").owner.name == "first"
    strict = PluginHost.load(entry_points=False, strict=True)
    strict.add_plugin(RewardPlugin("same"), name="first")
    with pytest.raises(PluginLoadError, match="registered twice"):
        strict.add_plugin(RewardPlugin("same"), name="second")


def test_misspelled_hook_is_an_error():
    class Misspelled:
        @reasonctl.hookimpl
        def register_reward(self, register):  # missing "s"
            pass

    host = PluginHost.load(entry_points=False)
    record = host.add_plugin(Misspelled(), name="typo")
    assert record.status == "error"
    assert "register_reward" in record.error


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


def test_disabled_plugins(broken_site, monkeypatch):
    monkeypatch.setenv("REASONCTL_DISABLE_PLUGINS", "broken")
    host = PluginHost.load()
    record = next(r for r in host.records if r.name == "broken")
    assert record.status == "disabled"
    assert PluginHost.load(strict=True)  # a disabled broken plugin does not count


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
