"""Registers the built-in ``tools`` environment (calculator and sandboxed Python) and the
``code_tests`` reward, which runs code against unit tests in the same sandbox.

The implementations live in :mod:`reasonctl.environments` and
:mod:`reasonctl.rewards.code_tests`; they are imported when the hooks run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_environments(register: Registrar) -> None:
    """Register ``tools`` with its ``[environment.tools]`` section."""
    from reasonctl.environments.config import ToolsEnvironmentConfig
    from reasonctl.environments.tools_env import build_tools_environment

    register("tools", build_tools_environment, config_model=ToolsEnvironmentConfig,
             description="Tool calls in the chat format: a calculator and sandboxed Python")


@hookimpl
def register_rewards(register: Registrar) -> None:
    """Register ``code_tests``."""
    from reasonctl.rewards.code_tests import CodeTestsConfig, CodeTestsReward

    register("code_tests", CodeTestsReward, config_model=CodeTestsConfig,
             description="Fraction of the sample's unit tests the code passes (sandboxed)")
