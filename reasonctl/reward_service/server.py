"""Putting the service together: tokens, queue, workers and routes, served by uvicorn.

:class:`RewardService` builds every reward (in this process or in its worker processes)
and the tools of ``[tools]`` (their sandbox tried) before the server listens, so a reward
or a sandbox that cannot be built stops the start with its error;
:meth:`RewardService.run` serves until SIGINT/SIGTERM, then stops the workers.
"""

from __future__ import annotations

import logging
from typing import Any

from reasonctl.core.errors import ReasonctlError, require
from reasonctl.reward_service.app import ServiceState, create_app
from reasonctl.reward_service.auth import Tokens, load_tokens
from reasonctl.reward_service.config import ServiceConfig
from reasonctl.reward_service.metrics import ServiceMetrics
from reasonctl.reward_service.store import MemoryStore, RequestStore
from reasonctl.reward_service.tools import ServedTools
from reasonctl.reward_service.workers import ProcessScorer, Sweeper, ThreadScorer, Worker

logger = logging.getLogger("reasonctl.reward_service")

SWEEP_EVERY_S = 0.5


def build_store(config: ServiceConfig) -> RequestStore:
    """The queue ``[queue]`` asks for."""
    limits, queue = config.limits, config.queue
    if queue.backend == "memory":
        return MemoryStore(max_pending=limits.max_pending, result_ttl_s=limits.result_ttl_s)
    from reasonctl.reward_service.redis_store import RedisStore

    assert queue.redis_url is not None
    store = RedisStore(queue.redis_url, prefix=queue.prefix,
                       rewards=[r.name for r in config.rewards.components],
                       max_pending=limits.max_pending, result_ttl_s=limits.result_ttl_s,
                       lease_s=queue.lease_s)
    try:
        store.ping()
    except Exception as exc:
        raise ReasonctlError(f"queue.redis_url: cannot reach Redis ({type(exc).__name__}: "
                             f"{exc}); start redis-server or fix the URL") from None
    return store


class RewardService:
    """The reward service of one config: built on construction, served by :meth:`run`."""

    def __init__(self, config: ServiceConfig, registry: Any, *,
                 tokens: Tokens | None = None) -> None:
        self.config = config
        self.tokens = tokens if tokens is not None else load_tokens(config.auth)
        self.metrics = ServiceMetrics()
        self.store = build_store(config)
        self.scorers: list[Any] = []
        self.workers: list[Worker] = []
        media_types: dict[str, str] = {}
        lease = config.queue.lease_s if config.queue.backend == "redis" else None
        try:
            for entry in config.rewards.components:
                for index in range(entry.worker_count):
                    label = f"{entry.name}#{index}"
                    if config.workers.kind == "process":
                        device = entry.devices[index % len(entry.devices)] if entry.devices \
                            else None
                        scorer: Any = ProcessScorer(entry.name, entry.options, device, label)
                    else:
                        scorer = ThreadScorer(entry.name, entry.options, registry)
                    self.scorers.append(scorer)
                    media_types[entry.name] = scorer.media_type
                    self.workers.append(Worker(
                        entry.name, scorer, self.store, self.metrics,
                        max_batch=config.batch_size(entry), wait_s=config.batch_wait_s(entry),
                        lease_s=lease, label=label))
        except BaseException:
            self._close_scorers()
            raise
        self.sweeper = Sweeper(self.store, self.metrics, SWEEP_EVERY_S)
        tools = None
        if config.tools.serve:
            try:
                tools = ServedTools(config.tools.serve, config.tools.sandbox,
                                    config.tools.concurrency)
            except BaseException:
                self._close_scorers()
                raise
        self.state = ServiceState(config, self.store, self.metrics, media_types, tools)

    def app(self) -> Any:
        """The ASGI application (starts and stops the workers with the server)."""
        return create_app(self.state, self.tokens, on_start=self.start, on_stop=self.stop)

    def start(self) -> None:
        """Start the workers and the sweeper."""
        for worker in self.workers:
            worker.start()
        self.sweeper.start()
        logger.info("reward service started", extra={
            "event": "started", "rewards": self.state.media_types,
            "workers": len(self.workers), "queue": self.config.queue.backend})

    def stop(self) -> None:
        """Stop claiming work, let running batches finish, release everything."""
        for worker in self.workers:
            worker.stopping.set()
        self.sweeper.stopping.set()
        for worker in self.workers:
            if worker.is_alive():
                worker.join()
        self._close_scorers()
        self.store.close()
        logger.info("reward service stopped", extra={"event": "stopped"})

    def _close_scorers(self) -> None:
        for scorer in self.scorers:
            scorer.close()

    def run(self, *, host: str | None = None, port: int | None = None) -> None:
        """Serve on ``host:port`` (default: ``[server]``) until interrupted."""
        uvicorn = require("uvicorn", "serve", "reasonctl serve-rewards")
        server = uvicorn.Server(uvicorn.Config(
            self.app(), host=host or self.config.server.host,
            port=self.config.server.port if port is None else port,
            log_config=None, access_log=False, lifespan="on",
            timeout_graceful_shutdown=30,
        ))
        server.run()


__all__ = ["RewardService", "build_store"]
