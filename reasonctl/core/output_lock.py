"""One writer per output directory: ``<output_dir>/.reasonctl.lock``.

The lock is an advisory ``flock`` on that file, held for the whole run by its main
process (or by the launcher of a multi-process run and its workers, which find its token
in :data:`HOLDER_ENV`). The file records the holder's host, process id and start time, so
a second run is refused with a message saying who writes there. The operating system
releases the lock when its holder dies, however it dies: a run started after a crash takes
the lock over (and says so); nothing needs cleaning up by hand. On file systems without
``flock`` support the holder's record is used instead: a live process on this host keeps
the directory, anything else is taken over.

A launcher takes the lock exclusively, writes its record, then keeps it *shared*
(``output_lock(..., shared=True)``); each worker it starts joins with a shared lock of its
own (:func:`output_lock` with the token inherited). Another run asks for the lock
exclusively and is refused while any of them holds it: the directory stays locked until
the last worker has exited, across restarts of the workers and even when the launcher
itself was killed and its workers are still writing a final checkpoint. The launchers of
the other nodes of a multi-node run set :data:`HOLDER_ENV` to :data:`HELD_BY_NODE_0`: the
launcher of node rank 0 holds the lock for the whole run.
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
HELD_BY_NODE_0 = "node-0"
""":data:`HOLDER_ENV` of the workers of a node other than node 0 of a multi-node run."""


class OutputDirInUse(UsageError):
    """Another run holds the output directory."""


@contextmanager
def output_lock(output_dir: Path, *, log: Callable[[str], None],
                shared: bool = False) -> Iterator[str]:
    """Hold the lock of ``output_dir`` (created if needed) while the block runs.

    Yields the lock's token (pass it to child processes as :data:`HOLDER_ENV`). With
    ``shared``, the lock is kept shared once taken, so that those processes can join it.
    Inside a process whose environment carries the current holder's token, the lock is
    joined (shared) rather than taken; with :data:`HELD_BY_NODE_0` it is left to node 0.
    Raises :class:`OutputDirInUse` when another live run holds it.
    """
    path = Path(output_dir) / LOCK_FILE
    inherited = os.environ.get(HOLDER_ENV)
    if inherited == HELD_BY_NODE_0:
        yield inherited
        return
    if inherited and read_holder(path).get("token") == inherited:
        with _joined(path):
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
        if shared:
            _share(fd, path)
        try:
            yield token
        finally:
            _write(fd, {})
    finally:
        os.close(fd)  # releases this process's flock


def joins_a_launcher_lock() -> bool:
    """Whether this process was started by a launcher that holds the output lock for it
    (every such process joins the lock, not only rank 0)."""
    return bool(os.environ.get(HOLDER_ENV))


@contextmanager
def _joined(path: Path) -> Iterator[None]:
    """A shared lock on ``path`` next to the launcher's, held while the block runs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _share(fd, path)
        yield
    finally:
        os.close(fd)


def _share(fd: int, path: Path) -> None:
    """Take a shared lock on ``fd``, or turn its exclusive lock into a shared one. ``flock``
    may release the lock for a moment while converting it: another run taking it then is
    reported as the holder, exactly as if it had come first."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path, read_holder(path)) from None
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            raise


def read_holder(path: Path) -> dict[str, Any]:
    """The holder record in a lock file (empty when absent, released or unreadable)."""
    try:
        data = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""``flock`` errors of file systems that do not support it."""


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
        if exc.errno not in _NO_FLOCK:
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


__all__ = ["HELD_BY_NODE_0", "HOLDER_ENV", "LOCK_FILE", "OutputDirInUse", "joins_a_launcher_lock",
           "output_lock", "read_holder"]
