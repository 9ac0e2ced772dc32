"""Running untrusted Python: a separate, confined process per run, from the trainer's side.

:class:`Sandbox` starts ``sandbox_boot.py`` (:mod:`.sandbox_boot`) with the base
interpreter in isolated mode, a clean environment, no inherited file descriptors and a
session of its own; the starter confines the code (namespaces, private root, resource
limits, no privileges; see its docstring) and runs it. This side enforces what the code
cannot be trusted to stop by itself: the wall-clock limit and the size of its output,
killing the whole process tree (the starter's process group, and with it every process of
the code's PID namespace) when either is exceeded. Whatever the code does, a run returns a
:class:`SandboxResult`; only a host that cannot confine raises
(:class:`SandboxUnavailableError`), which :meth:`Sandbox.check` finds out before a run
starts training.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from reasonctl.core.errors import ReasonctlError
from reasonctl.environments.config import SandboxConfig

BOOT_SCRIPT = Path(__file__).with_name("sandbox_boot.py")
SETUP_FAILED = 125
SETUP_MARK = "sandbox setup failed: "
SYSTEM_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime")
"""What the interpreter needs from the host, shown read-only where it exists."""
UNPRIVILEGED = (65534, 65534)
"""The user and group (nobody) code runs as when the trainer runs as root."""


class SandboxUnavailableError(ReasonctlError):
    """The host cannot confine code as the sandbox's settings ask."""


@dataclass
class SandboxResult:
    """How one run ended: its exit status (``128 + n`` when signal ``n`` killed it), its
    output (decoded, at most ``max_output_bytes`` together), wall seconds, and whether it
    was killed for exceeding the wall-clock limit or the output limit."""

    exit_code: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    output_exceeded: bool = False

    @property
    def ok(self) -> bool:
        """True when the code exited with status 0 within its limits."""
        return self.exit_code == 0 and not self.timed_out and not self.output_exceeded

    def failure(self, config: SandboxConfig) -> str:
        """Why the run did not succeed, for an error observation (empty when it did)."""
        if self.ok:
            return ""
        if self.timed_out:
            return f"killed after the wall-clock limit of {config.wall_seconds:g}s"
        if self.output_exceeded:
            return f"killed: its output exceeded {config.max_output_bytes} bytes"
        tail = _tail(self.stderr)
        if self.exit_code == 128 + signal.SIGXCPU or (
                self.exit_code == 128 + signal.SIGKILL and not tail):
            return f"killed after the CPU time limit of {config.cpu_seconds:g}s"
        if self.exit_code == 128 + signal.SIGXFSZ:
            return f"killed: it wrote a file larger than {config.max_file_mb} MB"
        if self.exit_code > 128:
            name = signal.Signals(self.exit_code - 128).name \
                if self.exit_code - 128 in signal.Signals._value2member_map_ else "a signal"
            return f"killed by {name}" + (f":\n{tail}" if tail else "")
        return f"exit status {self.exit_code}" + (f":\n{tail}" if tail else "")


