"""Symbolic comparison of math answers with a hard time limit per comparison.

``math-verify`` (parse + verify on SymPy) decides whether two answers are the same
mathematical object: ``\\sqrt{8}`` and ``2\\sqrt2``, ``\\frac{\\pi}{2}`` and ``\\pi/2``,
``\\{1,2\\}`` and ``\\{2,1\\}``, ``\\pm 2`` and ``2, -2``, intervals, matrices, equations.
SymPy can spend unbounded time (and memory) on some inputs (``9^{9^{9^9}}``), and the
library's own timeouts use ``signal.alarm``, which works only on the main thread and cannot
interrupt one long C-level operation. :class:`SymbolicJudge` therefore runs the comparisons
in a child process (:mod:`reasonctl.rewards.math_worker`) and kills it when one takes longer
than its time limit: the comparison then counts as *not equal*, a warning is logged, and the
next comparison starts a fresh child. This works from any thread (rewards may be scored off
the main thread) and bounds every comparison, whatever the expression.

One judge per process is shared by every ``math`` reward and by evaluation
(:func:`shared_judge`); it serialises requests with a lock and remembers recent answers.
A comparison that ran out of time is not retried for :data:`TIMEOUT_MEMORY_S` seconds (a
group of identical pathological answers costs one time limit, not one each), and the
replacement child starts as soon as the old one is killed, so its start-up overlaps the
comparisons that need no SymPy.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("math_worker.py")
STARTUP_TIMEOUT_S = 120.0
"""How long the child may take to start (importing SymPy on a busy machine)."""
CACHE_SIZE = 4096
TIMEOUT_MEMORY_S = 300.0
"""How long a comparison that ran out of time counts as not equal without being retried."""
MAX_EXPRESSION_CHARS = 1000
"""Longer answers are not parsed symbolically (they are compared as text only)."""


class SymbolicJudge:
    """Runs ``math-verify`` comparisons in a child process with a time limit each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._owner = 0
        self._buffer = b""
        self._cache: OrderedDict[tuple[str, ...], Any] = OrderedDict()
        self._timed_out: dict[tuple[str, ...], float] = {}
        self._ready = False
        self.timeouts = 0
        """How many comparisons ran out of time (and were counted as not equal)."""

    def equivalent(self, gold: str, pred: str, *, timeout_s: float) -> bool:
        """Whether ``pred`` is mathematically the same answer as ``gold``.

        ``False`` when either does not parse, when they differ, or when the comparison
        takes longer than ``timeout_s`` seconds.
        """
        return self.equivalence(gold, pred, timeout_s=timeout_s) is True

    def equivalence(self, gold: str, pred: str, *, timeout_s: float) -> bool | None:
        """:meth:`equivalent`, telling apart a comparison that could not finish: ``None``
        when it ran out of time (or the comparison process died)."""
        if max(len(gold), len(pred)) > MAX_EXPRESSION_CHARS:
            return False
        result = self._ask(("verify", gold, pred), timeout_s)
        return None if result is None else result is True

    def numeric_value(self, expr: str, *, timeout_s: float) -> Fraction | None:
        """The real value of a constant expression (``\\pi/2``, ``\\sqrt{2}``) to 40
        significant digits, or ``None`` when it has none (or the time ran out)."""
        if len(expr) > MAX_EXPRESSION_CHARS:
            return None
        result = self._ask(("value", expr), timeout_s)
        if not isinstance(result, str):
            return None
        try:
            return Fraction(Decimal(result))
        except (InvalidOperation, ValueError):
            return None

    def close(self) -> None:
        """Stop the child process (a later comparison starts a new one)."""
        with self._lock:
            self._stop()

    # --- internals -------------------------------------------------------------------------

    def _ask(self, key: tuple[str, ...], timeout_s: float) -> Any:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            now = time.monotonic()
            if now - self._timed_out.get(key, -TIMEOUT_MEMORY_S) < TIMEOUT_MEMORY_S:
                self.timeouts += 1
                return None
            if key[0] == "verify":
                request = {"op": "verify", "gold": key[1], "pred": key[2]}
            else:
                request = {"op": "value", "expr": key[1]}
            try:
                result = self._request(request, timeout_s)
            except TimeoutError:  # remembered a while only: a busy machine may be to blame
                self.timeouts += 1
                self._timed_out = {k: t for k, t in self._timed_out.items()
                                   if now - t < TIMEOUT_MEMORY_S}
                self._timed_out[key] = time.monotonic()
                self._spawn()  # the replacement starts now, while the caller goes on
                logger.warning(
                    "math: comparing %r with %r took longer than %.1f s; scored as not equal "
                    "(the comparison process was restarted)", key[-1][:80], key[1][:80],
                    timeout_s,
                )
                return None
            self._cache[key] = result
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return result

    def _request(self, request: dict[str, Any], timeout_s: float) -> Any:
        process = self._ensure_started()
        assert process.stdin is not None
        try:
            process.stdin.write((json.dumps(request) + "\n").encode())
            process.stdin.flush()
            line = self._read_line(timeout_s)
        except (BrokenPipeError, EOFError):
            self._stop()  # the child died (e.g. out of memory): not equal, start afresh
            return None
        return json.loads(line).get("result")

    def _spawn(self) -> None:
        """Start a child process; :meth:`_ensure_started` waits for it to be ready."""
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-u", str(WORKER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        self._owner, self._buffer, self._ready = os.getpid(), b"", False

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        alive = self._process is not None and self._owner == os.getpid() \
            and self._process.poll() is None
        if alive and self._ready:
            assert self._process is not None
            return self._process
        if not alive:  # none yet, a child of another process (after fork) or one that died
            self._process = None
            self._spawn()
        process = self._process
        assert process is not None
        try:
            ready = json.loads(self._read_line(STARTUP_TIMEOUT_S))
        except (TimeoutError, EOFError, ValueError) as exc:
            self._stop()
            raise RuntimeError(
                "the math comparison process did not start; check that math-verify is "
                f"installed for {sys.executable} (pip install 'math-verify>=0.8')"
            ) from exc
        if not ready.get("ready"):
            self._stop()
            raise RuntimeError(f"the math comparison process answered {ready!r} on start")
        self._ready = True
        return process

    def _read_line(self, timeout_s: float) -> bytes:
        process = self._process
        assert process is not None and process.stdout is not None
        fd = process.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._stop()
                raise TimeoutError
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("the math comparison process exited")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _stop(self) -> None:
        process, self._process = self._process, None
        self._buffer, self._ready = b"", False
        if process is None or self._owner != os.getpid():
            return
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


_SHARED: SymbolicJudge | None = None
_SHARED_LOCK = threading.Lock()


def shared_judge() -> SymbolicJudge:
    """The process-wide :class:`SymbolicJudge` (started on first use, stopped at exit)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = SymbolicJudge()
            atexit.register(_SHARED.close)
        return _SHARED
