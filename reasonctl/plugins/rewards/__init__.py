"""First-party rule-based rewards: ``format``, ``choice``, ``math``, ``exact_match``, ``length``.

The answer parsers they use live in :mod:`reasonctl.plugins.rewards.answers` and are
public, so evaluation scores answers exactly as training rewards them.
"""

from __future__ import annotations

from reasonctl import hookimpl
from reasonctl.core.registry import Registrar
from reasonctl.plugins.rewards.choice import ChoiceConfig, ChoiceReward
from reasonctl.plugins.rewards.exact_match import ExactMatchConfig, ExactMatchReward
from reasonctl.plugins.rewards.format import FormatConfig, FormatReward
from reasonctl.plugins.rewards.length import LengthConfig, LengthReward
from reasonctl.plugins.rewards.math import MathConfig, MathReward


@hookimpl
def register_rewards(register: Registrar) -> None:
    """Register the rule-based rewards with their config models."""
    register("format", FormatReward, config_model=FormatConfig)
    register("choice", ChoiceReward, config_model=ChoiceConfig)
    register("math", MathReward, config_model=MathConfig)
    register("exact_match", ExactMatchReward, config_model=ExactMatchConfig)
    register("length", LengthReward, config_model=LengthConfig)
