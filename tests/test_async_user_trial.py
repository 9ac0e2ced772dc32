"""What a user of separate rollout workers runs into by hand: a bounded wait for a Redis
that is not there, and a hand-started worker whose model does not fit the run's weights."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from redis_support import needs_redis, redis_server, redis_url  # noqa: F401
from typer.testing import CliRunner

from reasonctl.async_rl.messages import PromptBatch, WeightVersion
from reasonctl.cli.app import build_app
from reasonctl.cli.common import host
from reasonctl.core.errors import ReasonctlError

pytestmark = [pytest.mark.redis]


def test_connect_timeout_bounds_the_wait_for_an_unreachable_redis() -> None:
    pytest.importorskip("redis", reason="redis-py is not installed (reasonctl[async])")
    from reasonctl.async_rl.processes import free_port
    from reasonctl.async_rl.transport import Transport

    started = time.monotonic()
    with pytest.raises(ReasonctlError, match="cannot reach Redis at .* within 8s"):
        Transport.open(f"redis://127.0.0.1:{free_port()}/0", "x", timeout_s=8)
    waited = time.monotonic() - started
    assert 7.5 < waited < 9.5, f"waited {waited:.1f}s for rollout.workers.connect_timeout_s = 8"


RUN_CONFIG = """
[run]
name = "trial"
output_dir = "{out}"
[model]
name_or_path = "{model}"
[backend]
device = "cpu"
[rollout]
engine = "hf"
placement = "separate"
n = 2
max_new_tokens = 2
[rollout.workers]
count = 0
weight_sync = "file"
weight_dir = "{weights}"
heartbeat_ttl_s = 2
wait_timeout_s = 4
"""


@needs_redis
def test_a_worker_whose_model_does_not_fit_stops_before_taking_a_batch(
        redis_url: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from reasonctl.async_rl.transport import Transport
    from reasonctl.async_rl.weight_sync import FilePublisher
    from reasonctl.models.tiny import make_tiny_model_dir
    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    trainer_model = Path(resolve_tiny_alias("tiny-random"))
    narrow = make_tiny_model_dir(tmp_path / "narrow", hidden_size=32, intermediate_size=64)
    transport = Transport.open(redis_url, "trial-1", timeout_s=5)
    transport.create_run(RUN_CONFIG.format(out=tmp_path / "out", model=trainer_model,
                                           weights=tmp_path / "w"), 1)
    transport.beat("trainer", "0", 4.0)
    weights = load_file(str(trainer_model / "model.safetensors"))
    FilePublisher(transport, tmp_path / "w", torch.float32).stage(
        iter(sorted(weights.items())), WeightVersion(1, 0))
    transport.publish_prompts(PromptBatch(step=0, rank=0, seed=1, indices=[0],
                                          prompts=[{"input_ids": [1, 2, 3]}]).to_fields())

    result = CliRunner().invoke(build_app(host()), [
        "worker", "rollout", "--redis", redis_url, "--run", "trial-1", "--device", "cpu",
        "--name", "narrow", "--set", f'model.name_or_path="{narrow}"'])

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"this worker's model ({narrow}) does not fit the trainer's weights" in output
    assert "has shape (263, 64) but the rollout model expects (263, 32)" in output
    # the batch was never delivered: a fitting worker takes it at once, with nothing to
    # wait for and no delivery counted against it
    assert transport.pending_by_consumer().get("narrow", 0) == 0
    entry = transport.read_prompt("fits", block_ms=100)
    assert entry is not None and PromptBatch.from_fields(entry.fields).batch_id == "s0-r0"


@needs_redis
def test_a_password_redis_rejects_is_a_usage_error_at_once(tmp_path: Path) -> None:
    pytest.importorskip("redis", reason="redis-py is not installed (reasonctl[async])")
    import shutil
    import subprocess

    from reasonctl.async_rl.processes import free_port, stop_process
    from reasonctl.async_rl.transport import Transport
    from reasonctl.core.errors import UsageError

    port = free_port()
    server = subprocess.Popen([str(shutil.which("redis-server")), "--port", str(port), "--bind",
                               "127.0.0.1", "--requirepass", "right-pw", "--save", "",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        Transport.open(f"redis://:right-pw@127.0.0.1:{port}/0", "x", timeout_s=10)  # it is up
        for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong-pw@127.0.0.1:{port}/0"):
            started = time.monotonic()
            with pytest.raises(UsageError, match="refused our credentials") as info:
                Transport.open(url, "x", timeout_s=10)
            assert time.monotonic() - started < 3, "a rejected password is not worth retrying"
            assert "wrong-pw" not in str(info.value)
    finally:
        stop_process(server, 5)  # type: ignore[arg-type]


@needs_redis
def test_a_wrong_run_id_is_answered_with_the_runs_that_redis_holds(redis_url: str) -> None:
    from reasonctl.async_rl.transport import Transport

    Transport.open(redis_url, "quickstart_grpo-1a2b3c4d", timeout_s=5).create_run(
        "[run]\nname = 'quickstart_grpo'\n", 1)
    app = build_app(host())
    result = CliRunner().invoke(app, ["worker", "rollout", "--redis", redis_url,
                                      "--run", "quickstart_grpo-1a2b3c4e"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "no run 'quickstart_grpo-1a2b3c4e'" in output
    assert "runs there: quickstart_grpo-1a2b3c4d (running)" in output
    other_db = redis_url.rsplit("/", 1)[0] + "/1"
    result = CliRunner().invoke(app, ["worker", "rollout", "--redis", other_db,
                                      "--run", "quickstart_grpo-1a2b3c4d"])
    assert result.exit_code == 2
    assert "no run is registered there (check the URL's host, port and /DB)" in " ".join(
        result.output.split())


@needs_redis
def test_losing_redis_says_how_to_continue_without_promising_its_state(redis_server) -> None:
    from reasonctl.async_rl.transport import Transport

    transport = Transport.open(redis_server.url, "r", timeout_s=5)
    redis_server.stop()
    with pytest.raises(ReasonctlError) as info:
        transport.state()
    message = str(info.value)
    assert "lost the connection to Redis" in message
    # a Redis without persistence comes back empty, and --resume needs only the checkpoint
    assert "state is kept there" not in message
    assert "--resume` continues the trainer from its last checkpoint" in message
    assert "workers rejoin with `reasonctl worker rollout`" in message


@needs_redis
def test_a_worker_says_when_the_trainer_is_gone_and_how_long_it_waits(
        redis_url: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from reasonctl.async_rl.transport import Transport
    from reasonctl.async_rl.weight_sync import FilePublisher
    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    model = Path(resolve_tiny_alias("tiny-random"))
    transport = Transport.open(redis_url, "trial-2", timeout_s=5)
    transport.create_run(RUN_CONFIG.format(out=tmp_path / "out", model=model,
                                           weights=tmp_path / "w"), 1)
    transport.beat("trainer", "0", 1.0)  # a trainer that dies a moment later
    FilePublisher(transport, tmp_path / "w", torch.float32).stage(
        iter(sorted(load_file(str(model / "model.safetensors")).items())), WeightVersion(1, 0))
    result = CliRunner().invoke(build_app(host()), [
        "worker", "rollout", "--redis", redis_url, "--run", "trial-2", "--device", "cpu"])
    output = " ".join(result.output.split())
    assert result.exit_code == 0, output
    assert ("the trainer stopped heartbeating (stopped, failed or killed); waiting up to 4s "
            "(rollout.workers.wait_timeout_s) for it to continue with --resume") in output
    assert output.endswith("no trainer for 4s (rollout.workers.wait_timeout_s)")
