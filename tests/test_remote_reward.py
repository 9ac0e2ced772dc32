"""Asynchronous rewards: RewardSet.submit/collect, GRPO collecting after its log-prob passes,
and GRPO on the quickstart task learning with ``remote`` rewards as with local ones."""

from __future__ import annotations

import json
import threading
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import reasonctl
from reasonctl.core.errors import RewardError
from reasonctl.core.reward_set import RewardSet, RewardTerm
from reasonctl.core.types import ContentPart, Message, Sample
from tests.service_support import TOKEN, InProcessService, service_config

REPO = Path(__file__).resolve().parents[1]


def sample(text: str) -> Sample:
    return Sample([Message("user", [ContentPart("text", text=text)])], source=f"t:{text}")


class Threaded:
    """An asynchronous reward: scores in a thread; records when it is submitted/collected."""

    def __init__(self, events: list[str], *, fail_submit: bool = False,
                 fail_collect: bool = False) -> None:
        self.events = events
        self.fail_submit, self.fail_collect = fail_submit, fail_collect

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float]:
        return self.collect(self.submit(completions, samples))

    def submit(self, completions: Sequence[str], samples: Sequence[Sample]) -> Any:
        self.events.append("submit")
        if self.fail_submit:
            raise ConnectionError("service unreachable")
        result: list[float] = []
        thread = threading.Thread(target=lambda: result.extend(float(len(c))
                                                               for c in completions))
        thread.start()
        return thread, result

    def collect(self, handle: Any) -> list[float]:
        self.events.append("collect")
        if self.fail_collect:
            raise RuntimeError("request failed")
        thread, result = handle
        thread.join()
        return result


def test_reward_set_submits_asynchronous_rewards_before_local_ones() -> None:
    events: list[str] = []

    def local(completions: Sequence[str], samples: Sequence[Sample]) -> list[float]:
        events.append("local")
        return [1.0] * len(completions)

    rewards = RewardSet([RewardTerm("local", reasonctl.as_reward(reasonctl.batched(local))),
                         RewardTerm("async", Threaded(events), 0.5)])
    assert isinstance(rewards.terms[1].reward, reasonctl.SubmitsAsync)
    texts, samples = ["ab", "abcd"], [sample("a"), sample("b")]
    pending = rewards.submit(texts, samples)
    assert events == ["submit", "local"]
    scores = rewards.collect(pending)
    assert events == ["submit", "local", "collect"]
    assert scores.totals == [2.0, 3.0]
    assert scores.components == {"local": [1.0, 1.0], "async": [2.0, 4.0]}
    assert scores.metrics == rewards.score(texts, samples).metrics
    with pytest.raises(ValueError, match="collected already"):
        rewards.collect(pending)


@pytest.mark.parametrize("where", ["submit", "collect"])
def test_a_failing_asynchronous_reward_follows_rewards_on_error(where: str) -> None:
    broken = Threaded([], fail_submit=where == "submit", fail_collect=where == "collect")
    texts, samples = ["x", "yy"], [sample("a"), sample("b")]
    raising = RewardSet([RewardTerm("async", broken)], on_error="raise")
    pending = raising.submit(texts, samples)  # a failure surfaces when collected
    with pytest.raises(RewardError, match="reward 'async' failed on a batch of 2 completions"):
        raising.collect(pending)
    zero = RewardSet([RewardTerm("async", broken)], on_error="zero")
    scores = zero.score(texts, samples)
    assert scores.totals == [0.0, 0.0]
    assert scores.metrics["reward/errors"] == 2.0
    assert [e.source for e in scores.errors] == ["t:a", "t:b"]


class OrderPlugin:
    """Registers ``threaded_len`` (asynchronous) and records the order of a step's work."""

    def __init__(self) -> None:
        self.events: list[str] = []

    @reasonctl.hookimpl
    def register_rewards(self, register: Any) -> None:
        register("threaded_len", lambda config: Threaded(self.events))


