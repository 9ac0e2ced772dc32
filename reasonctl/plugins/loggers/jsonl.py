"""Registers the ``jsonl`` logger (metrics as JSON lines, plus the training curves).

The logger and its config model (``[logging.jsonl]``) are in
:mod:`reasonctl.loggers.jsonl`, imported when the hook runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_loggers(register: Registrar) -> None:
    """Register the ``jsonl`` logger."""
    from reasonctl.loggers.jsonl import JsonlLoggerConfig, build_jsonl_logger

    register(
        "jsonl",
        build_jsonl_logger,
        config_model=JsonlLoggerConfig,
        description="Metrics as JSON lines in <output_dir>/metrics.jsonl (+ training curves).",
    )
