"""Tool calls in the model's own chat format, read from the text of one turn.

Qwen2.5 and Qwen3 (and the many models trained on their template) call a tool by writing
a JSON object between ``<tool_call>`` and ``</tool_call>``::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 91"}}
    </tool_call>

A turn may hold several calls. :func:`parse_tool_calls` returns every call in order; a call
that cannot be read (no closing tag, not JSON, no ``name``, arguments that are not an
object) is returned as a :class:`ToolCall` with an ``error`` saying what is wrong, so the
environment answers it with an error observation instead of failing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)(" + re.escape(CLOSE_TAG) + r"|$)", re.S)
MAX_SHOWN = 200
"""Characters of a malformed call quoted back in its error message."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments``, or the ``error`` that made the
    block unreadable (then ``name`` is what could be read, possibly empty)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def has_tool_call(text: str) -> bool:
    """Whether ``text`` opens a tool call."""
    return OPEN_TAG in text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call of a turn, in order (empty when the turn calls no tool)."""
    return [_parse_block(match.group(1), closed=bool(match.group(2)))
            for match in _BLOCK.finditer(text)]


def _parse_block(body: str, *, closed: bool) -> ToolCall:
    shown = body.strip()
    if len(shown) > MAX_SHOWN:
        shown = shown[:MAX_SHOWN] + "..."
    if not closed:
        return ToolCall(error=f"the tool call is not closed with {CLOSE_TAG}: {shown!r}")
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        return ToolCall(error=f"the tool call is not valid JSON ({reason}): {shown!r}; "
                        'write {"name": ..., "arguments": {...}}')
    if not isinstance(value, dict):
        return ToolCall(error=f"the tool call must be a JSON object, not {shown!r}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error=f'the tool call has no "name": {shown!r}')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, error=f'the "arguments" of {name} are not a JSON object: '
                            f"{arguments[:MAX_SHOWN]!r}")
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'the "arguments" of {name} must be a JSON object, not '
                        f"{json.dumps(arguments)[:MAX_SHOWN]}")
    return ToolCall(name, arguments)
