"""A small JSON-over-HTTP client of a vLLM server (standard library only).

It speaks the OpenAI-compatible ``/v1/completions`` route (token ids in, token ids and
log-probs out) and the development routes of a server started with
``VLLM_SERVER_DEV_MODE=1``: pause/resume, the weight-update protocol, the prefix cache.
Each failure names the route, the status and the server's message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from reasonctl.core.errors import ReasonctlError


class ServerError(ReasonctlError):
    """A vLLM server request failed."""


class ServerClient:
    """Requests to the vLLM server at ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, *, timeout_s: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def request(self, method: str, route: str, body: dict[str, Any] | None = None, *,
                timeout_s: float | None = None) -> Any:
        """Send one request; the decoded JSON answer (``None`` for an empty one)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.base_url}{route}", data=data, method=method,
                                         headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            hint = (" (is the server started with VLLM_SERVER_DEV_MODE=1?)"
                    if exc.code == 404 else "")
            raise ServerError(f"vLLM server {method} {route}: HTTP {exc.code}{hint}: "
                              f"{detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"vLLM server {method} {route} at {self.base_url}: {exc}") from exc
        return json.loads(raw) if raw.strip() else None

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            self.request("GET", "/health", timeout_s=5)
        except ServerError:
            return False
        return True

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions``."""
        return self.request("POST", "/v1/completions", body)

    def pause(self) -> None:
        """Stop scheduling once running requests finish, and clear the caches."""
        self.request("POST", "/pause?mode=wait&clear_cache=true")

    def resume(self) -> None:
        """Schedule requests again."""
        self.request("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt prefixes (their KV was computed with old weights)."""
        self.request("POST", "/reset_prefix_cache")

    def world_size(self) -> int:
        """How many worker processes the server runs (tensor x pipeline x data parallel)."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def weight_version(self) -> str:
        """The server's current weight version."""
        return str(self.request("GET", "/weight_info")["weight_version"])

    # the weight-update protocol (GlooWeightSender's control plane)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``POST /init_weight_transfer_engine``."""
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``POST /start_weight_update``."""
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """``POST /update_weights``."""
        self.request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``POST /finish_weight_update``."""
        self.request("POST", "/finish_weight_update", {"weight_version": weight_version})
