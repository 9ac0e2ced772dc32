"""Registers the first-party rewards: the rule-based ``format``, ``choice``, ``math``,
``exact_match``, ``length``; the model rewards ``reward_model`` and ``judge``; and
``remote`` (scores from ``reasonctl serve-rewards``).

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
    """Register the first-party rewards with their config models."""
    from reasonctl.rewards.choice import ChoiceConfig, ChoiceReward
    from reasonctl.rewards.exact_match import ExactMatchConfig, ExactMatchReward
    from reasonctl.rewards.format import FormatConfig, FormatReward
    from reasonctl.rewards.judge import JudgeConfig, judge_reward
    from reasonctl.rewards.length import LengthConfig, LengthReward
    from reasonctl.rewards.math import MathConfig, MathReward
    from reasonctl.rewards.remote import RemoteConfig, remote_reward
    from reasonctl.rewards.reward_model import RewardModelConfig, reward_model_reward

    register("format", FormatReward, config_model=FormatConfig)
    register("choice", ChoiceReward, config_model=ChoiceConfig)
    register("math", MathReward, config_model=MathConfig)
    register("exact_match", ExactMatchReward, config_model=ExactMatchConfig)
    register("length", LengthReward, config_model=LengthConfig)
    register("reward_model", reward_model_reward, config_model=RewardModelConfig,
             description="A sequence-classification model's score of prompt + completion.")
    register("judge", judge_reward, config_model=JudgeConfig,
             description="A generative model's verdict or score under a rubric.")
    register("remote", remote_reward, config_model=RemoteConfig,
             description="Scores from a reward service (reasonctl serve-rewards).")
