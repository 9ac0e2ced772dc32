"""The ``jsonl`` logger: one JSON object per logged step in ``<output_dir>/metrics.jsonl``.

Each line is ``{"step": n, "time": <unix seconds>, <metric>: <value>, ...}`` and is flushed
as soon as it is written, so the file is current even if the process dies.

Values are encoded as :mod:`reasonctl.loggers.metrics_file` describes (non-finite
numbers as ``"NaN"``/``"Infinity"`` strings); read the file back with
:func:`~reasonctl.loggers.metrics_file.read_metrics`.

The file follows the run's history:

- resuming from step ``N`` keeps every line up to step ``N`` and drops the lines with a
  larger step (they were logged after the checkpoint and will be logged again), as well
  as a last line torn by a crash;
- a run starting from step 0 in a directory that already holds the file moves the old
  file aside to ``metrics.1.jsonl`` (``.2``, ... if taken) instead of mixing two runs.

When ``logging.plot`` is true, closing the logger draws ``training_curves.png`` next to the
run's outputs from this file (see :mod:`reasonctl.loggers.plot`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.loggers.metrics_file import encode_value, move_aside, truncate_after

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext

RESERVED = ("step", "time")


class JsonlLoggerConfig(BaseModel):
    """``[logging.jsonl]``."""

    model_config = ConfigDict(extra="forbid")

    filename: str = Field(
        default="metrics.jsonl",
        description="Metrics file; a relative path is taken under run.output_dir.",
    )


class JsonlLogger:
    """Appends one JSON line per logged step to a metrics file."""

    def __init__(self, path: Path, *, start_step: int = 0, ctx: RunContext | None = None) -> None:
        """Open ``path`` for appending, reconciling an existing file with ``start_step``.

        ``ctx`` (optional) receives notices and decides whether to plot on :meth:`close`.
        """
        self.path = path
        self._ctx = ctx
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > 0:
            if start_step > 0:
                dropped = truncate_after(path, start_step)
                if dropped:
                    self._info(f"{path.name}: dropped {dropped} line(s) logged after step "
                               f"{start_step} (resuming from that step)")
            else:
                moved = move_aside(path)
                self._info(f"{path.name}: a previous run's metrics were moved to {moved.name}")
        self._file: TextIO | None = path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append the metrics of ``step`` as one line and flush it."""
        if self._file is None:
            raise RuntimeError(f"the jsonl logger for {self.path} is closed")
        record: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        for name, value in metrics.items():
            if name not in RESERVED:
                record[name] = encode_value(value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file and, when ``logging.plot`` is on, draw the training curves."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self._ctx is not None and self._ctx.config.logging.plot:
            from reasonctl.loggers.plot import CURVES_FILENAME, plot_training_curves

            target = self._ctx.output_dir / CURVES_FILENAME
            try:
                plot_training_curves(self.path, target)
            except Exception as exc:  # a plot must never turn a finished run into a failure
                self._info(f"warning: could not draw {target}: {type(exc).__name__}: {exc}")

    def _info(self, message: str) -> None:
        if self._ctx is not None:
            self._ctx.info(message)


def build_jsonl_logger(config: JsonlLoggerConfig, *, ctx: RunContext) -> JsonlLogger:
    """Write metrics to ``<output_dir>/<filename>``."""
    return JsonlLogger(ctx.output_dir / config.filename, start_step=ctx.step, ctx=ctx)

