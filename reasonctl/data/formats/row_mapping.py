"""Config keys that map a file's columns onto reasonctl's row layouts (``jsonl`` and ``hf``).

- ``columns`` renames columns to row fields: ``columns = {prompt = "question", answer =
  "label", video = "video_path"}``;
- ``prompt`` / ``answer`` are constant templates filled from each row's columns
  (:mod:`reasonctl.data.templates`): a dataset of ``{video, label}`` rows becomes
  question/answer samples with ``prompt = "Is there a collision in this video? Answer yes
  or no."`` and ``answer = "{label}"``;
- ``value_names`` turns a column's values into words before they fill a template:
  ``value_names = {label = {"0" = "no", "1" = "yes"}}``.

A template replaces the row's own prompt or answer; a row that also holds a
conversation (``messages``/``conversations``) is a bad row, since the two would disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from reasonctl.data.formats.media_options import MediaOptions

RowField = Literal[
    "messages", "conversations", "prompt", "system", "response", "answer", "completion",
    "reference", "meta", "image", "images", "video", "videos", "qa_pairs",
]
"""The row fields a column can be mapped to (:mod:`reasonctl.data.messages`)."""


class RowMappingOptions(MediaOptions):
    """``columns``, ``prompt``, ``answer`` and ``value_names`` of a row-based format."""

    columns: dict[RowField, str] = Field(
        default_factory=dict, description="Row field -> column of the data."
    )
    prompt: str | None = Field(
        default=None,
        description="The user's text for every row, with {column} placeholders (replaces the "
        "row's prompt).",
    )
    answer: str | None = Field(
        default=None,
        description="The answer (and reference) for every row, with {column} placeholders.",
    )
    value_names: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="Column -> {value: text} applied before a value fills a template, e.g. "
        "{label = {\"0\" = \"no\", \"1\" = \"yes\"}}.",
    )

    def map_row(self, record: Any) -> Any:
        """``record`` with columns renamed and the templates filled (non-objects pass)."""
        from reasonctl.data.messages import RowProblem
        from reasonctl.data.templates import as_text, fill

        if not isinstance(record, Mapping):
            return record
        renamed = {column: field for field, column in self.columns.items()}
        out = {renamed.get(k, k): v for k, v in record.items()}
        if self.prompt is None and self.answer is None:
            return out
        values = {key: self._named(key, value, as_text) for key, value in record.items()}
        if self.prompt is not None:
            held = [k for k in ("messages", "conversations") if out.get(k) is not None]
            if held:
                raise RowProblem(f"the row has {held[0]!r} and the format's prompt template "
                                 "is set; remove one of them")
            out["prompt"] = fill(self.prompt, values, "prompt")
        if self.answer is not None:
            for key in ("response", "completion"):
                out.pop(key, None)
            out["answer"] = fill(self.answer, values, "answer")
        return out

    def _named(self, column: str, value: Any, as_text: Any) -> Any:
        names = self.value_names.get(column)
        if names is None:
            return value
        return names.get(as_text(value), value)
