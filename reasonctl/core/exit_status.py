"""A child process's exit, as a shell reports it and in words."""

from __future__ import annotations

import signal

SIGNAL_REASONS = {
    "SIGKILL": "out of memory, or killed from outside",
    "SIGSEGV": "a crash in native code",
    "SIGABRT": "aborted",
    "SIGBUS": "a bus error, often a /dev/shm too small",
}


def exit_status(code: int) -> int:
    """``Popen.returncode`` as a shell reports it: 128 + N for a process killed by signal N."""
    return 128 - code if code < 0 else code


def describe_exit(code: int) -> str:
    """What ended a process with ``Popen.returncode`` ``code``: ``exited with status 1``,
    ``was killed by SIGKILL (out of memory, or killed from outside)``."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    reason = SIGNAL_REASONS.get(name)
    return f"was killed by {name}" + (f" ({reason})" if reason else "")