def test_grpo_collects_rewards_after_the_log_prob_passes(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.backends.base import TorchBackend
    from tests.test_grpo import _config

    plugin = OrderPlugin()
    for method in ("token_outputs", "reference_token_outputs"):
        original = getattr(TorchBackend, method)

        def logged(self: Any, *args: Any, _original: Any = original, _name: str = method,
                   **kwargs: Any) -> Any:
            plugin.events.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TorchBackend, method, logged)
    config = _config(tmp_path, tiny_model_dir, kl_beta=0.05, ppo_epochs=2)
    config["train"]["max_steps"] = 2
    config["rewards"] = {"components": [{"name": "threaded_len"}]}
    result = reasonctl.run(config, plugins=[plugin])
    assert result.status == "completed"
    steps = " ".join(plugin.events).split("submit")[1:]
    assert len(steps) == 2
    for step in steps:
        order = step.split()
        assert order[-1] == "collect", order
        assert "token_outputs" in order and "reference_token_outputs" in order
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert all("time/reward_wait_s" in row and row["reward/mean"] > 0 for row in rows)


@pytest.mark.slow
def test_grpo_on_the_quickstart_task_learns_with_remote_rewards_as_with_local_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette")
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", TOKEN)
    registry = reasonctl.plugin_host().registry

    def train(name: str, reward: dict[str, Any]) -> list[dict[str, Any]]:
        out = tmp_path / name
        config = tomllib.loads((REPO / "examples/configs/quickstart_grpo.toml").read_text())
        config["run"]["output_dir"] = str(out)
        config["checkpoint"].update(every_steps=0, export_final=False)
        config["eval"]["every_steps"] = 0
        config["logging"]["loggers"] = ["jsonl"]
        config["train"].update(max_steps=12, lr=2e-2)
        config["algorithm"]["grpo"]["prompts_per_step"] = 8
        config["rollout"]["n"] = 8
        config["rewards"]["components"] = [reward]
        assert reasonctl.run(config).status == "completed"
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    local = train("local", {"name": "choice"})
    with InProcessService(service_config([{"name": "choice"}]), registry) as service:
        started = time.monotonic()
        remote = train("remote", {"name": "remote", "url": service.url,
                                  "rewards": {"choice": 1.0}})
        assert time.monotonic() - started < 600
        served = service.metrics()
    for key in ("reward/mean", "loss", "response_length/mean"):
        assert [r[key] for r in remote] == pytest.approx([r[key] for r in local], abs=1e-9), key
    rewards = [r["reward/mean"] for r in remote]
    assert sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4 >= 0.08, rewards
    assert served["requests"]["done"] == 12 and served["requests"]["failed"] == 0
    assert served["rewards"]["choice"]["completions"] == 12 * 64




def test_each_served_reward_is_reported_beside_the_weighted_sum(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvicorn")
    from reasonctl.core.reward_set import ScoresWithParts
    from reasonctl.rewards.remote import RemoteConfig, remote_reward

    monkeypatch.setenv("REASONCTL_REWARD_TOKEN", TOKEN)
    registry = reasonctl.plugin_host().registry
    served = [{"name": "choice"}, {"name": "format", "require_think": False}]
    texts = ["<answer>A</answer>", "B", "<answer>C</answer>"]
    samples = [Sample([Message("user", [ContentPart("text", text="Pick A, B or C.")])],
                      reference=ref, source=f"t:{i}") for i, ref in enumerate("ABA")]
    with InProcessService(service_config(served), registry) as service:
        reward = remote_reward(RemoteConfig(url=service.url,
                                            rewards={"choice": 1.0, "format": 0.5}))
        scores = reward(texts, samples)
        assert isinstance(scores, ScoresWithParts)
        assert scores.parts == {"choice": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0]}
        assert scores == [1.5, 1.0, 0.5]
        result = RewardSet([RewardTerm("remote", reward, 2.0)]).score(texts, samples)
    assert result.totals == [3.0, 2.0, 1.0]  # the parts are not added again
    assert result.parts == {"remote/choice": [1.0, 1.0, 0.0], "remote/format": [1.0, 0.0, 1.0]}
    assert result.metrics["reward/remote/mean"] == pytest.approx(1.0)
    assert result.metrics["reward/remote/choice/mean"] == pytest.approx(2 / 3)
    assert result.metrics["reward/remote/format/mean"] == pytest.approx(2 / 3)


WRONG_TOKEN = "wrong-token-0123456789abcdef"


