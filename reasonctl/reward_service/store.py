"""Where requests wait and results are kept: the :class:`RequestStore` interface and its
in-memory implementation (:mod:`~reasonctl.reward_service.redis_store` is the shared one).

A request names several rewards; it becomes one :class:`Job` per reward, queued for that
reward's workers. A worker *claims* jobs (a batch across requests), scores them and
*finishes* each; the request is ``done`` when every reward finished, or ``failed`` at the
first failure (a reward raising, a crashed worker, the deadline passing). Finished results
are kept ``result_ttl_s`` seconds, then forgotten (a pull then answers 404). The number of
unfinished requests is bounded: :meth:`RequestStore.add` refuses beyond it, and the service
answers 429, so nothing is ever dropped silently.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from reasonctl.reward_service.wire import ScoreRequest

Status = Literal["pending", "done", "failed"]


@dataclass(frozen=True)
class Job:
    """One request's completions to score with one reward."""

    request_id: str
    reward: str
    size: int


@dataclass
class Result:
    """The state of a request as a pull returns it."""

    status: Status
    weights: dict[str, float]
    created: float
    scores: dict[str, list[float | None]] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    finished: float | None = None

    def total(self) -> list[float | None]:
        """The weighted sum per completion (``None`` where every reward said ``None``)."""
        if not self.scores:
            return []
        size = len(next(iter(self.scores.values())))
        out: list[float | None] = []
        for i in range(size):
            present = [(self.weights.get(name, 1.0), values[i])
                       for name, values in self.scores.items() if values[i] is not None]
            out.append(sum(w * v for w, v in present) if present else None)  # type: ignore[operator]
        return out