class Sandbox:
    """Runs Python code confined as ``config`` says (see the module docstring).

    Thread-safe: every run has its own process and directories. Build it with
    :meth:`checked` to find out at once whether this host can confine as asked.
    """

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.python = config.python or os.path.realpath(sys.executable)
        self.drop_to = UNPRIVILEGED if os.geteuid() == 0 else None

    @classmethod
    def checked(cls, config: SandboxConfig, *, where: str = "sandbox") -> Sandbox:
        """A sandbox known to work here, or :class:`SandboxUnavailableError` saying what
        the host lacks and which setting (under ``where``) would run without it."""
        sandbox = cls(config)
        sandbox.check(where=where)
        return sandbox

    def check(self, *, where: str = "sandbox") -> None:
        """Run a trivial program; raise :class:`SandboxUnavailableError` if the host cannot
        confine it as configured."""
        try:
            result = self.run("print('ok')")
        except SandboxUnavailableError as exc:
            reason = str(exc)
        else:
            if result.ok and result.stdout.strip() == "ok":
                return
            reason = result.stderr.strip() or result.failure(self.config)
        kinds = ["user", "PID"] + ([] if self.config.network else ["network"]) + \
            (["mount"] if self.config.private_filesystem else [])
        raise SandboxUnavailableError(
            f"the sandbox cannot run code on this host ({reason}). It confines code in "
            f"namespaces of its own ({', '.join(kinds)}), which need unprivileged user "
            "namespaces (Linux: /proc/sys/user/max_user_namespaces above 0 and, on "
            "Debian/Ubuntu, kernel.unprivileged_userns_clone = 1); the run stops rather than "
            f"run code unconfined. The interpreter is {self.python} ({where}.python)."
        )

    def run(self, code: str, *, files: dict[str, str] | None = None) -> SandboxResult:
        """Run ``code`` as ``main.py`` next to ``files`` (relative name -> text) in a fresh
        private directory, and return how it ended."""
        with tempfile.TemporaryDirectory(prefix="reasonctl-sandbox-") as tmp:
            directory = Path(tmp)
            root = directory / "root"
            work = directory / "work"
            root.mkdir()
            work.mkdir()
            if self.drop_to is not None:  # the unprivileged user must reach these
                for path in (directory, root, work):
                    os.chown(path, *self.drop_to)
            spec = self._spec(code, files or {}, root, work)
            return self._execute(spec, directory)

    def _spec(self, code: str, files: dict[str, str], root: Path, work: Path) -> dict:
        config = self.config
        for name in files:
            if name == "main.py" or Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"sandbox file name {name!r} must be a relative path inside "
                                 "the sandbox (and not main.py)")
        read_only, links = self._visible_paths()
        return {
            "network": config.network,
            "private_fs": config.private_filesystem,
            "drop_to": self.drop_to,
            "root": str(root),
            "work": str(work),
            "read_only": read_only,
            "links": links,
            "files": {**files, "main.py": code},
            "python": self.python,
            "cpu_seconds": config.cpu_seconds,
            "memory_bytes": config.memory_mb << 20,
            "max_processes": config.max_processes,
            "max_file_bytes": config.max_file_mb << 20,
            "disk_mb": config.disk_mb,
        }

    def _visible_paths(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Paths bound read-only (no one inside another) and symbolic links to recreate."""
        prefix = os.path.realpath(sys.base_prefix) if self.config.python is None \
            else os.path.dirname(os.path.dirname(os.path.realpath(self.python)))
        wanted = [*SYSTEM_PATHS, prefix, os.path.dirname(os.path.realpath(self.python)),
                  *self.config.read_only_paths]
        links: list[tuple[str, str]] = []
        paths: list[str] = []
        for path in wanted:
            if os.path.islink(path) and os.path.dirname(path) == "/":
                links.append((path, os.readlink(path)))
                continue
            real = os.path.realpath(path)
            if os.path.exists(real):
                paths.append(real)
        kept = sorted(set(paths))
        kept = [p for p in kept if not any(p != q and p.startswith(q.rstrip("/") + "/")
                                           for q in kept)]
        return kept, sorted(set(links))

    def _execute(self, spec: dict, directory: Path) -> SandboxResult:
        config = self.config
        started = time.monotonic()
        process = subprocess.Popen(
            [self.python, "-I", "-B", str(BOOT_SCRIPT)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"LANG": "C.UTF-8"},
            cwd=directory, close_fds=True, start_new_session=True,
        )
        assert process.stdin is not None and process.stdout is not None \
            and process.stderr is not None
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
        except BrokenPipeError:
            pass
        outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
        timed_out = exceeded = False
        deadline = started + config.wall_seconds + 2.0  # the starter's set-up included
        with selectors.DefaultSelector() as selector:
            for stream in (process.stdout, process.stderr):
                selector.register(stream, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(timeout=min(left, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    outputs[key.fd] += chunk
                if sum(len(b) for b in outputs.values()) > config.max_output_bytes:
                    exceeded = True
                    break
        if timed_out or exceeded:
            _kill_group(process)
        try:
            exit_code = process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process)
            exit_code = process.wait()
        for stream in (process.stdout, process.stderr):
            stream.close()
        if exit_code < 0:  # the starter itself was killed
            exit_code = 128 - exit_code
        stdout_text, stderr_text = _texts(*outputs.values(), config.max_output_bytes)
        if exit_code == SETUP_FAILED and SETUP_MARK in stderr_text:
            raise SandboxUnavailableError(
                stderr_text[stderr_text.index(SETUP_MARK):].strip().splitlines()[0])
        return SandboxResult(exit_code, stdout_text, stderr_text,
                             time.monotonic() - started, timed_out, exceeded)


def _texts(stdout: bytearray, stderr: bytearray, limit: int) -> tuple[str, str]:
    """stdout and stderr as text, cut to ``limit`` bytes together (stdout first)."""
    out = bytes(stdout[:limit])
    err = bytes(stderr[: max(0, limit - len(out))])
    return out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the starter's process group (and so the code's PID namespace)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
