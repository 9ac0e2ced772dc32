"""The error a data row raises when it cannot become a sample.

Row layouts and readers raise :class:`RowProblem`; the readers report it as
``file:line: reason`` (or skip the row under ``data.on_bad_row = "skip"``)."""

from __future__ import annotations


class RowProblem(ValueError):
    """What is wrong with one row; the reader prefixes it with ``file:line``.

    ``source`` overrides that location when the problem is in another file (for example a
    meta file next to a video).
    """

    def __init__(self, message: str, *, source: str | None = None) -> None:
        super().__init__(message)
        self.source = source
