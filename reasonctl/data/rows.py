"""Reading rows from data files with their line numbers, and turning them into datasets.

Every format reports a malformed row as ``file:line: reason``. :func:`read_json_rows`
yields ``(line, row)`` pairs from JSON Lines files and from JSON arrays (the line where
each element starts), and :func:`build_samples` applies the ``[data]`` options a format
applies while reading: ``on_bad_row`` (stop at the first bad row, or skip it and keep its
``file:line: reason``) and ``max_samples``. Rows that give a file twice
(:class:`~reasonctl.data.messages.DuplicateMediaWarning`) are counted and reported once.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from reasonctl.core.errors import DataError
from reasonctl.core.types import Sample
from reasonctl.data.datasets import ListDataset
from reasonctl.data.messages import DuplicateMediaWarning, RowProblem

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext


SKIP_HINT = '(set data.on_bad_row = "skip" to skip bad rows)'
"""What ends the error of a bad row that stops a run."""


def stopping_error(error: DataError) -> DataError:
    """``error`` of a bad row as it stops a run: with :data:`SKIP_HINT` added (once)."""
    return error if SKIP_HINT in str(error) else DataError(f"{error} {SKIP_HINT}")


@dataclass(frozen=True)
class RowOptions:
    """The format-independent ``[data]`` options a dataset format applies while reading.

    ``on_bad_row`` (stop at the first bad row, or skip and count) and ``max_samples`` (stop
    reading early). Prompt options (``system_prompt``, ``prompt_template``) are applied by
    the runner to every format alike (:class:`reasonctl.data.datasets.DatasetView`).
    """

    on_bad_row: Literal["error", "skip"] = "error"
    max_samples: int | None = None
    warn: Callable[[str], None] | None = None
    """Where notes about the data go (the run's console); None: Python warnings."""

    @classmethod
    def from_context(cls, ctx: RunContext | None) -> RowOptions:
        """Read the options from the run's ``[data]`` section (``None`` gives the defaults)."""
        if ctx is None:
            return cls()
        data = ctx.config.data
        return cls(on_bad_row=data.on_bad_row, max_samples=data.max_samples,
                   warn=lambda message: ctx.info(f"warning: {message}"))


@dataclass(frozen=True)
class Row:
    """A raw record, where it came from (``file:line``) and the file it was read from."""

    source: str
    value: Any
    file: Path | None = None


def split_problem(error: Exception, source: str) -> tuple[str, str]:
    """``(where, reason)`` of a data error whose message starts ``where: `` (``source``,
    the sample's ``file:line``, when it does not)."""
    message = str(error)
    if source and message.startswith(f"{source}: "):
        return source, message[len(source) + 2:]
    return source or "<sample>", message


def as_path_list(value: str | Path | Iterable[str | Path], key: str) -> list[Path]:
    """Normalise a ``path`` option to existing files, or raise naming ``key``."""
    paths = [value] if isinstance(value, (str, Path)) else list(value)
    if not paths:
        raise DataError(f"{key}: no data file given; set it to a file or a list of files")
    out = []
    for path in paths:
        resolved = Path(path).expanduser()
        if not resolved.is_file():
            raise DataError(
                f"{key}: data file not found: {resolved.absolute()} (relative paths resolve "
                f"against the working directory {Path.cwd()})"
            )
        out.append(resolved)
    return out


def read_json_rows(path: Path) -> Iterator[Row]:
    """Rows of a JSON Lines file, or of a JSON file holding an array of objects.

    A file whose first non-blank character is ``[`` is read as one JSON array; each element
    is reported at the line where it starts. Otherwise every non-blank line is one JSON
    value. Undecodable lines (bad JSON, or bytes that are not UTF-8) are yielded as
    :class:`RowProblem` values so the caller can skip them or stop.
    """
    data = path.read_bytes()
    if data.lstrip().startswith((b"[", b"\xef\xbb\xbf[")):
        yield from _json_array_rows(path, read_text(path, data))
        return
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            yield Row(f"{path}:{number}", RowProblem(_not_utf8(raw, exc.start)), path)
            continue
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            value = RowProblem(f"invalid JSON: {exc.msg} at column {exc.colno}")
        yield Row(f"{path}:{number}", value, path)


def read_text(path: Path, data: bytes | None = None) -> str:
    """A data file's text; a file that is not UTF-8 is a :class:`DataError` naming where."""
    data = path.read_bytes() if data is None else data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        start = data.rfind(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}:{line}: {_not_utf8(data[start:], exc.start - start)}"
                        ) from None


def _not_utf8(line: bytes, offset: int) -> str:
    return (f"not UTF-8 text (byte 0x{line[offset]:02x} at column {offset + 1}); save the "
            "file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def _json_array_rows(path: Path, text: str) -> Iterator[Row]:
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        position = _skip_space(text, position)
        if position < len(text) and text[position] == "]":
            return
        line = text.count("\n", 0, position) + 1
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{exc.lineno}: invalid JSON array: {exc.msg} at column {exc.colno}; "
                "the rest of the file cannot be read"
            ) from None
        yield Row(f"{path}:{line}", value, path)
        position = _skip_space(text, position)
        if position < len(text) and text[position] == ",":
            position += 1
        elif position >= len(text) or text[position] != "]":
            line = text.count("\n", 0, position) + 1
            raise DataError(f"{path}:{line}: invalid JSON array: expected ',' or ']'")


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def build_samples(
    rows: Iterable[Row],
    parse: Callable[[Row], Sample],
    options: RowOptions,
) -> ListDataset:
    """Parse rows into a dataset, applying ``on_bad_row`` and ``max_samples``.

    ``parse`` turns one :class:`Row` into a :class:`Sample` or raises
    :class:`RowProblem`. The sample's ``source`` is set to the row's ``file:line``; a
    skipped row's ``(file:line, reason)`` is kept in the dataset's ``skipped``.
    """
    samples: list[Sample] = []
    skipped: list[tuple[str, str]] = []
    repeated: list[str] = []
    for row in rows:
        if options.max_samples is not None and len(samples) >= options.max_samples:
            break
        try:
            if isinstance(row.value, RowProblem):
                raise row.value
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", DuplicateMediaWarning)
                sample = parse(row)
            for warning in caught:
                if issubclass(warning.category, DuplicateMediaWarning):
                    repeated.append(f"{row.source}: {warning.message}")
                else:
                    warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                           warning.lineno)
            sample.source = row.source
        except RowProblem as exc:
            if options.on_bad_row == "error":
                raise DataError(f"{exc.source or row.source}: {exc} {SKIP_HINT}") from None
            skipped.append((exc.source or row.source, str(exc)))
            continue
        samples.append(sample)
    if repeated:
        note = (f"{len(repeated)} row(s) give the same file twice; each file is used once "
                f"(first: {repeated[0]})")
        if options.warn is not None:
            options.warn(note)
        else:
            warnings.warn(note, DuplicateMediaWarning, stacklevel=2)
    return ListDataset(samples, skipped=skipped)
