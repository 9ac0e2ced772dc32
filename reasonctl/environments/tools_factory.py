"""The factory of the built-in ``tools`` environment: its local tools
(:mod:`~reasonctl.environments.tools_env`) and those it runs on a reward service
(:mod:`~reasonctl.environments.remote_tools`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl.core.errors import ConfigError
from reasonctl.environments.config import ToolsEnvironmentConfig
from reasonctl.environments.remote_tools import remote_tools
from reasonctl.environments.sandbox import Sandbox, SandboxUnavailableError
from reasonctl.environments.tools_env import ToolsEnvironment, make_tools

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext


def build_tools_environment(config: ToolsEnvironmentConfig | None, *,
                            ctx: RunContext | None = None) -> ToolsEnvironment:
    """The ``tools`` environment; with the python tool run here its sandbox is tried first,
    and a host that cannot confine as configured stops the run before it starts. Tools of
    ``[environment.tools.remote]`` run on a reward service, checked now
    (:mod:`~reasonctl.environments.remote_tools`)."""
    config = config or ToolsEnvironmentConfig()
    remote = set(config.remote.tools) if config.remote is not None else set()
    unknown = sorted(remote - set(config.tools))
    if unknown:
        raise ConfigError([f"environment.tools.remote.tools: {', '.join(unknown)} not in "
                           f"environment.tools.tools ({', '.join(config.tools)})"])
    local = [name for name in config.tools if name not in remote]
    sandbox = None
    if "python" in local:
        try:
            sandbox = Sandbox.checked(config.sandbox, where="environment.tools.sandbox")
        except SandboxUnavailableError as exc:
            raise ConfigError([f"environment.tools.sandbox: {exc}"]) from exc
    tools = make_tools(local, sandbox)
    if config.remote is not None:
        tools.update(remote_tools(config.remote))
    return ToolsEnvironment(config, tools={name: tools[name] for name in config.tools})
