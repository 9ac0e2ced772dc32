"""The worker pool: per served reward, workers that claim batches across requests, score
them and record the results.

Each worker is a thread of the service that owns one *scorer*: the reward built in this
process (``[workers] kind = "thread"``) or in a child process of its own (``"process"``),
which is what pins a GPU reward model to a device (the child sees only that device, as
``cuda:0``). A child that dies while scoring (a crash, the OOM killer) fails the requests
of its batch with the reason and is started again; a reward that raises fails only the
requests that make it raise (a failing batch is retried one request at a time).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from reasonctl.core.errors import RewardError
from reasonctl.core.protocols import reward_media_type
from reasonctl.core.reward_set import RewardSet, RewardTerm
from reasonctl.reward_service.metrics import ServiceMetrics
from reasonctl.reward_service.store import Job, RequestStore

logger = logging.getLogger("reasonctl.reward_service")

READY_TIMEOUT_S = 600.0
RUN_ADVICE = "\n  Fix the reward, or set rewards.on_error"
POLL_S = 0.05


class WorkerCrashed(RuntimeError):
    """A worker process died while scoring."""


class RewardFailure(RuntimeError):
    """A reward raised in a worker process; the message is the reason a pull reports."""


def failure_reason(name: str, exc: BaseException) -> str:
    """Why a request failed, as its result says it."""
    if isinstance(exc, (RewardError, RewardFailure)):
        return str(exc)
    return f"reward {name!r} failed: {type(exc).__name__}: {exc}"


Scored = tuple[list[float | None], list[str]]
"""A batch's scores and the reason of each (``scored`` for rewards that give none)."""


def build_scoring(name: str, options: dict[str, Any], registry: Any
                  ) -> tuple[Callable[[list[Any], list[Any]], Scored], str]:
    """The scoring function of reward ``name`` (built with ``options``) and its media type.

    Scores go through a one-reward :class:`RewardSet`, so a wrong count or a non-finite
    score is an error naming the reward and the sample, as in a run; they come with their
    reasons (an unparseable judge verdict, a hedged answer), which ``/metrics`` counts.
    """
    from reasonctl.core.callables import as_reward, is_callable_path, load_callable

    if is_callable_path(name):
        reward = as_reward(load_callable(name), name=name)
    else:
        reward = registry.get("reward", name).build(options or None)
    rewards = RewardSet([RewardTerm(name, reward)], on_error="raise")

    def score(completions: list[Any], samples: list[Any]) -> Scored:
        try:
            scores = rewards.score(completions, samples, explain=True)
        except RewardError as exc:  # without the advice about a run's rewards.on_error
            raise RewardError(str(exc).split(RUN_ADVICE)[0], reward=name) from exc
        return scores.components[name], [e.reason for e in scores.explanations[name]]

    return score, reward_media_type(reward)


class ThreadScorer:
    """The reward built in this process, called by the worker thread itself."""

    def __init__(self, name: str, options: dict[str, Any], registry: Any) -> None:
        self._score, self.media_type = build_scoring(name, options, registry)

    def score(self, completions: list[Any], samples: list[Any]) -> Scored:
        """Score a batch (exceptions are the reward's)."""
        return self._score(completions, samples)

    def close(self) -> None:
        """Nothing to release."""


class ProcessScorer:
    """The reward built in a child process pinned to ``device``; restarted after a crash."""

    def __init__(self, name: str, options: dict[str, Any], device: str | None, label: str) -> None:
        self.name, self.options, self.device, self.label = name, options, device, label
        self.restarts = 0
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None
        self.media_type = self._start()

    def _start(self) -> str:
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_child_main, args=(child, self.name, self.options, self.device),
            name=f"reward-{self.label}", daemon=True,
        )
        process.start()
        child.close()
        self._process, self._conn = process, parent
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not parent.poll(POLL_S):
            if not process.is_alive():
                raise RuntimeError(f"worker {self.label} exited with code {process.exitcode} "
                                   "while building its reward")
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"worker {self.label} did not build its reward within "
                                   f"{READY_TIMEOUT_S:.0f} s")
        status, value = parent.recv()
        if status != "ready":
            process.join(5)
            raise RuntimeError(f"worker {self.label} could not build its reward:\n{value}")
        return str(value)

    def score(self, completions: list[Any], samples: list[Any]) -> Scored:
        """Send a batch to the child and wait; :class:`WorkerCrashed` if it dies (it is
        started again before this raises)."""
        assert self._conn is not None
        try:
            self._conn.send((completions, samples))
            while not self._conn.poll(POLL_S):
                if not self._process.is_alive():
                    raise EOFError
            status, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self._process.join(5)
            code = self._process.exitcode
            self._restart()
            raise WorkerCrashed(f"worker {self.label} crashed while scoring (exit code "
                                f"{code}); it was restarted") from None
        if status != "ok":
            raise RewardFailure(value)
        scores, reasons = value
        return scores, reasons

    def _restart(self) -> None:
        self.restarts += 1
        if self._conn is not None:
            self._conn.close()
        logger.warning("restarting worker", extra={"event": "worker_restart",
                                                   "worker": self.label})
        self._start()

    def close(self) -> None:
        """Stop the child."""
        if self._conn is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._conn.close()
        if self._process is not None:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()


