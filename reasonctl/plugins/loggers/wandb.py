"""Registers the ``wandb`` logger (Weights & Biases runs).

The logger and its config model (``[logging.wandb]``) are in
:mod:`reasonctl.loggers.wandb`, imported when the hook runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_loggers(register: Registrar) -> None:
    """Register the ``wandb`` logger."""
    from reasonctl.loggers.wandb import WandbLoggerConfig, build_wandb_logger

    register(
        "wandb",
        build_wandb_logger,
        config_model=WandbLoggerConfig,
        description="Weights & Biases run, offline unless WANDB_API_KEY is set (extra: wandb).",
    )
