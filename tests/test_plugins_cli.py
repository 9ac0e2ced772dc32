"""``reasonctl plugins`` as a user runs it: stdout listing, ``--all`` and ``--json``."""

from __future__ import annotations

import json

import pytest

from tests.fake_dist import make_distribution
from tests.test_cli import cli, with_path

ALPHA = '''
import reasonctl
from pydantic import BaseModel, Field


class AlphaConfig(BaseModel):
    threshold: float = Field(default=0.5, description="Score above which a completion passes.")
    label: str


def alpha_reward(config):
    """Alpha's own reward."""
    return lambda completions, samples: [1.0] * len(completions)


def alpha_dataset(config, tokenizer):
    return []


@reasonctl.hookimpl
def register_rewards(register):
    register("shared", alpha_reward)
    register("alpha_only", alpha_reward, config_model=AlphaConfig)


@reasonctl.hookimpl
def register_datasets(register):
    register("alpha_broken", alpha_dataset)


@reasonctl.hookimpl
def register_commands(app):
    @app.command("alpha-hello")
    def hello():
        """Say hello."""
        print("hello")
'''

BETA = '''
import reasonctl


@reasonctl.hookimpl
def register_rewards(register):
    register("shared", lambda config: (lambda completions, samples: [0.0] * len(completions)))
'''


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins-cli")
    alpha = make_distribution(root / "alpha", "reasonctl-alpha", "1.0", {"alpha_plugin": ALPHA},
                              {"alpha": "alpha_plugin"})
    beta = make_distribution(root / "beta", "reasonctl-beta", "2.0", {"beta_plugin": BETA},
                             {"beta": "beta_plugin"})
    broken = make_distribution(root / "broken", "reasonctl-broken", "0.3.1",
                               {"broken_plugin": "raise RuntimeError('boom at import')\n"},
                               {"broken": "broken_plugin"})
    return with_path(alpha, beta, broken)


def test_listing_goes_to_stdout_with_conflicts_and_unusable_components(sites):
    out = cli("plugins", env=sites)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    text = out.stdout
    assert "alpha (reasonctl-alpha 1.0): ok" in text
    assert "reward: alpha_only, shared (conflict)" in text
    assert "dataset: alpha_broken (broken)" in text
    assert "commands: alpha-hello" in text
    assert "reward 'shared' is registered by several plugins: alpha (reasonctl-alpha 1.0) and " \
           "beta (reasonctl-beta 2.0)" in text
    assert "REASONCTL_DISABLE_PLUGINS=alpha or REASONCTL_DISABLE_PLUGINS=beta" in text
    assert "dataset 'alpha_broken' (alpha): its factory alpha_dataset(config, tokenizer) " \
           "requires 'tokenizer'" in text
    assert "broken (reasonctl-broken 0.3.1): error" in text
    assert "boom at import" in text and "Traceback" not in text
    assert "algorithm-grpo (reasonctl " in text


def test_all_shows_descriptions_config_keys_hooks_and_tracebacks(sites):
    text = cli("plugins", "--all", env=sites).stdout
    assert "reward alpha_only: Alpha's own reward." in text
    assert "threshold: float = 0.5  Score above which a completion passes." in text
    assert "label: str required" in text
    assert "hooks: register_commands, register_datasets, register_rewards" in text
    assert "Traceback of broken:" in text and "RuntimeError: boom at import" in text


def test_json_carries_the_same_data(sites):
    out = cli("plugins", "--json", env=sites)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["alpha"]["commands"] == ["alpha-hello"]
    assert plugins["alpha"]["components"] == {"dataset": ["alpha_broken"],
                                              "reward": ["alpha_only", "shared"]}
    assert "boom at import" in plugins["broken"]["traceback"]
    [conflict] = report["conflicts"]
    assert conflict["name"] == "shared" and set(conflict["plugins"]) == {"alpha", "beta"}
    [broken] = report["broken"]
    assert broken["name"] == "alpha_broken" and "'tokenizer'" in broken["problem"]
    alpha_only = next(c for c in report["components"]["reward"] if c["name"] == "alpha_only")
    assert alpha_only["description"] == "Alpha's own reward."
    assert alpha_only["config"] == [
        {"key": "threshold", "type": "float", "required": False, "default": 0.5,
         "description": "Score above which a completion passes."},
        {"key": "label", "type": "str", "required": True, "default": None, "description": ""},
    ]
    shared = [c for c in report["components"]["reward"] if c["name"] == "shared"]
    assert {(c["plugin"], c["status"]) for c in shared} == {("alpha", "conflict"),
                                                           ("beta", "conflict")}


def test_a_config_naming_a_conflicting_reward_says_which_plugins_clash(sites):
    out = cli("config", "validate", "--set", "rewards.components=[{name='shared'}]", env=sites)
    assert out.returncode != 0
    err = " ".join(out.stderr.split())
    assert "reward 'shared' is registered by several plugins" in err
    assert "REASONCTL_DISABLE_PLUGINS=alpha" in err
