"""Registers the ``flow_grpo`` algorithm (implementation: :mod:`reasonctl.diffusion.flow_grpo`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar
    from reasonctl.diffusion.config import FlowGRPOConfig


def build_flow_grpo(config: FlowGRPOConfig | None) -> Any:
    """Create FlowGRPO with its validated config."""
    from reasonctl.diffusion.config import FlowGRPOConfig
    from reasonctl.diffusion.flow_grpo import FlowGRPO

    return FlowGRPO(config or FlowGRPOConfig())


@hookimpl
def register_algorithms(register: Registrar) -> None:
    """Register ``flow_grpo``."""
    from reasonctl.diffusion.config import FlowGRPOConfig

    register("flow_grpo", build_flow_grpo, config_model=FlowGRPOConfig,
             description="FlowGRPO: RL of flow-matching image/video models (diffusers)")
