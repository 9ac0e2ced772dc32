"""``reasonctl run --nproc-per-node N`` on torch's elastic agent, with real processes (gloo):
launcher flags checked before anything starts, a rendezvous nobody joins, nodes that
disagree on the config, two launchers (``--nnodes 2``, one rendezvous on 127.0.0.1)
training SFT and GRPO exactly as one launcher with two processes, the output lock held by
node 0's launcher against another launcher, a SIGKILLed worker restarted with
``--max-restarts`` resuming to the unbroken run's losses, and SIGTERM through the agent.

The two-launcher runs are marked ``slow`` and the kills and signals ``faults`` (each their
own CI step); the flag and rendezvous checks run in the default suite. The last two tests
repeat the restart and SIGTERM on two GPUs (NCCL) where there are two.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from reasonctl.core.checkpoint import CheckpointManager
from reasonctl.core.output_lock import LOCK_FILE, read_holder
from tests.test_fsdp import assert_close_runs, losses, write_run_files

TESTS = Path(__file__).parent
HOST = socket.gethostname()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launcher(config: Path, out: Path, *extra: str, backend: str = "fsdp",
             env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``reasonctl run --backend fsdp --config config --output-dir out extra...``."""
    command = [sys.executable, "-m", "reasonctl", "run", "--backend", backend,
               "--config", str(config), "--output-dir", str(out), *extra]
    return subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def two_launchers(config: Path, out: Path, *extra: str, port: int | None = None,
                  node1: tuple[str, ...] = ()) -> list[subprocess.Popen[str]]:
    """Nodes 0 and 1 of ``--nnodes 2`` on this machine, one process each."""
    endpoint = f"127.0.0.1:{port or free_port()}"
    common = ("--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, *extra)
    first = launcher(config, out, *common, "--node-rank", "0")
    second = launcher(config, out, *common, "--node-rank", "1", *node1)
    return [first, second]


# --- flags and rendezvous (default suite) ----------------------------------------------------


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """``reasonctl run args...`` in this process; starting workers fails the test."""
    from reasonctl.cli import common, launch
    from reasonctl.cli.app import build_app

    def no_workers(*_: Any, **__: Any) -> int:
        raise AssertionError("a worker was started for flags that cannot work")

    monkeypatch.setattr(launch, "launch_workers", no_workers)
    app = build_app(common.init_host(strict=False))
    result = CliRunner().invoke(app, ["run", *args])
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(("flags", "expected"), [
    (["--nnodes", "0"], "--nnodes '0': expected 1 <= MIN <= MAX"),
    (["--nnodes", "3:2"], "--nnodes '3:2': expected 1 <= MIN <= MAX"),
    (["--nnodes", "two"], "--nnodes 'two': expected a node count N or a range MIN:MAX"),
    (["--nnodes", "2", "--node-rank", "0"], "a multi-node run needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
     "give each node's launcher --node-rank (0 on the node that holds the output directory's "
     "lock"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
     "--node-rank 2: the run has at most 2 node(s) (--nnodes 2), so node ranks go from 0 to 1"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:99999"],
     "the port must be a number from 1 to 65535"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "head node:29400"],
     "expected HOST:PORT of the rendezvous"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "no-such-host.invalid:29400"],
     "cannot resolve the host 'no-such-host.invalid'"),
    (["--nproc-per-node", "2", "--rdzv-id", "my run"],
     "--rdzv-id 'my run': use letters, digits, '.', '_' or '-'"),
    (["--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400",
      "--backend", "single"], "the 'single' backend runs one process"),
])
def test_bad_launcher_flags_exit_2_before_any_worker_starts(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        flags: list[str], expected: str) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    args = ["--config", str(config), "--output-dir", str(tmp_path / "out"),
            "--set", "backend.device='cpu'"]
    if "--backend" not in flags:
        args += ["--backend", "fsdp"]
    code, output = run_cli(monkeypatch, *args, *flags)
    assert code == 2, output
    assert expected in output, output
    assert "Traceback" not in output
    assert not (tmp_path / "out" / LOCK_FILE).exists()  # nothing was started or locked


