"""A third-party plugin installed with pip, as a user installs one, that registers a built-in
name, a logger missing a method and a storage scheme with its own checks: built-in names
keep meaning the built-in, and the plugin's components join pre-flight like ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""A plugin whose `choice` reward would replace reasonctl's."""
import reasonctl
from pydantic import BaseModel


def quarter(completions, samples):
    return [0.25] * len(completions)


class HalfwayLogger:
    def __init__(self, config):
        pass

    def log(self, metrics, step):
        pass


class VaultConfig(BaseModel):
    def uri_problems(self, uri):
        return [] if uri.removeprefix("vault://").split("/")[0] else [
            "names no vault; expected vault://NAME[/prefix]"]


class Vault:
    def __init__(self, config):
        pass

    def check_access(self, uri):
        if "locked" in uri:
            raise reasonctl.StorageError(f"{uri}: access denied", permanent=True)

    def put_file(self, local, uri): ...
    def put_dir(self, local, uri): ...
    def get_file(self, uri, local): ...
    def get_dir(self, uri, local): ...
    def list(self, uri): ...
    def exists(self, uri): ...
    def delete(self, uri): ...


@reasonctl.hookimpl
def register_rewards(register):
    register("choice", lambda config: reasonctl.as_reward(quarter))
    register("quarter", lambda config: reasonctl.as_reward(quarter))


@reasonctl.hookimpl
def register_loggers(register):
    register("halfway", HalfwayLogger)


@reasonctl.hookimpl
def register_storage(register):
    register("vault", Vault, config_model=VaultConfig)
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "reasonctl-lookalike"
version = "0.2.0"
dependencies = ["reasonctl"]

[project.entry-points.reasonctl]
lookalike = "reasonctl_lookalike"

[tool.setuptools]
py-modules = ["reasonctl_lookalike"]
'''

ROWS = [
    {"prompt": "Which vehicle?", "options": ["a car", "a bus"], "reference": "B",
     "completion": "The answer is B."},
    {"prompt": "Which vehicle?", "options": ["a car", "a bus"], "reference": "B",
     "completion": "The answer is A."},
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install`` of the plugin's source tree into a directory put on the path."""
    source = tmp_path_factory.mktemp("lookalike-src")
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (source / "reasonctl_lookalike.py").write_text(textwrap.dedent(PLUGIN))
    target = tmp_path_factory.mktemp("lookalike-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, capture_output=True, timeout=300)
    return target


def cli(site: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    environ = {**os.environ, "PYTHONPATH": path, "REASONCTL_CACHE": str(cwd / "cache"), **env}
    return subprocess.run([sys.executable, "-m", "reasonctl", *args], capture_output=True,
                          text=True, env=environ, cwd=cwd, timeout=300)


def scores(site: Path, tmp_path: Path, **env: str) -> tuple[list[float], str]:
    (tmp_path / "rewards.toml").write_text('[[rewards.components]]\nname = "choice"\n')
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = cli(site, "rewards", "score", "--config", "rewards.toml", "--data", "rows.jsonl",
              "--output", "scores.jsonl", cwd=tmp_path, **env)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    return [row["total"] for row in rows], out.stderr


def test_a_plugin_cannot_take_over_a_built_in_name(site: Path, tmp_path: Path) -> None:
    listing = json.loads(cli(site, "plugins", "--json", cwd=tmp_path).stdout)
    statuses = {(c["name"], c["plugin"]): c["status"] for c in listing["components"]["reward"]}
    assert statuses[("choice", "rewards")] == "ok"
    assert statuses[("choice", "lookalike")] == "shadowed"
    assert statuses[("quarter", "lookalike")] == "ok"  # the plugin's other names work
    assert listing["conflicts"] == []
    [shadowed] = listing["shadowed"]
    message = shadowed["message"]
    assert message.startswith("reward 'choice' (reasonctl-lookalike 0.2.0) is not used: "
                              "'choice' is a built-in reward of reasonctl")
    assert "REASONCTL_DISABLE_PLUGINS=rewards" in message
    text = cli(site, "plugins", cwd=tmp_path).stdout
    assert "choice (not used: built-in name)" in text

    # an unchanged config keeps scoring with reasonctl's choice reward
    assert scores(site, tmp_path)[0] == [1.0, 0.0]
    # and config validate says so, naming both owners
    checked = cli(site, "config", "validate", "--set", "rewards.components=[{name='choice'}]",
                  "--set", "data.jsonl.path='rows.jsonl'", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "reward 'choice' (reasonctl-lookalike 0.2.0) is not used" in checked.stderr
    # blocking reasonctl's rewards is how a user picks the plugin's on purpose
    assert scores(site, tmp_path, REASONCTL_DISABLE_PLUGINS="rewards")[0] == [0.25, 0.25]
    strict = cli(site, "plugins", "--json", cwd=tmp_path, REASONCTL_STRICT_PLUGINS="1")
    assert strict.returncode == 1 and "is a built-in reward of reasonctl" in strict.stderr


def test_the_plugin_joins_pre_flight_like_a_built_in(site: Path, tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("{}\n")
    listing = json.loads(cli(site, "plugins", "--json", cwd=tmp_path).stdout)
    [halfway] = listing["broken"]
    assert halfway["name"] == "halfway"
    assert "its class HalfwayLogger lacks close required by the Logger protocol" \
           in halfway["problem"]
    checked = cli(site, "config", "validate", "--set", "data.jsonl.path='rows.jsonl'",
                  "--set", "logging.loggers=['console', 'halfway']", cwd=tmp_path)
    assert checked.returncode == 2, checked.stderr
    assert ("logger 'halfway' (reasonctl-lookalike 0.2.0) cannot be used: its class "
            "HalfwayLogger lacks close") in checked.stderr
    checked = cli(site, "config", "validate", "--set", "data.jsonl.path='rows.jsonl'",
                  "--set", "checkpoint.upload=['vault://', 'vault://locked/run']", cwd=tmp_path)
    assert checked.returncode == 2, checked.stderr
    assert "checkpoint.upload.0: 'vault://' names no vault" in checked.stderr
    assert "checkpoint.upload.1: vault://locked/run: access denied" in checked.stderr


def test_a_python_reward_named_like_a_registered_one_is_refused(tmp_path: Path) -> None:
    import reasonctl

    def choice(completion: str) -> float:
        return 1.0

    with pytest.raises(ValueError, match=r"the Python reward 'choice' has the name of the "
                                         r"registered reward 'choice' \(reasonctl\); pass it "
                                         r"under a name of its own, e.g. rewards=\{'my_choice'"):
        reasonctl.run({"run": {"output_dir": str(tmp_path)}}, rewards=[choice])
