"""Configuring separate rollout workers: what `config validate` and `run` report before
anything loads (exit 2, every problem named), and a worker that cannot reach Redis."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reasonctl.cli.app import build_app
from reasonctl.cli.common import host

GRPO = """
[run]
output_dir = "{out}"
[data.jsonl]
path = "{data}"
[algorithm]
name = "{algo}"
[backend]
device = "cpu"
[rollout]
placement = "separate"
[rollout.workers]
count = 2
tensor_parallel = {tp}
devices = ["cuda:1"]
max_staleness = 2
[algorithm.grpo]
dynamic_sampling = true
"""


def _validate(tmp_path: Path, algo: str, tp: int, env: dict[str, str] | None = None) -> str:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "reference": "A"}) + "\n")
    config = tmp_path / "c.toml"
    config.write_text(GRPO.format(out=tmp_path / "out", data=data, algo=algo, tp=tp))
    result = CliRunner().invoke(build_app(host()), ["config", "validate", "--config", str(config)],
                                env=env)
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_every_problem_of_a_separate_placement_is_named(tmp_path: Path) -> None:
    out = _validate(tmp_path, "grpo", 2, env={"PATH": str(tmp_path)})  # no redis-server
    assert "algorithm.grpo.dynamic_sampling: not available with rollout.placement" in out
    assert "rollout.workers.tensor_parallel: the hf engine runs a replica on one device" in out
    assert "rollout.workers.devices: 2 worker(s) x tensor_parallel 2 need 4 devices" in out
    assert "rollout.workers.redis_url: unset, so `reasonctl run` starts redis-server" in out


def test_an_algorithm_without_separate_rollouts_is_a_config_error(tmp_path: Path) -> None:
    out = _validate(tmp_path, "sft", 1)
    assert "rollout.placement: algorithm 'sft' cannot train on rollouts of separate" in out


def test_worker_with_unreachable_redis_fails_fast_and_clearly() -> None:
    pytest.importorskip("redis", reason="redis-py is not installed (reasonctl[async])")
    from reasonctl.async_rl.processes import free_port

    started = time.monotonic()
    result = CliRunner().invoke(build_app(host()), [
        "worker", "rollout", "--redis", f"redis://127.0.0.1:{free_port()}/0", "--run", "r",
        "--connect-timeout", "1"])
    assert result.exit_code == 1
    assert "cannot reach Redis at redis://127.0.0.1:" in " ".join(result.output.split())
    assert time.monotonic() - started < 15