def test_an_elastic_range_checks_the_layout_of_every_node_count(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--nnodes 1:3`` with 2 processes each: 6 processes cannot share a global batch of 4."""
    config = write_run_files(tmp_path, tiny_model_dir)
    code, output = run_cli(monkeypatch, "--config", str(config), "--backend", "fsdp",
                           "--set", "backend.device='cpu'", "--nproc-per-node", "2",
                           "--nnodes", "1:3", "--node-rank", "0",
                           "--rdzv-endpoint", "127.0.0.1:29400")
    assert code == 2, output
    assert "train.global_batch_size: 4 is not a multiple of 6 data-parallel ranks" in output


@pytest.mark.distributed
def test_a_rendezvous_nobody_joins_ends_within_its_timeout(tmp_path: Path,
                                                           tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    port = free_port()
    started = time.monotonic()
    code, output = finish(launcher(
        config, tmp_path / "out", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lonely", "--rdzv-timeout", "5"),
        timeout=120)
    elapsed = time.monotonic() - started
    assert code == 2, output
    text = " ".join(output.split())
    assert (f"the rendezvous at 127.0.0.1:{port} (--rdzv-id lonely) did not complete within "
            "5s (--rdzv-timeout): fewer than 2 node(s) joined") in text
    assert "--nnodes 2" in text and "each with its own --node-rank" in text
    assert elapsed < 60, elapsed  # the timeout plus start-up, not torch's 15 minutes
    assert read_holder(tmp_path / "out" / LOCK_FILE) == {}  # the lock was given back


@pytest.mark.distributed
def test_nodes_that_disagree_on_the_config_stop_naming_the_keys(tmp_path: Path,
                                                                tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    procs = two_launchers(config, tmp_path / "out", node1=("--set", "train.lr=0.2"))
    results = [finish(proc, timeout=300) for proc in procs]
    for code, output in results:
        assert code == 2, output
        text = " ".join(output.split())
        assert "the nodes of this run were started with different configs" in text, text
        assert "train.lr: " in text and "0.2 on node" in text and "0.005 on node" in text
        assert f"(host {HOST}, --node-rank 1)" in text and "Traceback" not in text
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # nothing trained


# --- two launchers = one launcher with two processes (slow) -----------------------------------


@pytest.fixture(scope="module")
def one_launcher(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The SFT run of ``test_fsdp`` on one launcher with two processes."""
    root = tmp_path_factory.mktemp("one-launcher")
    config = write_run_files(root, tiny_model_dir)
    code, output = finish(launcher(config, root / "run", "--nproc-per-node", "2"))
    assert code == 0, output
    return root


@pytest.mark.slow
@pytest.mark.distributed
def test_two_launchers_train_sft_as_one_launcher_and_node_0_holds_the_lock(
        tmp_path: Path, tiny_model_dir: Path, one_launcher: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    node0, node1 = two_launchers(config, out)
    deadline = time.monotonic() + 120
    while read_holder(out / LOCK_FILE).get("pid") != node0.pid:
        assert time.monotonic() < deadline and node0.poll() is None, finish(node0)
        time.sleep(0.1)
    # another launcher on the same directory is refused while the two train
    intruder = launcher(config, out, "--nproc-per-node", "1", "--nnodes", "2", "--node-rank",
                        "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
    code, output = finish(intruder, timeout=120)
    assert code == 2, output
    assert f"is in use by another run (host {HOST}, pid {node0.pid}" in " ".join(output.split())
    assert node0.poll() is None or node0.returncode == 0  # the run went on
    results = [finish(node0), finish(node1)]
    assert [code for code, _ in results] == [0, 0], results
    assert "run completed: 6 steps" in results[0][1] + results[1][1]
    assert read_holder(out / LOCK_FILE) == {}
    assert_close_runs(out, one_launcher / "run", range(1, 7), rel=1e-6)


GRPO_CONFIG = """
[run]
seed = 5
[model]
name_or_path = "{model}"
max_length = 64
[data]
format = "jsonl"
[data.jsonl]
path = "{data}"
[algorithm]
name = "grpo"
[algorithm.grpo]
prompts_per_step = 4
[rollout]
n = 4
max_new_tokens = 4
[train]
lr = 1e-2
max_steps = 3
micro_batch_size = 4
[backend]
device = "cpu"
[[rewards.components]]
name = "length"
max_length = 3
buffer = 3
[checkpoint]
export_final = false
[logging]
loggers = ["jsonl"]
plot = false
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_two_launchers_train_grpo_as_one_launcher(tmp_path: Path, tiny_model_dir: Path) -> None:
    import json

    from reasonctl.loggers.metrics_file import read_metrics

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w} twice.", "reference": w}) + "\n"
                            for w in ("red", "blue", "green", "gold", "gray", "pink", "tan",
                                      "teal")))
    config = tmp_path / "grpo.toml"
    config.write_text(GRPO_CONFIG.format(model=tiny_model_dir, data=data))
    code, output = finish(launcher(config, tmp_path / "one", "--nproc-per-node", "2"))
    assert code == 0, output
    results = [finish(p) for p in two_launchers(config, tmp_path / "two")]
    assert [code for code, _ in results] == [0, 0], results
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    two = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in two] == [1, 2, 3]
    for want, got in zip(one, two, strict=True):
        for key in ("loss", "reward/mean", "grad_norm", "response_length/mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (got["step"], key)
    assert any(r["grad_norm"] > 0 for r in two)  # something was learned from


# --- restarts and signals through the agent (faults) ------------------------------------------

KILL_SITE = """
import os, signal
if (os.environ.get("RANK") == os.environ.get("KILL_RANK")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
    import reasonctl.core.lifecycle as _lifecycle
    _original = _lifecycle.LifecycleHooks.on_step_end

    def _on_step_end(self, ctx, step, metrics):
        _original(self, ctx, step, metrics)
        if step == int(os.environ["KILL_AT_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)

    _lifecycle.LifecycleHooks.on_step_end = _on_step_end
"""


def kill_env(tmp_path: Path, rank: int, step: int) -> dict[str, str]:
    """Environment whose worker of global rank ``rank`` SIGKILLs itself in step ``step``
    of the first start (not after a restart)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(KILL_SITE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"KILL_RANK": str(rank), "KILL_AT_STEP": str(step), "PYTHONPATH": path}


@pytest.mark.faults
@pytest.mark.distributed
def test_a_killed_worker_restarts_the_group_which_resumes_to_the_unbroken_losses(
        tmp_path: Path, tiny_model_dir: Path, one_launcher: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)  # a checkpoint every 3 steps
    out = tmp_path / "run"
    code, output = finish(launcher(config, out, "--nproc-per-node", "2", "--max-restarts", "1",
                                   env=kill_env(tmp_path, rank=1, step=5)))
    text = " ".join(output.split())
    assert code == 0, output
    assert ("worker local rank 1 (pid " in text and "of node rank 0 was killed by SIGKILL (out "
            "of memory, or killed from outside); restarting the worker group (restart 1 of 1, "
            "--max-restarts)") in text, text
    assert (f"restart 1 of 1 (--max-restarts) after a worker failed: resuming from step 3 "
            f"({out / 'checkpoints' / 'step_3'})") in text, text
    assert "run completed: 6 steps" in text
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]  # the killed attempt's step 4-5 rows went
    assert_close_runs(out, one_launcher / "run", range(1, 7), rel=1e-6)


@pytest.mark.faults
@pytest.mark.distributed
def test_a_worker_killed_on_one_of_two_nodes_restarts_both_to_the_unbroken_losses(
        tmp_path: Path, tiny_model_dir: Path, one_launcher: Path) -> None:
    """Every node's group starts again, counted as a restart or as the other node leaving
    and joining the rendezvous, and every one resumes from the same checkpoint."""
    config = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
              "--max-restarts", "1")
    env = kill_env(tmp_path, rank=1, step=5)
    nodes = [launcher(config, out, *common, "--node-rank", str(rank), env=env)
             for rank in (0, 1)]
    results = [finish(node) for node in nodes]
    assert [code for code, _ in results] == [0, 0], results
    text = " ".join((results[0][1] + results[1][1]).split())
    assert "was killed by SIGKILL" in text
    assert f"resuming from step 3 ({out / 'checkpoints' / 'step_3'})" in text, text
    assert "moved" not in text  # no group started over and retired the checkpoints
    assert_close_runs(out, one_launcher / "run", range(1, 7), rel=1e-6)


@pytest.mark.faults
@pytest.mark.distributed
def test_without_restarts_the_launcher_exits_with_the_killed_workers_status(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    code, output = finish(launcher(config, tmp_path / "run", "--nproc-per-node", "2",
                                   env=kill_env(tmp_path, rank=0, step=2)))
    assert code == 128 + signal.SIGKILL, output
    text = " ".join(output.split())
    assert ("worker local rank 0 (pid " in text and "was killed by SIGKILL" in text
            and "no restarts (--max-restarts 0): stopping the other workers") in text, text
    assert read_holder(tmp_path / "run" / LOCK_FILE) == {}


@pytest.mark.faults
@pytest.mark.distributed
def test_sigterm_through_the_agent_checkpoints_and_exits_0_without_a_restart(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    proc = launcher(config, out, "--nproc-per-node", "2", "--max-restarts", "2",
                    "--set", "train.max_steps=400", "--set", "checkpoint.every_steps=0")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc)
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc, timeout=300)
    assert code == 0, output
    text = " ".join(output.split())
    assert "SIGTERM: asking the workers to checkpoint and stop" in text
    stopped = int(text.split("stopping at step ")[1].split()[0])
    assert "workers stopped on SIGTERM after their checkpoint" in text
    assert "restart" not in text and "Traceback" not in text
    saved = CheckpointManager(out / "checkpoints", keep=1, is_main=True).complete()
    assert [c.step for c in saved] == [stopped]


# --- two GPUs (NCCL): run where two CUDA devices exist --------------------------------------

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available()
                                    or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA GPUs (NCCL)")
CUDA = ("--set", "backend.device='cuda'")


@needs_two_gpus
@pytest.mark.faults
def test_on_two_gpus_a_killed_worker_restarts_to_the_unbroken_losses(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    code, output = finish(launcher(config, tmp_path / "unbroken", "--nproc-per-node", "2", *CUDA))
    assert code == 0, output
    out = tmp_path / "restarted"
    started = time.monotonic()
    code, output = finish(launcher(config, out, "--nproc-per-node", "2", "--max-restarts", "1",
                                   *CUDA, env=kill_env(tmp_path, rank=1, step=5)))
    assert code == 0, output
    text = " ".join(output.split())
    assert "was killed by SIGKILL" in text and "resuming from step 3" in text, text
    assert_close_runs(out, tmp_path / "unbroken", range(1, 7), rel=1e-5)
    print(f"restarted run: {time.monotonic() - started:.1f}s")


@needs_two_gpus
@pytest.mark.faults
def test_on_two_gpus_sigterm_exits_0_after_the_checkpoint(tmp_path: Path,
                                                          tiny_model_dir: Path) -> None:
    config = write_run_files(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    proc = launcher(config, out, "--nproc-per-node", "2", *CUDA, "--set", "train.max_steps=400",
                    "--set", "checkpoint.every_steps=0")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc)
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc, timeout=300)
    assert code == 0, output
    stopped = int(" ".join(output.split()).split("stopping at step ")[1].split()[0])
    saved = CheckpointManager(out / "checkpoints", keep=1, is_main=True).complete()
    assert [c.step for c in saved] == [stopped]
