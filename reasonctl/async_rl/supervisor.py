"""The rollout workers a trainer started on its node, kept running.

:class:`WorkerSupervisor` starts them (:func:`~reasonctl.async_rl.processes.start_worker`)
and, each time :meth:`WorkerSupervisor.check` runs (the trainer's heartbeat thread), starts
again under a new name each one that died while the run goes on, up to
``rollout.workers.max_restarts`` times per worker, saying what ended it. A worker that
exited with status 2 (a usage error, such as a model that does not fit the trainer's
weights) would fail the same way again and is not restarted; one that exited 0 finished.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reasonctl.async_rl.processes import start_worker, stop_process
from reasonctl.core.exit_status import describe_exit

USAGE_STATUS = 2


@dataclass
class StartedWorker:
    """One worker slot: how to start it and its current process."""

    name: str
    arguments: list[str]
    """``reasonctl worker rollout`` arguments, without ``--name``."""
    log: Path
    env: dict[str, str] | None
    process: subprocess.Popen[bytes]
    restarts: int = 0
    given_up: bool = False

    @property
    def current_name(self) -> str:
        """The name of the current process (``<name>.r<N>`` after N restarts)."""
        return self.name if not self.restarts else f"{self.name}.r{self.restarts}"


class WorkerSupervisor:
    """Starts this node's rollout workers and restarts those that die (bounded)."""

    def __init__(self, max_restarts: int, log: Callable[[str], None]) -> None:
        self.max_restarts = max_restarts
        self.log = log
        self.workers: list[StartedWorker] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self, name: str, arguments: list[str], log: Path,
              env: dict[str, str] | None = None) -> None:
        """Start the worker ``name``."""
        worker = StartedWorker(name, arguments, log, env, self._spawn(name, arguments, log, env))
        self.workers.append(worker)

    def check(self) -> None:
        """Restart each worker that died since the last check (while the run goes on)."""
        with self._lock:
            if self._closed:
                return
            for worker in self.workers:
                code = worker.process.poll()
                if code is None or code == 0 or worker.given_up:
                    continue
                what = (f"rollout worker {worker.current_name} (pid {worker.process.pid}) "
                        f"{describe_exit(code)}")
                if code == USAGE_STATUS:
                    worker.given_up = True
                    self.log(f"{what}: a usage error, which a restart would repeat; not "
                             f"restarted (its log: {worker.log})")
                elif worker.restarts >= self.max_restarts:
                    worker.given_up = True
                    self.log(f"{what}; not restarted: it used its {self.max_restarts} "
                             f"restart(s) (rollout.workers.max_restarts; its log: {worker.log})")
                else:
                    worker.restarts += 1
                    worker.process = self._spawn(worker.current_name, worker.arguments,
                                                 worker.log, worker.env)
                    self.log(f"{what}; restarted it as {worker.current_name} (pid "
                             f"{worker.process.pid}; restart {worker.restarts} of "
                             f"{self.max_restarts}, rollout.workers.max_restarts)")

    def close(self, *, finished: bool, timeout_s: float = 15.0) -> None:
        """No more restarts; give the workers ``timeout_s`` to see a finished run end,
        then stop any still running (a stopped run's workers at once)."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()) if finished else 0.01)
            except subprocess.TimeoutExpired:
                stop_process(worker.process, 10.0)

    @staticmethod
    def _spawn(name: str, arguments: list[str], log: Path, env: dict[str, str] | None
               ) -> subprocess.Popen[bytes]:
        return start_worker([*arguments, "--name", name], log, env=env)
