"""Registers ``--algo rloo``.

This module is imported whenever reasonctl loads its plugins (``reasonctl --help``,
``reasonctl plugins`` ...), so it imports only the light config model; the algorithm,
which needs torch, is imported by the factory when a run builds it.
"""

from __future__ import annotations

from typing import Any

import reasonctl
from reasonctl_rloo.config import RLOOConfig


def build_rloo(config: RLOOConfig) -> Any:
    """REINFORCE leave-one-out: each completion's reward against its group's other ones."""
    from reasonctl_rloo.algorithm import RLOO

    return RLOO(config)


@reasonctl.hookimpl
def register_algorithms(register: Any) -> None:
    """Register ``rloo`` with its ``[algorithm.rloo]`` section."""
    register("rloo", build_rloo, config_model=RLOOConfig)