def _child_main(conn: Connection, name: str, options: dict[str, Any], device: str | None) -> None:
    """A worker process: pin the device, build the reward, score batches until told to stop."""
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = "" if device == "cpu" else device.split(":")[1]
    try:
        from reasonctl.core.plugins import PluginHost

        score, media_type = build_scoring(name, options, PluginHost.load().registry)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", media_type))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        try:
            conn.send(("ok", score(*message)))
        except Exception as exc:
            conn.send(("error", failure_reason(name, exc)))


class Worker(threading.Thread):
    """Claims batches of one reward from the store and scores them with its scorer."""

    def __init__(self, reward: str, scorer: Any, store: RequestStore, metrics: ServiceMetrics,
                 *, max_batch: int, wait_s: float, lease_s: float | None, label: str) -> None:
        super().__init__(name=f"reward-worker-{label}", daemon=True)
        self.reward, self.scorer, self.store, self.metrics = reward, scorer, store, metrics
        self.max_batch, self.wait_s, self.lease_s = max_batch, wait_s, lease_s
        self.stopping = threading.Event()

    def run(self) -> None:
        """Claim and score until :attr:`stopping` is set."""
        pause = 0.1
        while not self.stopping.is_set():
            try:
                jobs = self.store.claim(self.reward, self.max_batch, self.wait_s)
                if jobs:
                    self.score(jobs)
                pause = 0.1
            except Exception as exc:  # the store is unreachable: wait and try again
                logger.error("worker cannot reach the queue: %s: %s", type(exc).__name__, exc,
                             extra={"event": "queue_error", "reward": self.reward})
                self.stopping.wait(pause)
                pause = min(pause * 2, 5.0)

    def score(self, jobs: Sequence[Job]) -> None:
        """Score the claimed jobs as one call; isolate the failing request if it raises."""
        batch = []
        for job in jobs:
            request = self.store.request(job.request_id)
            if request is not None and len(request.completions) == job.size:
                batch.append((job, request))
        if not batch:
            return
        completions = [c for _, request in batch for c in request.completions]
        samples = [s for _, request in batch for s in request.samples]
        started = time.perf_counter()
        try:
            with self._renewing([job.request_id for job, _ in batch]):
                scores, reasons = self.scorer.score(completions, samples)
        except WorkerCrashed as exc:
            self.metrics.worker_crashed(self.reward)
            for job, _ in batch:
                self._fail(job, str(exc), "worker_crash")
            return
        except Exception as exc:
            if len(batch) > 1:
                for job, _ in batch:
                    self.score([job])
                return
            self._fail(batch[0][0], failure_reason(self.reward, exc), "reward_error")
            return
        duration = time.perf_counter() - started
        self.metrics.batch_scored(self.reward, len(completions), duration, reasons)
        offset = 0
        for job, _ in batch:
            result = self.store.finish(job.request_id, self.reward,
                                       scores[offset:offset + job.size], duration)
            offset += job.size
            if result is not None:
                latency = (result.finished or time.time()) - result.created
                self.metrics.request_done(latency)
                logger.info("request done", extra={"event": "done",
                                                   "request_id": job.request_id,
                                                   "latency_s": round(latency, 4)})

    def _fail(self, job: Job, reason: str, kind: str) -> None:
        if self.store.fail(job.request_id, reason):
            self.metrics.request_failed(kind, self.reward)
            logger.warning("request failed", extra={"event": "failed",
                                                    "request_id": job.request_id,
                                                    "reward": self.reward, "reason": reason})

    def _renewing(self, request_ids: list[str]) -> Any:
        return _LeaseRenewal(self.store, self.reward, request_ids, self.lease_s)


class _LeaseRenewal:
    """While scoring, renew the claim on the batch every third of the lease."""

    def __init__(self, store: RequestStore, reward: str, ids: list[str],
                 lease_s: float | None) -> None:
        self.store, self.reward, self.ids, self.lease_s = store, reward, ids, lease_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _LeaseRenewal:
        if self.lease_s is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        assert self.lease_s is not None
        while not self._done.wait(self.lease_s / 3):
            try:
                self.store.renew(self.reward, self.ids)
            except Exception as exc:
                logger.error("cannot renew a claim: %s", exc, extra={"event": "queue_error"})

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


class Sweeper(threading.Thread):
    """Fails requests past their deadline, forgets expired results, hands back abandoned
    claims, every ``every_s`` seconds."""

    def __init__(self, store: RequestStore, metrics: ServiceMetrics, every_s: float) -> None:
        super().__init__(name="reward-sweeper", daemon=True)
        self.store, self.metrics, self.every_s = store, metrics, every_s
        self.stopping = threading.Event()

    def run(self) -> None:
        """Sweep until :attr:`stopping` is set."""
        while not self.stopping.wait(self.every_s):
            try:
                for request_id in self.store.sweep(time.time()):
                    self.metrics.request_failed("deadline", None)
                    logger.warning("request failed", extra={
                        "event": "failed", "request_id": request_id, "reason": "deadline"})
            except Exception as exc:
                logger.error("sweep failed: %s: %s", type(exc).__name__, exc,
                             extra={"event": "queue_error"})


__all__ = ["ProcessScorer", "Sweeper", "ThreadScorer", "Worker", "WorkerCrashed",
           "build_scoring"]