@pytest.fixture(scope="module")
def example_service(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``reasonctl serve-rewards`` with examples/configs/reward_service.toml (JSON logs) in a
    process of its own."""
    from tests.service_support import ServiceProcess

    pytest.importorskip("uvicorn")
    config = tomllib.loads((REPO / "examples/configs/reward_service.toml").read_text())
    config["server"]["log_format"] = "json"
    service = ServiceProcess(config, tmp_path_factory.mktemp("service")).start()
    yield service
    service.stop()
    log = service.log()
    assert TOKEN not in log and WRONG_TOKEN not in log


def example_trainer(service: Any, directory: Path) -> Path:
    """examples/configs/quickstart_grpo_remote.toml pointed at ``service`` for two steps,
    weighing a second served reward."""
    import tomli_w

    trainer = tomllib.loads((REPO / "examples/configs/quickstart_grpo_remote.toml").read_text())
    (entry,) = trainer["rewards"]["components"]
    entry.update(url=service.url, rewards={"choice": 1.0, "format": 0.5})
    trainer["data"]["jsonl"]["path"] = str(REPO / trainer["data"]["jsonl"]["path"])
    trainer["eval"]["data"] = str(REPO / trainer["eval"]["data"])
    trainer["run"]["output_dir"] = str(directory / "run")
    trainer["train"]["max_steps"] = 2
    trainer["checkpoint"].update(every_steps=0, export_final=False)
    config = directory / "trainer.toml"
    config.write_text(tomli_w.dumps(trainer))
    return config


def reasonctl_cli(config: Path, *args: str, token: str | None) -> Any:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "REASONCTL_REWARD_TOKEN"}
    if token is not None:
        env["REASONCTL_REWARD_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "reasonctl", *args, "-c", str(config)],
                          capture_output=True, text=True, env=env, timeout=300,
                          cwd=config.parent)


def test_a_missing_or_refused_token_stops_before_the_model_loads(
        example_service: Any, tmp_path: Path) -> None:
    import httpx

    config = example_trainer(example_service, tmp_path)
    missing = reasonctl_cli(config, "config", "validate", token=None)
    assert missing.returncode == 2, missing.stderr
    assert "rewards.components.0.token_env: environment variable REASONCTL_REWARD_TOKEN is " \
        "not set" in " ".join(missing.stderr.split())
    for command in (["config", "validate"], ["run"]):
        refused = reasonctl_cli(config, *command, token=WRONG_TOKEN)
        assert refused.returncode == 2, refused.stderr
        assert "rewards.components.0.token_env: reward 'remote': the reward service at " \
            f"{example_service.url} refused the token in REASONCTL_REWARD_TOKEN (HTTP 401)" \
            in " ".join(refused.stderr.split())
        assert WRONG_TOKEN not in refused.stderr
    assert not (tmp_path / "run").exists()  # stopped before anything was written

    # the service answers WWW-Authenticate and logs each refusal, never the token
    for headers, reason in (({}, "missing bearer token"),
                            ({"Authorization": f"Bearer {WRONG_TOKEN}"},
                             "invalid bearer token")):
        answer = httpx.get(f"{example_service.url}/metrics", headers=headers, timeout=10)
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"].startswith("Bearer")
        deadline = time.monotonic() + 10
        while not any(r["reason"] == reason and r["path"] == "/metrics"
                      for r in _rejections(example_service.log())):
            assert time.monotonic() < deadline, example_service.log()
            time.sleep(0.1)


def _rejections(log: str) -> list[dict[str, Any]]:
    return [row for row in (json.loads(line) for line in log.splitlines()
                            if line.startswith("{"))
            if row.get("event") == "rejected" and row.get("status") == 401]


@pytest.mark.slow
def test_the_example_trainer_config_runs_against_the_example_service(
        example_service: Any, tmp_path: Path) -> None:
    config = example_trainer(example_service, tmp_path)
    done = reasonctl_cli(config, "run", token=TOKEN)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 2
    for row in rows:  # the sum, and each served reward on its own
        assert row["reward/remote/mean"] == pytest.approx(
            row["reward/remote/choice/mean"] + 0.5 * row["reward/remote/format/mean"])
        assert 0 <= row["reward/remote/choice/mean"] <= 1
