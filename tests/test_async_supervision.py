"""Separate rollout workers kept alive and ended cleanly, on a real redis-server, through the
commands a user types: a worker joined by hand exits 0 saying the run finished when the
trainer completes (also when the trainer stops the Redis it started); a worker the run
started is restarted when it is SIGKILLed, nothing lost or trained twice; a worker lost
mid-run is named within its heartbeat TTL, and a run left without workers checkpoints,
stops saying what to do, and resumes once a worker joins."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from redis_support import needs_redis, redis_server, redis_url  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.slow, needs_redis]

STEPS = 4


def write_config(root: Path, model_dir: Path, **workers: Any) -> Path:
    """A tiny GRPO run with separate rollout workers (on the trainer's own Redis unless
    ``redis_url`` is given)."""
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Item {i}. Reply with {'AB'[i % 2]}.",
                                        "reference": "AB"[i % 2]}) + "\n" for i in range(8)))
    config = {
        "run": {"name": "supervised", "output_dir": str(root / "run"), "seed": 0},
        "model": {"name_or_path": str(model_dir), "max_length": 64},
        "data": {"format": "jsonl", "jsonl": {"path": str(data)}},
        "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 2}},
        "rollout": {"n": 4, "max_new_tokens": 6, "temperature": 1.0, "placement": "separate",
                    "workers": {"heartbeat_ttl_s": 2.0, "wait_timeout_s": 120.0,
                                "max_staleness": 0, **workers}},
        "rewards": {"components": [{"name": "length", "max_length": 3, "buffer": 3}]},
        "train": {"lr": 1e-2, "max_steps": STEPS, "micro_batch_size": 4},
        "backend": {"name": "single", "device": "cpu"},
        "checkpoint": {"export_final": False, "every_steps": 1},
        "logging": {"loggers": ["jsonl"]},
    }
    path = root / "config.toml"
    path.write_text(tomli_w.dumps(config))
    return path


class Logged:
    """A process whose stderr+stdout lines are read as they come, with arrival times."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def text(self) -> str:
        return " ".join(" ".join(line for _, line in self.lines).split())

    def wait_for(self, pattern: str, timeout: float = 300) -> tuple[float, re.Match[str]]:
        """The arrival time and match of the first line matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return at, found
            assert self.process.poll() is None or self._reader.is_alive(), self.text[-4000:]
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}: {self.text[-4000:]}")

    def finish(self, timeout: float = 600) -> int:
        code = self.process.wait(timeout)
        self._reader.join(10)
        return code


def trainer(config: Path, *extra: str) -> Logged:
    return Logged([sys.executable, "-m", "reasonctl", "run", "--config", str(config), *extra])


def hand_worker(url: str, run_id: str, name: str) -> Logged:
    return Logged([sys.executable, "-m", "reasonctl", "worker", "rollout", "--redis", url,
                   "--run", run_id, "--device", "cpu", "--name", name])


def run_and_url(train: Logged) -> tuple[str, str]:
    _, found = train.wait_for(r"rollout workers: run (\S+) on (redis://\S+) ")
    return found.group(1), found.group(2)


def ledger_steps(url: str, run_id: str) -> list[int]:
    from reasonctl.async_rl.transport import Transport

    return sorted(int(row["step"]) for row in Transport.open(url, run_id, timeout_s=5).ledger())


def test_a_hand_joined_worker_exits_0_when_the_run_finishes(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    """The trainer started its own Redis and stops it at the end: the worker sees the run
    finish first and leaves, instead of losing Redis and asking for --resume."""
    config = write_config(tmp_path, tiny_model_dir, count=0)
    train = trainer(config)
    run_id, url = run_and_url(train)
    worker = hand_worker(url, run_id, "by-hand")
    assert train.finish() == 0, train.text[-4000:]
    assert worker.finish(timeout=60) == 0, worker.text[-4000:]
    assert "worker by-hand: " in worker.text
    assert worker.text.endswith("prompt batches; the run finished (its trainer completed it)")
    assert "lost the connection" not in worker.text and "--resume" not in worker.text
    assert "rollout worker(s) joined: by-hand (1 alive)" in train.text


def test_a_started_worker_that_is_killed_is_restarted_and_nothing_is_lost(
        tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    config = write_config(tmp_path, tiny_model_dir, count=1, max_restarts=2,
                          redis_url=redis_url)
    train = trainer(config)
    run_id, url = run_and_url(train)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not metrics.exists() or not metrics.read_text().strip():
        assert train.process.poll() is None and time.monotonic() < deadline, train.text[-4000:]
        time.sleep(0.2)
    (worker,) = [pid for pid in _children(train.process.pid)
                 if b"worker\0rollout" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(worker, signal.SIGKILL)
    assert train.finish() == 0, train.text[-4000:]
    text = train.text
    name = re.search(r"rollout worker (\S+-w0) \(pid " + str(worker), text)
    assert name, text[-4000:]
    assert (f"rollout worker {name.group(1)} (pid {worker}) was killed by SIGKILL (out of memory, "
            f"or killed from outside); restarted it as {name.group(1)}.r1 (pid ") in text
    assert "restart 1 of 2, rollout.workers.max_restarts)" in text
    assert ledger_steps(url, run_id) == list(range(STEPS))  # each step trained once


def test_a_lost_worker_is_named_and_a_run_without_workers_checkpoints_and_stops(
        tmp_path: Path, tiny_model_dir: Path, redis_url: str) -> None:
    config = write_config(tmp_path, tiny_model_dir, count=0, wait_timeout_s=25.0,
                          redis_url=redis_url)
    train = trainer(config)
    run_id, url = run_and_url(train)
    worker = hand_worker(url, run_id, "doomed")
    train.wait_for(r"rollout worker\(s\) joined: doomed")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"
    deadline = time.monotonic() + 300
    while not checkpoint.is_dir():
        assert train.process.poll() is None and time.monotonic() < deadline, train.text[-4000:]
        time.sleep(0.1)
    worker.process.kill()
    killed_at = time.monotonic()
    worker.finish()
    named_at, _ = train.wait_for(r"rollout worker\(s\) stopped heartbeating: doomed \(0 alive; "
                                 r"the run checkpoints and stops if none is alive for 25s")
    assert named_at - killed_at < 2.0 + 5.0  # the TTL, a wait for rollouts, some load
    assert train.finish() == 1, train.text[-4000:]
    text = train.text
    stopped = re.search(r"The (\d+) step\(s\) done are saved in (\S+); once that is fixed, "
                        r"the same command with --resume continues from there", text)
    assert stopped, text[-4000:]
    assert (f"no rollout worker has been alive for 25s (rollout.workers.wait_timeout_s) while "
            f"step {int(stopped.group(1)) + 1} waited for its rollouts; start one with "
            f"`reasonctl worker rollout --redis {url} --run {run_id}`") in text
    saved = Path(stopped.group(2))
    assert saved.name == f"step_{stopped.group(1)}" and (saved / "manifest.json").is_file()

    resumed = trainer(config, "--resume")
    resumed.wait_for(rf"rollout workers: run {run_id} on ")
    rescuer = hand_worker(url, run_id, "rescuer")
    assert resumed.finish() == 0, resumed.text[-4000:]
    assert rescuer.finish(timeout=60) == 0, rescuer.text[-4000:]
    assert f"resuming from {saved}" in resumed.text
    assert ledger_steps(url, run_id) == list(range(STEPS))


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2:].split()[1] == str(pid):
                found.append(int(entry.name))
    return found
