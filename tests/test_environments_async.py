"""Episodes on separate rollout workers (a real redis-server): the workers run the
environment's episodes, the trainer trains on them as it would on its own.

The environment is a third-party plugin installed for the test (a module and its
``*.dist-info`` entry point on ``PYTHONPATH``), so the worker processes find it as any
installed plugin."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from redis_support import needs_redis, redis_server, redis_url  # noqa: F401

import reasonctl

pytestmark = [pytest.mark.redis, pytest.mark.slow, needs_redis]

PLUGIN = textwrap.dedent('''
    """Answers every turn with a tool message quoting its length, for three turns; the
    episode's reward is 1 when its first turn was short."""
    import reasonctl
    from reasonctl import ContentPart, Message, Observation


    class Episode:
        def __init__(self):
            self.lengths = []

        def step(self, turn):
            self.lengths.append(len(turn))
            text = f"{len(turn)} chars"
            return Observation([Message("tool", [ContentPart("text", text=text)])],
                               done=len(self.lengths) >= 3)

        def reward(self):
            return 1.0 if self.lengths and self.lengths[0] <= 2 else 0.0

        def metrics(self):
            return {"first_turn_chars": float(self.lengths[0])}


    class Environment:
        def start(self, sample):
            return Episode()


    @reasonctl.hookimpl
    def register_environments(register):
        register("counting", lambda config: Environment(), description="counts characters")
''')


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``counting`` environment, installed where this process and workers find it."""
    root = tmp_path / "site"
    (root / "counting_env-0.1.dist-info").mkdir(parents=True)
    (root / "counting_env.py").write_text(PLUGIN)
    (root / "counting_env-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: counting-env\nVersion: 0.1\n")
    (root / "counting_env-0.1.dist-info" / "entry_points.txt").write_text(
        "[reasonctl]\ncounting = counting_env\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", f"{root}:{':'.join(sys.path)}")


def _config(root: Path, model_dir: Path, **workers: Any) -> dict[str, Any]:
    data = root / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": f"Item {i}: talk.", "reference": "x"}) + "\n"
                            for i in range(8)))
    config: dict[str, Any] = {
        "run": {"output_dir": str(root / "run"), "seed": 0},
        "model": {"name_or_path": str(model_dir), "max_length": 64},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 2}},
        "rollout": {"n": 4, "max_new_tokens": 6, "temperature": 1.0,
                    "stop": list("abcdefghijklmnopqrstuvwxyz0123456789")},
        "environment": {"name": "counting", "max_turns": 3},
        "rewards": {"components": [{"name": "redis_support:byte_parity"}]},
        "train": {"lr": 1e-2, "max_steps": 3, "micro_batch_size": 4},
        "backend": {"name": "single", "device": "cpu"},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"]},
    }
    if workers:
        config["rollout"]["placement"] = "separate"
        config["rollout"]["workers"] = {"heartbeat_ttl_s": 2.0, "wait_timeout_s": 120.0,
                                        **workers}
    return config


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {int(row["step"]): row for row in rows}


def test_workers_run_the_episodes_the_colocated_run_would(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, installed_plugin: None,  # noqa: F811
) -> None:
    reasonctl.run(_config(tmp_path / "colocated", tiny_model_dir))
    expected = _metrics(tmp_path / "colocated" / "run")
    config = _config(tmp_path / "separate", tiny_model_dir, count=1, max_staleness=0,
                     redis_url=redis_url)
    result = reasonctl.run(config)
    assert result.status == "completed"
    got = _metrics(tmp_path / "separate" / "run")
    assert any(row["env/turns"] > 1 for row in got.values())
    for step, row in got.items():
        for key in ("reward/mean", "reward/environment/mean", "env/turns",
                    "env/observation_tokens", "env/first_turn_chars", "loss"):
            assert row[key] == pytest.approx(expected[step][key], rel=1e-5), (step, key)
        assert row["rollout/logprob_gap"] < 1e-3
