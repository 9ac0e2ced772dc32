"""Registers the ``grpo`` algorithm (implementation: :mod:`reasonctl.algorithms.grpo`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.algorithms.grpo_config import GRPOConfig
    from reasonctl.core.registry import Registrar


def build_grpo(config: GRPOConfig | None) -> Any:
    """Create the GRPO algorithm with its validated config."""
    from reasonctl.algorithms.grpo import GRPO
    from reasonctl.algorithms.grpo_config import GRPOConfig

    return GRPO(config or GRPOConfig())


@hookimpl
def register_algorithms(register: Registrar) -> None:
    """Register ``grpo``."""
    from reasonctl.algorithms.grpo_config import GRPOConfig

    register("grpo", build_grpo, config_model=GRPOConfig,
             description="GRPO-family RL (DAPO, Dr.GRPO, GSPO knobs)")
