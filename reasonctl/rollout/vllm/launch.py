"""Starting and stopping a vLLM OpenAI-compatible server as a child process.

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script is not used: some builds ship one that fails to start) with the development
routes on (``VLLM_SERVER_DEV_MODE=1``: pause/resume and weight updates), the
``reasonctl_gloo`` weight-transfer backend and reasonctl's log-prob convention. Its
output goes to a log file whose tail is shown when it fails to come up. The child is
its own process group, stopped on :meth:`ServerProcess.stop` or at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reasonctl.rollout.vllm.http import ServerClient, ServerError

DEV_ROUTES_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def free_port(host: str) -> int:
    """A TCP port on ``host`` that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_arguments(engine_args: dict[str, Any], *, host: str, port: int,
                     served_name: str) -> list[str]:
    """``vllm.LLM`` keywords as the server's command-line flags."""
    argv = ["--host", host, "--port", str(port), "--served-model-name", served_name]
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if key == "model":
            argv += ["--model", str(value)]
        elif isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


class ServerProcess:
    """A vLLM server this process started; ``url`` is its base URL once :meth:`start` ran."""

    def __init__(self, argv: list[str], *, env: dict[str, str], log_path: Path,
                 url: str) -> None:
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv]
        self.env = {**os.environ, **DEV_ROUTES_ENV, **env}
        self.log_path = log_path
        self.url = url
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, client: ServerClient, *, timeout_s: float) -> None:
        """Start the server and wait until ``/health`` answers (or it exits, or times out)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the vLLM server exited with code {self.process.returncode} "
                                  f"while starting; its log ({self.log_path}) ends with:\n"
                                  f"{self.log_tail()}")
            if client.healthy():
                return
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"the vLLM server did not answer {self.url}/health within "
                          f"{timeout_s:.0f} s ([rollout.vllm.server] startup_timeout_s); "
                          f"its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after ``grace_s``)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
