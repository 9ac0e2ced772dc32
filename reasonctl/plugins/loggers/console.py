"""Registers the ``console`` logger (progress on stderr).

The logger and its config model (``[logging.console]``) are in
:mod:`reasonctl.loggers.console`, imported when the hook runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_loggers(register: Registrar) -> None:
    """Register the ``console`` logger."""
    from reasonctl.loggers.console import ConsoleLoggerConfig, build_console_logger

    register(
        "console",
        build_console_logger,
        config_model=ConsoleLoggerConfig,
        description="Progress bar on a terminal, periodic progress lines otherwise (stderr).",
    )
