"""Registers the embedded ``hf`` rollout engine (:mod:`reasonctl.rollout`).

Config section ``[rollout.hf]`` (:class:`reasonctl.rollout.config.HFRolloutConfig`); the
factory (:func:`reasonctl.rollout.factory.build_hf_engine`) decides, from the run's backend,
whether the engine shares the policy module or keeps its own copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_rollout_engines(register: Registrar) -> None:
    """Register the embedded ``hf`` engine."""
    from reasonctl.rollout.config import HFRolloutConfig
    from reasonctl.rollout.factory import build_hf_engine

    register("hf", build_hf_engine, config_model=HFRolloutConfig)
