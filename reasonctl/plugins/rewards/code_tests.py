"""Registers the ``code_tests`` reward: a completion's code run against the sample's unit
tests in the sandbox of the ``tools`` environment (:mod:`reasonctl.rewards.code_tests`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_rewards(register: Registrar) -> None:
    """Register ``code_tests``."""
    from reasonctl.rewards.code_tests import CodeTestsConfig, CodeTestsReward

    register("code_tests", CodeTestsReward, config_model=CodeTestsConfig,
             description="Fraction of the sample's unit tests the code passes (sandboxed)")
