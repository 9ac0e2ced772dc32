"""The metrics file of a run (``metrics.jsonl``): how values are written and read back.

Each line is a JSON object ``{"step": n, "time": <unix seconds>, <metric>: <value>, ...}``.
Non-finite numbers are not valid JSON; they are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` (the spelling ``float()`` reads back), so a diverging
loss stays visible in the file, and :func:`read_metrics` turns them back into floats.

The ``jsonl`` logger (:mod:`reasonctl.loggers.jsonl`) writes the file, the training curves
(:mod:`reasonctl.loggers.plot`), tests and benchmarks read it; this module needs neither.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
"""How non-finite floats are spelled in the file, and their values."""


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
