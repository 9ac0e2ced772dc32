"""Registers the ``tools`` environment: tool calls in the chat format, answered by a
calculator and by Python run in a sandbox (:mod:`reasonctl.environments`).

Config section ``[environment.tools]``
(:class:`reasonctl.environments.config.ToolsEnvironmentConfig`); the implementation is
imported when the hook runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_environments(register: Registrar) -> None:
    """Register ``tools``."""
    from reasonctl.environments.config import ToolsEnvironmentConfig
    from reasonctl.environments.tools_factory import build_tools_environment

    register("tools", build_tools_environment, config_model=ToolsEnvironmentConfig,
             description="Tool calls in the chat format: a calculator and sandboxed Python")
