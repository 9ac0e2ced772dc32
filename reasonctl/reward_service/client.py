"""The HTTP client of the reward service (httpx): enqueue with retries, pull until done.

Retries with exponential backoff (honouring ``Retry-After``) on 429, 5xx and connection
errors, until the caller's deadline; any other 4xx is the request's own fault and raises
at once with the service's message. The token is sent as a bearer header and appears in
no message or ``repr``.
"""

from __future__ import annotations

import random
import time
from typing import Any

from reasonctl.core.errors import ReasonctlError, require

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0
POLL_START_S = 0.02
POLL_MAX_S = 0.5


class ServiceError(ReasonctlError):
    """The service refused a request, failed it, or did not answer before the deadline."""


class ServiceRefused(ServiceError):
    """The service answered 4xx (not 429): the request itself is wrong (token, reward name,
    media), so retrying or scoring 0 would not help. ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class RewardServiceClient:
    """Talks to one reward service at ``url`` with ``token``."""

    def __init__(self, url: str, token: str, *, connect_timeout: float = 10.0,
                 read_timeout: float = 120.0) -> None:
        httpx = require("httpx", "serve", "the remote reward")
        self.url = url.rstrip("/")
        self._httpx = httpx
        self._client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
        )
        self.retries = 0

    def __repr__(self) -> str:
        return f"RewardServiceClient({self.url!r})"

    def enqueue(self, body: bytes, *, deadline: float) -> str:
        """Send one request; its id. Raises :class:`ServiceError` (4xx, or past
        ``deadline``, a :func:`time.monotonic` time)."""
        response = self._send("POST", "/api/reward/enqueue", deadline=deadline, content=body,
                              headers={"Content-Type": "application/octet-stream"})
        return str(response.json()["uuid"])

    def wait(self, request_id: str, *, deadline: float) -> dict[str, Any]:
        """Pull until the request is ``done`` or ``failed``; the final answer."""
        pause = POLL_START_S
        while True:
            response = self._send("GET", f"/api/reward/result/{request_id}", deadline=deadline)
            if response.status_code == 200:
                return dict(response.json())
            if time.monotonic() + pause > deadline:
                raise ServiceError(f"request {request_id} was still pending when the deadline "
                                   "passed; raise the remote reward's timeout or add service "
                                   "workers")
            time.sleep(pause)
            pause = min(pause * 1.5, POLL_MAX_S)

    def _send(self, method: str, path: str, *, deadline: float, **kwargs: Any) -> Any:
        """One call with retries on 429, 5xx and connection errors until ``deadline``."""
        attempt = 0
        while True:
            problem: str
            retry_after: float | None = None
            try:
                response = self._client.request(method, path, **kwargs)
            except self._httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 400:
                    return response
                problem = f"HTTP {status}: {_message(response)}"
                if status != 429 and status < 500:
                    raise ServiceRefused(f"the reward service at {self.url} refused the "
                                         f"request ({problem})", status)
                retry_after = _retry_after(response)
            attempt += 1
            pause = min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** (attempt - 1))
            pause = retry_after if retry_after is not None else pause * random.uniform(0.5, 1)
            if time.monotonic() + pause > deadline:
                raise ServiceError(f"the reward service at {self.url} did not accept the "
                                   f"request before the deadline ({attempt} attempts; last: "
                                   f"{problem})")
            self.retries += 1
            time.sleep(pause)

    def run_tool(self, name: str, arguments: dict[str, Any], *, deadline: float
                 ) -> dict[str, Any]:
        """One tool call (``POST /api/tools/run``): ``{"result": ...}`` or
        ``{"error": ...}``. Retries as :meth:`enqueue` does; raises :class:`ServiceError`."""
        response = self._send("POST", "/api/tools/run", deadline=deadline,
                              json={"tool": name, "arguments": arguments})
        return dict(response.json())

    def probe(self) -> tuple[dict[str, Any] | None, int | None]:
        """One quick look at the service: ``GET /health`` (what it serves) and the status
        of ``GET /metrics``, which needs the token (401 for a wrong one); ``(None, None)``
        when the service cannot be reached now."""
        quick = self._httpx.Timeout(10.0, connect=3.0)
        try:
            health = self._client.get("/health", timeout=quick)
            status = self._client.get("/metrics", timeout=quick).status_code
        except self._httpx.TransportError:
            return None, None
        try:
            served = health.json() if health.status_code == 200 else None
        except ValueError:
            served = None
        return (served if isinstance(served, dict) else None), status

    def close(self) -> None:
        """Close the connections."""
        self._client.close()


def _message(response: Any) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:200]


def _retry_after(response: Any) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


__all__ = ["RewardServiceClient", "ServiceError", "ServiceRefused"]
