"""Multi-process runs: one ``python -m reasonctl run`` worker per local rank, supervised.

The launcher starts ``--nproc-per-node`` workers with the environment
``torch.distributed`` reads (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): on one node the
rendezvous is 127.0.0.1 on a free port; across nodes it is ``--rdzv-endpoint``, the
``HOST:PORT`` of node 0, where global rank 0 listens.

- **Signals.** SIGTERM, SIGINT and SIGUSR1 sent to the launcher are forwarded to every
  worker. Workers run in their own process group, so a terminal's Ctrl-C reaches them once,
  through the launcher. The launcher exits with the workers' status: 0 after a
  checkpoint-and-stop.
- **Failures.** When a worker fails, the others are sent SIGTERM and, if still running after
  :data:`GRACE_S`, SIGKILL; the launcher exits with the first failure's status (128 + the
  signal number for a worker killed by a signal).
- **Workers die with their launcher.** Each worker asks the kernel for SIGTERM when its
  parent dies (``PR_SET_PDEATHSIG`` on Linux) and checks that its launcher is still the
  parent; elsewhere a watchdog thread polls for the parent instead
  (:func:`follow_launcher`). The SIGTERM makes the workers checkpoint and stop.
- **One writer per output directory.** The launcher on node 0 holds the output directory's
  lock (:mod:`reasonctl.core.output_lock`) for its workers and shares the locked file with
  them, so the directory stays locked until the last worker has exited.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing, nullcontext
from pathlib import Path
from typing import Any

from reasonctl.core.output_lock import HOLDER_ENV, held_fd, output_lock
from reasonctl.core.signals import STOP_SIGNALS

LAUNCHER_PID_ENV = "REASONCTL_LAUNCHER_PID"
GRACE_S = 30.0
"""How long workers get to exit after another worker failed before they are killed."""
_PR_SET_PDEATHSIG = 1


def launch_workers(run_args: list[str], nproc_per_node: int, nnodes: int, node_rank: int,
                   rdzv_endpoint: str | None, *, output_dir: str) -> int:
    """Start ``python -m reasonctl <run_args>`` on every local rank; return the exit code."""
    if nnodes > 1:
        if rdzv_endpoint is None or ":" not in rdzv_endpoint:
            print("error: multi-node runs need --rdzv-endpoint HOST:PORT (node 0's address)",
                  file=sys.stderr)
            return 2
        master_addr, _, master_port = rdzv_endpoint.rpartition(":")
    elif rdzv_endpoint is not None:
        master_addr, _, master_port = rdzv_endpoint.rpartition(":")
    else:
        master_addr, master_port = "127.0.0.1", str(_free_port())
    lock = output_lock(Path(output_dir), log=_stderr) if node_rank == 0 else nullcontext()
    with lock as token:
        env = {**os.environ, "MASTER_ADDR": master_addr, "MASTER_PORT": master_port,
               "WORLD_SIZE": str(nproc_per_node * nnodes),
               "LOCAL_WORLD_SIZE": str(nproc_per_node), "GROUP_RANK": str(node_rank),
               LAUNCHER_PID_ENV: str(os.getpid())}
        env.setdefault("OMP_NUM_THREADS", "1")
        fd = held_fd(token) if token else None
        if token:
            env[HOLDER_ENV] = token
        return Supervisor(run_args, nproc_per_node, node_rank, env,
                          pass_fds=(fd,) if fd is not None else ()).run()


class Supervisor:
    """Starts the local workers, forwards stop signals and collects their exit status."""

    def __init__(self, run_args: list[str], nproc: int, node_rank: int,
                 env: dict[str, str], *, pass_fds: tuple[int, ...] = ()) -> None:
        self.command = [sys.executable, "-m", "reasonctl", *run_args]
        self.pass_fds = pass_fds
        """Descriptors the workers inherit (the output directory's lock)."""
        self.nproc = nproc
        self.node_rank = node_rank
        self.env = env
        self.workers: list[subprocess.Popen[bytes]] = []

    def run(self) -> int:
        """Run the workers to the end; the exit code the launcher should return."""
        previous = {sig: signal.signal(sig, self._forward) for sig in _signals()}
        try:
            for local_rank in range(self.nproc):
                rank = self.node_rank * self.nproc + local_rank
                env = {**self.env, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
                self.workers.append(subprocess.Popen(self.command, env=env, process_group=0,
                                                     pass_fds=self.pass_fds))
            return self._wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._kill_all(signal.SIGKILL)  # nothing outlives the launcher

    def _forward(self, signum: int, frame: Any) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                try:
                    os.kill(worker.pid, signum)
                except ProcessLookupError:
                    pass

    def _wait(self) -> int:
        failure: int | None = None
        failed_at = 0.0
        while True:
            codes = [worker.poll() for worker in self.workers]
            if all(code is not None for code in codes):
                break
            if failure is None:
                failed = [c for c in codes if c is not None and c != 0]
                if failed:
                    failure, failed_at = _status(failed[0]), time.monotonic()
                    print(f"error: a worker exited with status {failure}; stopping the others",
                          file=sys.stderr, flush=True)
                    self._kill_all(signal.SIGTERM)
            elif time.monotonic() - failed_at > GRACE_S:
                self._kill_all(signal.SIGKILL)
            time.sleep(0.1)
        if failure is not None:
            return failure
        return next((_status(c) for c in codes if c), 0)

    def _kill_all(self, sig: int) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                try:
                    os.kill(worker.pid, sig)
                except ProcessLookupError:
                    pass


def follow_launcher() -> None:
    """In a worker: receive SIGTERM when the launcher dies (checkpoint, then stop).

    Uses the kernel's parent-death signal on Linux; elsewhere, or when the launcher is not
    reasonctl's, a daemon thread polls for the parent once a second.
    """
    expected = os.environ.get(LAUNCHER_PID_ENV)
    parent = int(expected) if expected and expected.isdigit() else os.getppid()
    if sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGTERM):
        if os.getppid() != parent:  # the launcher died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="reasonctl-launcher-watch", daemon=True).start()


def _set_parent_death_signal(sig: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _signals() -> list[signal.Signals]:
    return [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]


def _status(code: int) -> int:
    """A worker's exit status as a shell reports it (128 + N when killed by signal N)."""
    return 128 - code if code < 0 else code


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