class RequestStore(Protocol):
    """The queue of requests and their results, shared by the HTTP app and the workers."""

    def add(self, request_id: str, body: bytes, request: ScoreRequest, deadline: float) -> bool:
        """Queue a request (one job per reward); ``False`` when the store is full."""
        ...

    def claim(self, reward: str, max_items: int, wait_s: float) -> list[Job]:
        """Take jobs of ``reward`` up to ``max_items`` completions (at least one job), waiting
        up to ``wait_s`` for more after the first; ``[]`` after a short idle wait."""
        ...

    def request(self, request_id: str) -> ScoreRequest | None:
        """The parsed request of a claimed job (``None`` when it is gone)."""
        ...

    def renew(self, reward: str, request_ids: Sequence[str]) -> None:
        """Keep the claim on jobs being scored (shared stores hand abandoned ones back)."""
        ...

    def finish(self, request_id: str, reward: str, scores: list[float | None],
               duration: float) -> Result | None:
        """Record a reward's scores; the final :class:`Result` when this completed it."""
        ...

    def fail(self, request_id: str, reason: str) -> bool:
        """Mark a pending request failed; ``False`` when it was not pending."""
        ...

    def result(self, request_id: str) -> Result | None:
        """The request's state (``None``: unknown or expired)."""
        ...

    def pending_count(self) -> int:
        """Requests accepted and not finished."""
        ...

    def sweep(self, now: float) -> list[str]:
        """Fail requests past their deadline, forget expired results, hand back abandoned
        claims; returns the ids failed for their deadline."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


@dataclass
class _Entry:
    request: ScoreRequest
    result: Result
    deadline: float
    remaining: set[str]


class MemoryStore:
    """:class:`RequestStore` in this process's memory (lost when the service stops)."""

    def __init__(self, *, max_pending: int, result_ttl_s: float) -> None:
        self.max_pending = max_pending
        self.result_ttl_s = result_ttl_s
        self._entries: dict[str, _Entry] = {}
        self._queues: dict[str, deque[Job]] = {}
        self._pending = 0
        self._cond = threading.Condition()

    def add(self, request_id: str, body: bytes, request: ScoreRequest, deadline: float) -> bool:
        """See :meth:`RequestStore.add`."""
        with self._cond:
            if self._pending >= self.max_pending:
                return False
            result = Result("pending", dict(request.weights), time.time())
            self._entries[request_id] = _Entry(request, result, deadline, set(request.weights))
            self._pending += 1
            for reward in request.weights:
                self._queues.setdefault(reward, deque()).append(
                    Job(request_id, reward, len(request)))
            self._cond.notify_all()
        return True

    def claim(self, reward: str, max_items: int, wait_s: float, idle_s: float = 0.25
              ) -> list[Job]:
        """See :meth:`RequestStore.claim`."""
        with self._cond:
            queue = self._queues.setdefault(reward, deque())
            jobs: list[Job] = []
            size = self._take(queue, jobs, max_items)
            if not jobs:
                self._cond.wait_for(lambda: bool(queue), timeout=idle_s)
                size = self._take(queue, jobs, max_items)
            if not jobs:
                return []
            end = time.monotonic() + wait_s
            while size < max_items and (left := end - time.monotonic()) > 0:
                self._cond.wait_for(lambda: bool(queue), timeout=left)
                size += self._take(queue, jobs, max_items - size)
            return jobs

    def _take(self, queue: deque[Job], jobs: list[Job], room: int) -> int:
        """Move jobs of pending requests from ``queue`` to ``jobs`` while they fit ``room``
        (the first job always does); returns the completions taken."""
        taken = 0
        while queue:
            job = queue[0]
            entry = self._entries.get(job.request_id)
            if entry is None or entry.result.status != "pending":
                queue.popleft()
                continue
            if jobs and taken + job.size > room:
                break
            queue.popleft()
            jobs.append(job)
            taken += job.size
            if taken >= room:
                break
        return taken

    def request(self, request_id: str) -> ScoreRequest | None:
        """See :meth:`RequestStore.request`."""
        with self._cond:
            entry = self._entries.get(request_id)
            return entry.request if entry is not None else None

    def renew(self, reward: str, request_ids: Sequence[str]) -> None:
        """Nothing to do: claims in memory cannot be abandoned by another process."""

    def finish(self, request_id: str, reward: str, scores: list[float | None],
               duration: float) -> Result | None:
        """See :meth:`RequestStore.finish`."""
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is None or entry.result.status != "pending" or reward not in entry.remaining:
                return None
            entry.result.scores[reward] = list(scores)
            entry.result.durations[reward] = duration
            entry.remaining.discard(reward)
            if entry.remaining:
                return None
            self._close(entry, "done")
            return entry.result

    def fail(self, request_id: str, reason: str) -> bool:
        """See :meth:`RequestStore.fail`."""
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is None or entry.result.status != "pending":
                return False
            entry.result.error = reason
            entry.result.scores.clear()
            self._close(entry, "failed")
            return True

    def _close(self, entry: _Entry, status: Status) -> None:
        entry.result.status = status
        entry.result.finished = time.time()
        entry.request.completions = []  # the payload is not needed any more
        self._pending -= 1

    def result(self, request_id: str) -> Result | None:
        """See :meth:`RequestStore.result`."""
        with self._cond:
            entry = self._entries.get(request_id)
            if entry is None:
                return None
            r = entry.result
            return Result(r.status, dict(r.weights), r.created, dict(r.scores),
                          dict(r.durations), r.error, r.finished)

    def pending_count(self) -> int:
        """See :meth:`RequestStore.pending_count`."""
        with self._cond:
            return self._pending

    def sweep(self, now: float) -> list[str]:
        """See :meth:`RequestStore.sweep`."""
        expired: list[str] = []
        with self._cond:
            for request_id, entry in list(self._entries.items()):
                r = entry.result
                if r.status == "pending" and now > entry.deadline:
                    r.error = (f"deadline exceeded: not scored within "
                               f"{entry.deadline - r.created:.0f} s of arrival")
                    self._close(entry, "failed")
                    expired.append(request_id)
                elif r.finished is not None and now - r.finished > self.result_ttl_s:
                    del self._entries[request_id]
        return expired

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["Job", "MemoryStore", "RequestStore", "Result"]
