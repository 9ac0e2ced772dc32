"""Child processes of a trainer: a local ``redis-server`` and rollout worker processes.

Both are started so that they end with the process that started them (``PR_SET_PDEATHSIG``
on Linux): a killed trainer leaves no orphan behind, while the Redis data directory
(append-only file) keeps the run's state for ``--resume``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from reasonctl.core.errors import ReasonctlError

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                      "MASTER_ADDR", "MASTER_PORT")
"""Variables of torch's elastic launcher that must not leak into a worker's environment."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """A ``redis-server`` on 127.0.0.1 whose append-only state lives in ``directory``."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, directory: Path) -> None:
        self.process = process
        self.port = port
        self.directory = directory

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, directory: Path, *, timeout_s: float = 30.0) -> LocalRedis:
        """Start the server (its existing state in ``directory`` is loaded) and wait until
        it answers; raise :class:`ReasonctlError` with its log when it does not."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise ReasonctlError("redis-server is not on PATH: install it (apt-get install "
                                 "redis-server) or set rollout.workers.redis_url")
        directory.mkdir(parents=True, exist_ok=True)
        port = free_port()
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
                   "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                   "--daemonize", "no", "--protected-mode", "yes", "--logfile", "redis.log"]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        server = cls(process, port, directory)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return server
            except OSError:
                pass
            time.sleep(0.1)
        server.stop()
        log = directory / "redis.log"
        tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
        raise ReasonctlError(f"redis-server did not start on port {port} within {timeout_s:g}s"
                             f"; its log ({log}):\n{tail}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the server down (it writes its append-only file first)."""
        stop_process(self.process, timeout_s)


def start_worker(arguments: list[str], log_path: Path, *, env: dict[str, str] | None = None
                 ) -> subprocess.Popen[bytes]:
    """Start ``python -m reasonctl worker rollout <arguments>``, logging to ``log_path``."""
    environment = {k: v for k, v in (env or os.environ).items()
                   if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log: IO[Any] = log_path.open("ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "reasonctl", "worker", "rollout", *arguments],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=environment,
            preexec_fn=_die_with_parent,
        )
    finally:
        log.close()


def stop_process(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
