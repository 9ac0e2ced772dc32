"""Registers the first-party media rewards ``brightness`` and ``color``
(:mod:`reasonctl.rewards.media`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_rewards(register: Registrar) -> None:
    """Register the rewards on generated frames."""
    from reasonctl.rewards.media import BrightnessConfig, BrightnessReward, ColorConfig, ColorReward

    register("brightness", BrightnessReward, config_model=BrightnessConfig,
             description="Mean brightness of generated frames (media).")
    register("color", ColorReward, config_model=ColorConfig,
             description="Closeness of generated frames to an RGB colour (media).")
