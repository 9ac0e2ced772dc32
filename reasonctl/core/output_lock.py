"""One writer per output directory: ``<output_dir>/.reasonctl.lock``.

The lock is an advisory ``flock`` on that file, held for the whole run by its main
process (or by the launcher of a multi-process run, whose workers find its token in
:data:`HOLDER_ENV`). The file records the holder's host, process id and start time, so a
second run is refused with a message saying who writes there. The operating system
releases the lock when its holder dies, however it dies: a run started after a crash takes
the lock over (and says so); nothing needs cleaning up by hand. On file systems without
``flock`` support the holder's record is used instead: a live process on this host keeps
the directory, anything else is taken over.

A launcher passes the locked file to its workers (:func:`held_fd`): the ``flock`` belongs
to the open file, so the directory stays locked until the last worker has exited, even
when the launcher itself was killed and its workers are still writing a final checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reasonctl.core.errors import UsageError

LOCK_FILE = ".reasonctl.lock"
HOLDER_ENV = "REASONCTL_OUTPUT_LOCK"
"""Token of the lock a launcher holds for its workers."""
_HELD: dict[str, int] = {}
"""The locked file descriptor of each lock this process holds, by token."""


class OutputDirInUse(UsageError):
    """Another run holds the output directory."""


@contextmanager
def output_lock(output_dir: Path, *, log: Callable[[str], None]) -> Iterator[str]:
    """Hold the lock of ``output_dir`` (created if needed) while the block runs.

    Yields the lock's token (pass it to child processes as :data:`HOLDER_ENV`). Inside a
    process whose environment carries the current holder's token, the lock is already
    held for it and is not taken again. Raises :class:`OutputDirInUse` when another live
    run holds it.
    """
    path = Path(output_dir) / LOCK_FILE
    inherited = os.environ.get(HOLDER_ENV)
    if inherited and read_holder(path).get("token") == inherited:
        yield inherited
        return
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UsageError(f"run.output_dir: cannot create or write {output_dir} "
                         f"({exc.strerror or exc}); choose a directory you can write") from exc
    try:
        previous = _acquire(fd, path)
        if previous.get("pid"):
            log(f"{Path(output_dir)}: the run that held it (host {previous.get('host')}, pid "
                f"{previous.get('pid')}) ended without releasing it; taking over")
        token = uuid.uuid4().hex
        _write(fd, {"host": socket.gethostname(), "pid": os.getpid(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": token})
        _HELD[token] = fd
        try:
            yield token
        finally:
            del _HELD[token]
            _write(fd, {})
    finally:
        os.close(fd)  # releases the flock (unless child processes share the file)


def held_fd(token: str) -> int | None:
    """The locked file descriptor of the lock ``token`` this process holds (to pass to
    child processes, which then keep the directory locked while they run)."""
    return _HELD.get(token)


def read_holder(path: Path) -> dict[str, Any]:
    """The holder record in a lock file (empty when absent, released or unreadable)."""
    try:
        data = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _acquire(fd: int, path: Path) -> dict[str, Any]:
    """Lock ``fd`` or raise :class:`OutputDirInUse`; returns the previous holder's record
    when the lock was free but the record was left behind by a run that died."""
    import fcntl

    holder = read_holder(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path, read_holder(path)) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        if _alive_here(holder):  # no flock on this file system: trust a live holder
            raise _in_use(path, holder) from None
    return holder


def _in_use(path: Path, holder: dict[str, Any]) -> OutputDirInUse:
    who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since "
           f"{holder.get('started', '?')}") if holder else "a process that is starting"
    return OutputDirInUse(
        f"{path.parent} is in use by another run ({who}). Two runs writing one output "
        "directory corrupt each other's checkpoints: wait for that run to end, or give this "
        "one another run.output_dir (--output-dir)"
    )


def _alive_here(holder: dict[str, Any]) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record).encode() if record else b""
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


__all__ = ["HOLDER_ENV", "LOCK_FILE", "OutputDirInUse", "held_fd", "output_lock",
           "read_holder"]
