"""Real reward services and Redis servers on 127.0.0.1 for the tests.

* :class:`InProcessService`: ``RewardService`` under uvicorn in a thread of the test (real
  HTTP on a free port), built from a config dict and any registry;
* :class:`ServiceProcess`: ``reasonctl serve-rewards`` as a subprocess (for restarts);
* :class:`RedisServer`: Debian's ``redis-server`` on a free port in a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w

from tests.storage_servers import free_port

REPO = Path(__file__).resolve().parents[1]
TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def service_config(rewards: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    """A service config dict serving ``rewards`` (token from REASONCTL_REWARD_TOKEN)."""
    config: dict[str, Any] = {"server": {"log_format": "text"},
                              "rewards": {"components": rewards}}
    for name, values in sections.items():
        config[name] = values
    return config


def wait_healthy(url: str, timeout: float = 60.0, process: Any = None) -> None:
    """Wait until ``url``/health answers 200."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the service exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy within {timeout} s")


class InProcessService:
    """A reward service under uvicorn in a background thread."""

    def __init__(self, config: dict[str, Any], registry: Any) -> None:
        import uvicorn

        from reasonctl.reward_service.auth import Tokens
        from reasonctl.reward_service.config import validate_service_config
        from reasonctl.reward_service.server import RewardService

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = validate_service_config(config, registry)
        self.service = RewardService(cfg, registry, tokens=Tokens([TOKEN]))
        self.server = uvicorn.Server(uvicorn.Config(
            self.service.app(), host="127.0.0.1", port=self.port, log_config=None,
            access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessService:
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metrics(self) -> dict[str, Any]:
        """``GET /metrics``."""
        return httpx.get(f"{self.url}/metrics", headers=AUTH, timeout=10).json()


class ServiceProcess:
    """``reasonctl serve-rewards`` in a subprocess, with its stderr kept in a file."""

    def __init__(self, config: dict[str, Any], directory: Path, *, port: int | None = None,
                 env: dict[str, str] | None = None, redis: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path = directory / "service.toml"
        self.config_path.write_text(tomli_w.dumps(config))
        self.env = {**os.environ, "REASONCTL_REWARD_TOKEN": TOKEN,
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    **(env or {})}
        self.redis = redis
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> ServiceProcess:
        """Start (again) and wait until healthy."""
        self.starts += 1
        log = (self.directory / f"service-{self.starts}.log").open("wb")
        command = [sys.executable, "-m", "reasonctl", "serve-rewards", "--config",
                   str(self.config_path), "--port", str(self.port)]
        if self.redis:
            command += ["--redis", self.redis]
        self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=log,
                                        cwd=self.directory)
        wait_healthy(self.url, timeout=120, process=self.process)
        return self

    def kill(self) -> None:
        """SIGKILL: the service gets no chance to clean up."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(30)

    def stop(self) -> None:
        """SIGTERM and wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def log(self) -> str:
        """Everything the service wrote to stderr, all starts."""
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.directory.glob("service-*.log")))


class RedisServer:
    """``redis-server`` on a free port of 127.0.0.1, data in ``directory``."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self.binary = binary
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        """Start and wait for PONG."""
        import redis

        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.directory), "--save", "", "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        end = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        """Terminate the server."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(20)
