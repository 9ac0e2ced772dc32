"""Stop signals, from the start of a run until it returns.

During training a SIGTERM, SIGUSR1 or first Ctrl-C (SIGINT) asks the loop to stop: the
step finishes, a checkpoint is written (``run.on_signal = "checkpoint"``) and the run ends
as ``interrupted``; a second Ctrl-C raises ``KeyboardInterrupt``. After the loop the run
may still be busy (waiting for a checkpoint write, the final export, the wait for
uploads): each of those is a :meth:`StopRequest.phase`. There a signal is acknowledged
and the work goes on; one more signal abandons it with :class:`SignalAbandon`, whose
message says what is given up and what is kept. A copy of the same signal arriving within
:data:`DUPLICATE_WINDOW_S` does not count as one more.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
DUPLICATE_WINDOW_S = 0.5
"""After training, a signal this soon after the previous one is the same request arriving
twice (a scheduler signalling every process while the launcher forwards it too)."""


class SignalAbandon(BaseException):
    """A second signal gave up the current phase (a ``BaseException``, so generic handlers
    of the code running in that phase do not swallow it)."""

    def __init__(self, phase: str, signal_name: str, abandons: str) -> None:
        self.phase = phase
        self.signal_name = signal_name
        self.abandons = abandons
        super().__init__(f"{signal_name} received again during the {phase}: abandoned "
                         f"{abandons}")


class StopRequest:
    """Records stop signals; the loop checks :attr:`requested` between steps."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.signal_name: str | None = None
        self.count = 0
        self._interrupts = 0
        self._phase: tuple[str, str] | None = None
        self._previous = 0.0
        self._log = log or _stderr

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._phase is not None and self.count and now - self._previous < DUPLICATE_WINDOW_S:
            return
        self._previous = now
        self.count += 1
        if self._phase is not None:
            phase, abandons = self._phase
            if self.count > 1:
                raise SignalAbandon(phase, name, abandons)
            self.signal_name = name
            self._log(f"{name} received during the {phase}; finishing it (send the signal "
                      f"again to abandon {abandons})")
            return
        if name == "SIGINT":
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        self.signal_name = name

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return self.signal_name is not None

    @contextmanager
    def phase(self, name: str, abandons: str) -> Iterator[None]:
        """Work after training: one signal is acknowledged, the next raises
        :class:`SignalAbandon` saying it gave up ``abandons``."""
        previous, self._phase = self._phase, (name, abandons)
        try:
            yield
        finally:
            self._phase = previous


@contextmanager
def stop_signals(handler: StopRequest) -> Iterator[None]:
    """Install ``handler`` for the stop signals (main thread only), restoring afterwards."""
    previous: dict[int, Any] = {}
    try:
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not in the main thread: leave signals alone
                break
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = ["STOP_SIGNALS", "SignalAbandon", "StopRequest", "stop_signals"]
