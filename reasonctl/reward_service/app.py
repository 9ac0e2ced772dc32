"""The HTTP routes of the reward service (a Starlette application).

========================================  ==================================================
``GET /health``                           liveness and the rewards served; no token needed
``POST /api/reward/enqueue``              a request (:mod:`~reasonctl.reward_service.wire`)
                                          -> ``{"uuid": id}``; 400 malformed, 401 no token,
                                          413 too large, 429 queue full (``Retry-After``),
                                          503 queue unreachable
``GET /api/reward/result/<id>``           the request's state: 202 ``pending``; 200
                                          ``done`` (``scores`` per reward, ``total``,
                                          ``durations``) or ``failed`` (``error``); 404
                                          unknown or expired. ``?type=<reward>`` keeps one
``POST /api/reward/pull``                 the same, for ``{"uuid": id, "type": ...}`` bodies
                                          (JSON or form) as cosmos-rl clients send them
``GET /metrics``                          :class:`~.metrics.ServiceMetrics` as JSON
``POST /api/tools/run``                   one tool call for a remote episode
                                          (:mod:`~reasonctl.reward_service.tools`): 200
                                          ``result`` or ``error``; 400 malformed, 404 not
                                          served, 413 too large
========================================  ==================================================
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reasonctl.core.errors import did_you_mean
from reasonctl.reward_service.auth import BearerAuth, Tokens
from reasonctl.reward_service.config import ServiceConfig
from reasonctl.reward_service.metrics import ServiceMetrics
from reasonctl.reward_service.store import RequestStore, Result
from reasonctl.reward_service.tools import ServedTools
from reasonctl.reward_service.wire import ScoreRequest, WireError, parse_request

logger = logging.getLogger("reasonctl.reward_service")


@dataclass
class ServiceState:
    """What the routes share: the config, the queue, the metrics and the rewards served
    (name -> media type)."""

    config: ServiceConfig
    store: RequestStore
    metrics: ServiceMetrics
    media_types: dict[str, str]
    tools: ServedTools | None = None


def create_app(state: ServiceState, tokens: Tokens, *, on_start: Callable[[], None],
               on_stop: Callable[[], None]) -> Any:
    """The ASGI application: routes behind bearer auth; ``on_start``/``on_stop`` run the
    worker pool with the server."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        on_start()
        try:
            yield
        finally:
            await run_in_threadpool(on_stop)

    routes = _Routes(state)
    app = Starlette(routes=[
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/api/reward/enqueue", routes.enqueue, methods=["POST"]),
        Route("/api/reward/result/{request_id}", routes.result, methods=["GET"]),
        Route("/api/reward/pull", routes.pull, methods=["POST"]),
        Route("/api/tools/run", routes.run_tool, methods=["POST"]),
    ], lifespan=lifespan)
    return BearerAuth(app, tokens)


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


