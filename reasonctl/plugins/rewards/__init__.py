"""Registers the first-party rewards: the rule-based ``format``, ``choice``, ``math``,
``exact_match``, ``length``, and ``remote`` (scores from ``reasonctl serve-rewards``).

The rewards and their config models live in :mod:`reasonctl.rewards`; they are imported
when the hook runs, so importing this module costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_rewards(register: Registrar) -> None:
    """Register the rule-based rewards with their config models."""
    from reasonctl.rewards.choice import ChoiceConfig, ChoiceReward
    from reasonctl.rewards.exact_match import ExactMatchConfig, ExactMatchReward
    from reasonctl.rewards.format import FormatConfig, FormatReward
    from reasonctl.rewards.length import LengthConfig, LengthReward
    from reasonctl.rewards.math import MathConfig, MathReward
    from reasonctl.rewards.remote import RemoteConfig, remote_reward

    register("format", FormatReward, config_model=FormatConfig)
    register("choice", ChoiceReward, config_model=ChoiceConfig)
    register("math", MathReward, config_model=MathConfig)
    register("exact_match", ExactMatchReward, config_model=ExactMatchConfig)
    register("length", LengthReward, config_model=LengthConfig)
    register("remote", remote_reward, config_model=RemoteConfig,
             description="Scores from a reward service (reasonctl serve-rewards).")
