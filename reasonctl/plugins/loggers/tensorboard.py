"""Registers the ``tensorboard`` logger (TensorBoard scalars).

The logger and its config model (``[logging.tensorboard]``) are in
:mod:`reasonctl.loggers.tensorboard`, imported when the hook runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_loggers(register: Registrar) -> None:
    """Register the ``tensorboard`` logger."""
    from reasonctl.loggers.tensorboard import TensorBoardLoggerConfig, build_tensorboard_logger

    register(
        "tensorboard",
        build_tensorboard_logger,
        config_model=TensorBoardLoggerConfig,
        description="TensorBoard scalars in <output_dir>/tensorboard (extra: tensorboard).",
    )