class _Routes:
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    async def health(self, request: Request) -> JSONResponse:
        tools = self.state.tools.names if self.state.tools is not None else []
        return JSONResponse({"status": "ok", "rewards": self.state.media_types,
                             "queue": self.state.config.queue.backend, "tools": tools})

    async def run_tool(self, request: Request) -> JSONResponse:
        tools = self.state.tools
        if tools is None:
            return _error(404, "this service runs no tools ([tools] serve in its config)")
        limits = self.state.config.limits
        body = await _read_limited(request, limits.max_body_bytes)
        if body is None:
            return _error(413, f"request body larger than the limit of {limits.max_body_mb:g} "
                               "MiB (limits.max_body_mb)")
        status, answer = await run_in_threadpool(tools.run, body)
        return JSONResponse(answer, status_code=status)

    async def metrics(self, request: Request) -> JSONResponse:
        try:
            depth: int | None = await run_in_threadpool(self.state.store.pending_count)
        except Exception:
            depth = None
        return JSONResponse(self.state.metrics.snapshot(depth))

    async def enqueue(self, request: Request) -> JSONResponse:
        limits = self.state.config.limits
        body = await _read_limited(request, limits.max_body_bytes)
        if body is None:
            self.state.metrics.count("rejected_invalid")
            return _error(413, f"request body larger than the limit of {limits.max_body_mb:g} "
                               "MiB (limits.max_body_mb); send fewer completions per request")
        try:
            parsed = await run_in_threadpool(parse_request, body)
            self._check_served(parsed)
        except WireError as exc:
            self.state.metrics.count("rejected_invalid")
            logger.info("request rejected", extra={"event": "rejected", "status": 400,
                                                   "reason": str(exc)})
            return _error(400, str(exc))
        deadline = time.time() + min(parsed.deadline_s or limits.deadline_s, limits.deadline_s)
        request_id = uuid.uuid4().hex
        try:
            added = await run_in_threadpool(self.state.store.add, request_id, body, parsed,
                                            deadline)
        except Exception as exc:
            logger.error("queue unreachable: %s: %s", type(exc).__name__, exc,
                         extra={"event": "queue_error"})
            return _error(503, "the queue is unreachable; retry later",
                          **{"Retry-After": str(limits.retry_after_s)})
        if not added:
            self.state.metrics.count("rejected_full")
            return _error(429, f"the queue is full ({limits.max_pending} requests pending); "
                               "retry after the delay in Retry-After",
                          **{"Retry-After": str(limits.retry_after_s)})
        self.state.metrics.count("accepted")
        logger.info("request accepted", extra={
            "event": "accepted", "request_id": request_id, "rewards": list(parsed.weights),
            "media_type": parsed.media_type, "completions": len(parsed), "bytes": len(body)})
        return JSONResponse({"uuid": request_id})

    def _check_served(self, parsed: ScoreRequest) -> None:
        served = self.state.media_types
        for name in parsed.weights:
            if name not in served:
                close = did_you_mean(name, served)
                hint = f"; did you mean {close!r}?" if close else ""
                raise WireError(f"reward {name!r} is not served here{hint} (served: "
                                f"{', '.join(sorted(served))})")
            if served[name] != parsed.media_type:
                raise WireError(f"reward {name!r} scores {served[name]} completions; this "
                                f"request carries {parsed.media_type}")

    async def result(self, request: Request) -> JSONResponse:
        return await self._result(request.path_params["request_id"],
                                  request.query_params.get("type"))

    async def pull(self, request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            if request.headers.get("content-type", "").startswith(
                    "application/x-www-form-urlencoded"):
                fields = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
            else:
                fields = json.loads(raw or b"{}")
        except (UnicodeDecodeError, json.JSONDecodeError):
            return _error(400, 'send {"uuid": "<id>"} as JSON or a form')
        request_id = fields.get("uuid") if isinstance(fields, dict) else None
        if not isinstance(request_id, str):
            return _error(400, 'send {"uuid": "<id>"} as JSON or a form')
        kind = fields.get("type")
        return await self._result(request_id, kind if isinstance(kind, str) else None)

    async def _result(self, request_id: str, kind: str | None) -> JSONResponse:
        try:
            result: Result | None = await run_in_threadpool(self.state.store.result,
                                                            request_id)
        except Exception:
            return _error(503, "the queue is unreachable; retry later",
                          **{"Retry-After": str(self.state.config.limits.retry_after_s)})
        if result is None:
            return JSONResponse({"uuid": request_id, "status": "unknown",
                                 "error": "unknown or expired request id"}, status_code=404)
        body: dict[str, Any] = {"uuid": request_id, "status": result.status}
        if kind is not None and kind not in result.weights:
            return _error(400, f"this request was not scored with {kind!r} "
                               f"(it names {', '.join(result.weights)})")
        if result.status == "pending":
            return JSONResponse(body, status_code=202)
        if result.status == "failed":
            body["error"] = result.error
            return JSONResponse(body)
        scores = result.scores if kind is None else {kind: result.scores[kind]}
        body.update(scores=scores, total=result.total(), durations=result.durations,
                    latency_s=(result.finished or 0.0) - result.created)
        if kind is not None:
            body["type"] = kind
        return JSONResponse(body)


async def _read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or ``None`` as soon as it is known to exceed ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


__all__ = ["ServiceState", "create_app"]
