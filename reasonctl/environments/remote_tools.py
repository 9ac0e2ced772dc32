"""Tools run by a reward service: the ``tools`` environment's ``[environment.tools.remote]``.

Each call is one ``POST /api/tools/run`` to ``reasonctl serve-rewards`` (bearer token, as
the ``remote`` reward; retried on 429, 5xx and connection errors until ``timeout``). The
service runs the tool in its own sandbox and answers with the result or the error text
the tool would give here. A call the service cannot answer in time is answered with an
error (the episode goes on); a token the service no longer accepts stops the run.
:func:`remote_tools` checks at start that the service answers, accepts the token and serves
the tools, so a misconfiguration stops the run before it trains.
"""

from __future__ import annotations

import os
import time
from typing import Any

from reasonctl.core.config.redaction import remember_secret_variables
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.environments.config import RemoteToolsConfig
from reasonctl.environments.tools_env import TOOL_SCHEMAS, Tool, ToolError

WHERE = "environment.tools.remote"


class RemoteTool:
    """A tool whose calls the reward service runs (see the module docstring)."""

    def __init__(self, name: str, client: Any, config: RemoteToolsConfig) -> None:
        self.name = name
        self.schema = TOOL_SCHEMAS[name]
        self.client = client
        self.config = config

    def run(self, arguments: dict[str, Any]) -> str:
        """The service's answer to the call."""
        from reasonctl.reward_service.client import ServiceError, ServiceRefused

        try:
            answer = self.client.run_tool(self.name, arguments,
                                          deadline=time.monotonic() + self.config.timeout)
        except ServiceRefused as exc:
            if exc.status in (401, 403):
                raise ReasonctlError(f"{WHERE}: the tool service at {self.config.url} refused "
                                     f"the token in {self.config.token_env} ({exc})") from exc
            raise ToolError(f"the tool service refused the call: {exc}") from None
        except ServiceError as exc:
            raise ToolError(f"the tool service did not answer: {exc}") from None
        if "error" in answer:
            raise ToolError(str(answer["error"]))
        return str(answer.get("result", ""))


def remote_tools(config: RemoteToolsConfig) -> dict[str, Tool]:
    """The tools ``config`` names, run by the service; checked with it now."""
    from reasonctl.reward_service.client import RewardServiceClient

    remember_secret_variables([config.token_env])
    token = os.environ.get(config.token_env, "").strip()
    if not token:
        raise ConfigError([f"{WHERE}.token_env: environment variable {config.token_env} is "
                           "not set; export the service's token there"])
    client = RewardServiceClient(config.url, token, read_timeout=config.timeout)
    health, status = client.probe()
    if health is None:
        raise ConfigError([f"{WHERE}.url: no tool service answers at {config.url}; start "
                           "`reasonctl serve-rewards` with [tools] serve there"])
    if status in (401, 403):
        raise ConfigError([f"{WHERE}.token_env: the service at {config.url} refuses the token "
                           f"in {config.token_env} (HTTP {status})"])
    served = health.get("tools") or []
    missing = [name for name in config.tools if name not in served]
    if missing:
        raise ConfigError([f"{WHERE}.tools: the service at {config.url} does not run "
                           f"{', '.join(missing)} (it serves: {', '.join(served) or 'no tools'}"
                           "); add them to its [tools] serve"])
    return {name: RemoteTool(name, client, config) for name in config.tools}
