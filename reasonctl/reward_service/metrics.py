"""What ``GET /metrics`` reports: counters, queue depth, latency percentiles and, per
reward, how many completions were scored for each reason.

Counts are this replica's since it started; latencies (arrival to the last reward's
scores) and scoring times are over the most recent :data:`WINDOW` values.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

WINDOW = 4096


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., ...}`` of ``values`` (nearest rank); empty without values."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for point in points:
        rank = min(len(ordered) - 1, max(0, math.ceil(point / 100 * len(ordered)) - 1))
        out[f"p{point}"] = ordered[rank]
    return out


class ServiceMetrics:
    """Thread-safe counters of one service replica."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.counts: dict[str, int] = {
            "accepted": 0, "done": 0, "failed": 0, "rejected_full": 0, "rejected_invalid": 0,
        }
        self.failures: dict[str, int] = {}
        self.latencies: deque[float] = deque(maxlen=WINDOW)
        self.rewards: dict[str, dict[str, Any]] = {}

    def _reward(self, name: str) -> dict[str, Any]:
        return self.rewards.setdefault(name, {
            "batches": 0, "completions": 0, "failures": 0, "worker_restarts": 0,
            "seconds": deque(maxlen=WINDOW), "reasons": {},
        })

    def count(self, key: str) -> None:
        """Add one to counter ``key`` (``accepted``, ``rejected_full`` ...)."""
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def request_done(self, latency_s: float) -> None:
        """A request got all its scores ``latency_s`` after it arrived."""
        with self._lock:
            self.counts["done"] += 1
            self.latencies.append(latency_s)

    def request_failed(self, kind: str, reward: str | None) -> None:
        """A request failed (``reward_error``, ``worker_crash``, ``deadline``)."""
        with self._lock:
            self.counts["failed"] += 1
            self.failures[kind] = self.failures.get(kind, 0) + 1
            if reward is not None:
                self._reward(reward)["failures"] += 1

    def batch_scored(self, reward: str, completions: int, seconds: float,
                     reasons: Sequence[str] = ()) -> None:
        """A reward call scored ``completions`` in ``seconds``, for ``reasons`` (one per
        completion: ``unparseable`` judge verdicts, ``no_answer`` ... are counted)."""
        with self._lock:
            stats = self._reward(reward)
            stats["batches"] += 1
            stats["completions"] += completions
            stats["seconds"].append(seconds)
            for reason in reasons:
                stats["reasons"][reason] = stats["reasons"].get(reason, 0) + 1

    def worker_crashed(self, reward: str) -> None:
        """A worker process of ``reward`` died and was restarted."""
        with self._lock:
            self._reward(reward)["worker_restarts"] += 1

    def snapshot(self, queue_depth: int | None) -> dict[str, Any]:
        """The metrics as JSON-ready data."""
        with self._lock:
            rewards = {}
            for name, stats in self.rewards.items():
                rewards[name] = {
                    "batches": stats["batches"], "completions": stats["completions"],
                    "mean_batch": stats["completions"] / stats["batches"] if stats["batches"]
                    else 0.0,
                    "failures": stats["failures"], "worker_restarts": stats["worker_restarts"],
                    "score_seconds": percentiles(list(stats["seconds"])),
                    "reasons": dict(stats["reasons"]),
                }
            return {
                "uptime_s": time.time() - self.started,
                "queue_depth": queue_depth,
                "requests": dict(self.counts),
                "failures": dict(self.failures),
                "latency_s": percentiles(list(self.latencies)),
                "rewards": rewards,
            }


__all__ = ["ServiceMetrics", "percentiles"]
