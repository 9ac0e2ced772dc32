"""Tools the reward service runs for the episodes of remote trainers.

``POST /api/tools/run`` with ``{"tool": "python", "arguments": {"code": "..."}}`` answers
``{"result": "..."}`` or, when the call fails (bad arguments, code that fails or breaks a
sandbox limit), ``{"error": "..."}``: the same texts the ``tools`` environment gives when it
runs a tool itself. A request that is not such an object is a 400, a tool the service does
not serve a 404. At most ``[tools] concurrency`` calls run at once; code runs in the
service's own sandbox (``[tools.sandbox]``), which is tried when the service starts.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from reasonctl.core.errors import ConfigError, did_you_mean
from reasonctl.environments.sandbox import Sandbox, SandboxUnavailableError
from reasonctl.environments.tools_env import Tool, ToolError, make_tools


class ServedTools:
    """The ``[tools]`` of a service config, ready to run calls."""

    def __init__(self, serve: list[str], sandbox_config: Any, concurrency: int) -> None:
        sandbox = None
        if "python" in serve:
            try:
                sandbox = Sandbox.checked(sandbox_config, where="tools.sandbox")
            except SandboxUnavailableError as exc:
                raise ConfigError([f"tools.sandbox: {exc}"]) from exc
        self.tools: dict[str, Tool] = make_tools(list(serve), sandbox)
        self.slots = threading.BoundedSemaphore(concurrency)

    @property
    def names(self) -> list[str]:
        """The tools served."""
        return sorted(self.tools)

    def run(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """The HTTP status and JSON answer of one call (blocking: run it in a thread)."""
        try:
            request = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            request = None
        if not (isinstance(request, dict) and isinstance(request.get("tool"), str)
                and isinstance(request.get("arguments", {}), dict)):
            return 400, {"error": 'send {"tool": "<name>", "arguments": {...}} as JSON'}
        name = request["tool"]
        tool = self.tools.get(name)
        if tool is None:
            close = did_you_mean(name, self.tools)
            return 404, {"error": f"tool {name!r} is not served here"
                         + (f"; did you mean {close!r}?" if close else "")
                         + f" (served: {', '.join(self.names) or 'none'})"}
        with self.slots:
            try:
                return 200, {"result": tool.run(request.get("arguments", {}))}
            except (ToolError, SandboxUnavailableError, OSError) as exc:
                return 200, {"error": str(exc)}
