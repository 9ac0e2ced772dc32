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
engine = "{engine}"
{engine_section}
[rollout.workers]
count = 2
tensor_parallel = {tp}
devices = ["cuda:1"]
max_staleness = 2
[algorithm.grpo]
dynamic_sampling = true
"""


def _validate(tmp_path: Path, algo: str, tp: int, env: dict[str, str] | None = None, *,
              engine: str = "hf", engine_section: str = "") -> str:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "reference": "A"}) + "\n")
    config = tmp_path / "c.toml"
    config.write_text(GRPO.format(out=tmp_path / "out", data=data, algo=algo, tp=tp,
                                  engine=engine, engine_section=engine_section))
    result = CliRunner().invoke(build_app(host()), ["config", "validate", "--config", str(config)],
                                env=env)
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_every_problem_of_a_separate_placement_is_named(tmp_path: Path) -> None:
    out = _validate(tmp_path, "grpo", 2, env={"PATH": str(tmp_path)})  # no redis-server
    assert "algorithm.grpo.dynamic_sampling: not available with rollout.placement" in out
    assert ("rollout.workers.tensor_parallel: the hf engine runs a rollout replica on one "
            "device (got 2); for tensor-parallel workers set rollout.engine = 'vllm'") in out
    assert "rollout.workers.devices: 2 worker(s) x tensor_parallel 2 need 4 devices" in out
    assert "rollout.workers.redis_url: unset, so `reasonctl run` starts redis-server" in out


def test_vllm_workers_take_the_tensor_parallelism(tmp_path: Path) -> None:
    out = _validate(tmp_path, "grpo", 2, engine="vllm")
    assert "tensor_parallel" not in out.replace("x tensor_parallel 2 need", ""), out
    out = _validate(tmp_path, "grpo", 2, engine="vllm",
                    engine_section="[rollout.vllm]\ntensor_parallel_size = 4")
    assert ("rollout.vllm.tensor_parallel_size: with rollout.placement = 'separate' each "
            "worker's vLLM shards over rollout.workers.tensor_parallel (2) devices; set "
            "rollout.workers.tensor_parallel = 4") in out


def test_a_vllm_worker_config_carries_the_tensor_parallelism() -> None:
    from reasonctl.async_rl.worker import worker_config

    text = ('[rollout]\nengine = "vllm"\nplacement = "separate"\n'
            "[rollout.workers]\ntensor_parallel = 2\n")
    config = worker_config(text, [], "cuda:0", host())
    assert config.component_config("rollout", "vllm").tensor_parallel_size == 2
    hf = worker_config(text.replace('"vllm"', '"hf"', 1).replace("2", "1"), [], "cpu", host())
    assert hf.rollout.engine == "hf"


def test_a_tensor_parallel_worker_sees_only_its_gpus() -> None:
    from reasonctl.async_rl.pool import worker_placement
    from reasonctl.core.errors import ReasonctlError

    assert worker_placement(["cuda:2"], {}) == ("cuda:2", None)
    assert worker_placement(["cpu", "cpu"], {}) == ("cpu", None)
    device, env = worker_placement(["cuda:2", "cuda:3"], {"PATH": "/bin"})
    assert (device, env) == ("cuda:0", {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"})
    _, env = worker_placement(["cuda:1", "cuda:2"], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert env is not None and env["CUDA_VISIBLE_DEVICES"] == "5,6"
    with pytest.raises(ReasonctlError, match="not all among the visible devices"):
        worker_placement(["cuda:1", "cuda:2"], {"CUDA_VISIBLE_DEVICES": "4,5"})


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


@pytest.mark.parametrize("url", ["localhost:6379", "http://127.0.0.1:6379/0", "redis://"])
def test_a_redis_url_redis_py_cannot_open_is_a_config_error(tmp_path: Path, url: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[rollout]\nplacement = "separate"\n'
                      f'[rollout.workers]\nredis_url = "{url}"\n')
    result = CliRunner().invoke(build_app(host()), ["config", "validate", "--config",
                                                    str(config), "--algo", "grpo"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "rollout.workers.redis_url:" in output and "e.g. redis://127.0.0.1:6379/0" in output


def test_a_worker_given_a_redis_address_without_scheme_is_told_the_url_form() -> None:
    pytest.importorskip("redis", reason="redis-py is not installed (reasonctl[async])")
    result = CliRunner().invoke(build_app(host()), [
        "worker", "rollout", "--redis", "localhost:6379", "--run", "r", "--connect-timeout", "1"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "localhost:6379 is not a Redis URL" in output and "--redis" in output
    assert "Traceback" not in output


def test_worker_settings_in_a_colocated_run_are_called_unused(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "reference": "A"}) + "\n")
    config = tmp_path / "c.toml"
    config.write_text(f'[data.jsonl]\npath = "{data}"\n[rollout.workers]\ncount = 2\n'
                      "max_staleness = 0\n")
    with pytest.warns(UserWarning) as caught:
        result = CliRunner().invoke(build_app(host()), ["config", "validate", "--config",
                                                        str(config), "--algo", "grpo"])
    assert result.exit_code == 0, result.output
    messages = [str(w.message) for w in caught]
    assert ("rollout.workers: count, max_staleness set, but rollout.placement is 'colocated', "
            "so no rollout worker runs and these settings are unused; set rollout.placement = "
            "'separate' to use them") in messages, messages


def test_a_worker_on_a_device_this_node_lacks_is_a_usage_error_before_redis() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this node has CUDA")
    from reasonctl.async_rl.processes import free_port

    result = CliRunner().invoke(build_app(host()), [
        "worker", "rollout", "--redis", f"redis://127.0.0.1:{free_port()}/0", "--run", "r",
        "--device", "cuda:0", "--connect-timeout", "5"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "--device cuda:0 cannot be used on this node" in output
    assert "cannot reach Redis" not in output  # checked before connecting
