"""The ``jsonl`` logger: one JSON object per logged step in ``<output_dir>/metrics.jsonl``.

Each line is ``{"step": n, "time": <unix seconds>, <metric>: <value>, ...}`` and is flushed
as soon as it is written, so the file is current even if the process dies.

Non-finite numbers are not valid JSON; they are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` (the spelling ``float()`` reads back), so a diverging
loss stays visible in the file. :func:`read_metrics` turns them back into floats.

The file follows the run's history:

- resuming from step ``N`` keeps every line up to step ``N`` and drops the lines with a
  larger step (they were logged after the checkpoint and will be logged again), as well
  as a last line torn by a crash;
- a run starting from step 0 in a directory that already holds the file moves the old
  file aside to ``metrics.1.jsonl`` (``.2``, ... if taken) instead of mixing two runs.

When ``logging.plot`` is true, closing the logger draws ``training_curves.png`` next to the
run's outputs from this file (see :mod:`reasonctl.plugins.loggers.plot`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import BaseModel, ConfigDict, Field

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.registry import Registrar

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
"""How non-finite floats are spelled in the file, and their values."""

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
            from reasonctl.plugins.loggers.plot import CURVES_FILENAME, plot_training_curves

            target = self._ctx.output_dir / CURVES_FILENAME
            try:
                plot_training_curves(self.path, target)
            except Exception as exc:  # a plot must never turn a finished run into a failure
                self._info(f"warning: could not draw {target}: {type(exc).__name__}: {exc}")

    def _info(self, message: str) -> None:
        if self._ctx is not None:
            self._ctx.info(message)


def encode_value(value: Any) -> Any:
    """A metric value as JSON data: numbers stay numbers, non-finite floats become strings."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isfinite(number):
        return number
    if math.isnan(number):
        return "NaN"
    return "Infinity" if number > 0 else "-Infinity"


def decode_value(value: Any) -> Any:
    """Inverse of :func:`encode_value` for the non-finite spellings."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file, in order, with non-finite values as floats.

    Lines that are not JSON objects with an integer ``step`` (for instance one torn by a
    crash) are skipped.
    """
    records = []
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            record = _parse(line)
            if record is not None:
                records.append({k: decode_value(v) for k, v in record.items()})
    return records


def truncate_after(path: Path, step: int) -> int:
    """Drop the records of ``path`` with a step above ``step``; return how many lines went.

    Lines that are not records are kept, except a last line without a newline, which a
    crash tore mid-write. The file is rewritten atomically, and only when something changes.
    """
    raw = path.read_bytes().decode("utf-8", errors="replace")
    lines = raw.splitlines(keepends=True)
    kept: list[str] = []
    dropped = 0
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        record = _parse(line)
        torn = index == len(lines) - 1 and not line.endswith("\n")
        if (record is not None and record["step"] > step) or (record is None and torn):
            dropped += 1
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    text = "".join(kept)
    if text != raw:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def move_aside(path: Path) -> Path:
    """Rename ``path`` (``metrics.jsonl``) to the first free ``metrics.<n>.jsonl``."""
    n = 1
    while (target := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.replace(path, target)
    return target


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def build_jsonl_logger(config: JsonlLoggerConfig, *, ctx: RunContext) -> JsonlLogger:
    """Write metrics to ``<output_dir>/<filename>``."""
    return JsonlLogger(ctx.output_dir / config.filename, start_step=ctx.step, ctx=ctx)


@hookimpl
def register_loggers(register: Registrar) -> None:
    """Register the ``jsonl`` logger."""
    register(
        "jsonl",
        build_jsonl_logger,
        config_model=JsonlLoggerConfig,
        description="Metrics as JSON lines in <output_dir>/metrics.jsonl (+ training curves).",
    )
