"""Text templates of the dataset formats: ``{key}`` filled from a row's values.

Used by the ``prompt``/``answer`` options of ``video_folder``, ``jsonl`` and ``hf``. A key
is any text without braces, quotes or colons, spaces included (``{collision type}``), so
JSON meta keys work as they are written. ``{{`` and ``}}`` are literal braces; so is a
brace pair holding quotes or a colon (``{"answer": "A"}`` in an instruction stays as
written). A placeholder whose key the row does not have is a row problem that lists the
keys it has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}\"':]+)\}")


def as_text(value: Any) -> str:
    """A value as template text: strings as they are, everything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, ensure_ascii=False, default=str)


def placeholders(template: str) -> list[str]:
    """The keys ``template`` asks for, in order."""
    return [m.group(1) for m in PLACEHOLDER.finditer(template) if m.group(1) is not None]


def fill(template: str, values: Mapping[str, Any], option: str) -> str:
    """``template`` with every ``{key}`` replaced by ``as_text(values[key])``.

    Raises :class:`~reasonctl.data.messages.RowProblem` naming ``option`` (e.g. ``prompt``)
    for a key the row does not have.
    """

    def replace(match: re.Match[str]) -> str:
        text = match.group(0)
        if text in ("{{", "}}"):
            return text[0]
        key = match.group(1)
        if key in values:
            return as_text(values[key])
        from reasonctl.data.messages import RowProblem

        raise RowProblem(
            f"the {option} template uses {{{key}}} but the row has only "
            f"{', '.join(sorted(map(str, values))) or 'no keys'}"
        )

    return PLACEHOLDER.sub(replace, template)
