"""Registers the ``ddrl`` algorithm (implementation: :mod:`reasonctl.diffusion.ddrl`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar
    from reasonctl.diffusion.config import DDRLConfig


def build_ddrl(config: DDRLConfig | None) -> Any:
    """Create DDRL with its validated config."""
    from reasonctl.diffusion.config import DDRLConfig
    from reasonctl.diffusion.ddrl import DDRL

    return DDRL(config or DDRLConfig())


@hookimpl
def register_algorithms(register: Registrar) -> None:
    """Register ``ddrl``."""
    from reasonctl.diffusion.config import DDRLConfig

    register("ddrl", build_ddrl, config_model=DDRLConfig,
             description="DDRL: FlowGRPO regularised by the flow-matching loss on real data")
