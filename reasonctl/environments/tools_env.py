"""The built-in ``tools`` environment: the policy calls a calculator and runs Python.

Each turn of the policy is read for tool calls in the chat format
(:mod:`~reasonctl.environments.tool_calls`). A turn without one is the final answer and
ends the episode. Otherwise every call is answered, in order, by a ``tool`` message: the
tool's result, or ``error: ...`` saying what went wrong (a malformed call, an unknown
tool, bad arguments, code that failed or broke a sandbox limit). Nothing the policy writes
can make a step raise. The run's rewards judge the final answer; with ``error_penalty``
the environment's own reward is minus that much per tool error.

Per-episode metrics: ``tool_calls``, ``tool_errors`` (``malformed_tool_calls`` among
them) and ``tool_seconds``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from reasonctl.core.types import ContentPart, Message, Metrics, Observation, Sample
from reasonctl.environments import calculator
from reasonctl.environments.config import ToolsEnvironmentConfig
from reasonctl.environments.sandbox import Sandbox, SandboxUnavailableError
from reasonctl.environments.tool_calls import parse_tool_calls

if TYPE_CHECKING:
    pass

PYTHON_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program in a sandbox (no network, no files kept) and "
                       "return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program."}},
            "required": ["code"],
        },
    },
}


TOOL_SCHEMAS: dict[str, dict[str, Any]] = {"calculator": calculator.SCHEMA,
                                            "python": PYTHON_SCHEMA}
"""The built-in tools' JSON schemas by name."""


class ToolError(Exception):
    """A tool could not answer a call; the message becomes the error observation."""


class Tool(Protocol):
    """One tool of the environment: its name, JSON schema and how it answers a call."""

    name: str
    schema: dict[str, Any]

    def run(self, arguments: dict[str, Any]) -> str:
        """The result of a call, or :class:`ToolError`."""
        ...


class CalculatorTool:
    """``calculator``: ``{"expression": "37 * 91"}`` -> ``"3367"``."""

    name = "calculator"
    schema = calculator.SCHEMA

    def run(self, arguments: dict[str, Any]) -> str:
        """The expression's value."""
        expression = _argument(arguments, "expression", self.name)
        try:
            return calculator.calculate(expression)
        except calculator.CalculatorError as exc:
            raise ToolError(str(exc)) from None


class PythonTool:
    """``python``: ``{"code": "print(2 ** 10)"}`` -> what the program prints, run in the
    sandbox; a program that fails or breaks a limit is an error with its reason."""

    name = "python"
    schema = PYTHON_SCHEMA

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def run(self, arguments: dict[str, Any]) -> str:
        """The program's output."""
        code = _argument(arguments, "code", self.name)
        result = self.sandbox.run(code)
        if not result.ok:
            shown = result.stdout.strip()
            raise ToolError(result.failure(self.sandbox.config)
                            + (f"\noutput before that:\n{shown}" if shown else ""))
        return result.stdout if result.stdout.strip() else "(the program printed nothing)"


def _argument(arguments: dict[str, Any], key: str, tool: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ToolError(f'{tool} takes {{"{key}": "..."}} (a string); got '
                        f"{sorted(arguments) or 'no arguments'}")
    unknown = sorted(set(arguments) - {key})
    if unknown:
        raise ToolError(f"{tool} takes only {key!r}; unknown: {', '.join(unknown)}")
    return value


@dataclass
class _Counts:
    calls: int = 0
    errors: int = 0
    malformed: int = 0
    seconds: float = 0.0


class ToolsEpisode:
    """One episode of :class:`ToolsEnvironment` (see the module docstring)."""

    def __init__(self, tools: dict[str, Tool], max_result_chars: int,
                 error_penalty: float = 0.0) -> None:
        self.tools = tools
        self.max_result_chars = max_result_chars
        self.error_penalty = error_penalty
        self.counts = _Counts()

    def step(self, turn: str) -> Observation:
        """Answer every tool call of ``turn``; a turn without one ends the episode."""
        calls = parse_tool_calls(turn)
        if not calls:
            return Observation(done=True)
        messages = []
        for call in calls:
            started = time.perf_counter()
            result = self._answer(call.name, call.arguments, call.error)
            self.counts.seconds += time.perf_counter() - started
            self.counts.calls += 1
            messages.append(Message("tool", [ContentPart("text", text=self._cut(result))]))
        return Observation(messages)

    def reward(self) -> float | None:
        """Minus ``error_penalty`` per tool error; None without a penalty (the run's
        rewards judge the final answer either way)."""
        if not self.error_penalty:
            return None
        return -self.error_penalty * self.counts.errors

    def metrics(self) -> Metrics:
        """``tool_calls``, ``tool_errors``, ``malformed_tool_calls``, ``tool_seconds``."""
        counts = self.counts
        return {"tool_calls": float(counts.calls), "tool_errors": float(counts.errors),
                "malformed_tool_calls": float(counts.malformed),
                "tool_seconds": counts.seconds}

    def _answer(self, name: str, arguments: dict[str, Any], error: str | None) -> str:
        if error is not None:
            self.counts.errors += 1
            self.counts.malformed += 1
            return f"error: {error}"
        tool = self.tools.get(name)
        if tool is None:
            self.counts.errors += 1
            return f"error: there is no tool {name!r}; the tools are {', '.join(self.tools)}"
        try:
            return tool.run(arguments)
        except (ToolError, SandboxUnavailableError, OSError) as exc:
            self.counts.errors += 1
            return f"error: {exc}"

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_result_chars:
            return text
        return text[: self.max_result_chars] + f"\n... ({len(text)} characters, cut)"


class ToolsEnvironment:
    """Episodes in which the policy may call ``config.tools`` (see the module docstring)."""

    def __init__(self, config: ToolsEnvironmentConfig, *, sandbox: Sandbox | None = None,
                 tools: dict[str, Tool] | None = None) -> None:
        self.config = config
        self.tools = tools if tools is not None else make_tools(config.tools, sandbox)

    def start(self, sample: Sample) -> ToolsEpisode:
        """A new episode (every episode has the same tools)."""
        return ToolsEpisode(self.tools, self.config.max_result_chars,
                            self.config.error_penalty)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas for the chat template (none with ``describe_tools = false``)."""
        if not self.config.describe_tools:
            return []
        return [tool.schema for tool in self.tools.values()]


def make_tools(names: list[str], sandbox: Sandbox | None) -> dict[str, Tool]:
    """The named built-in tools (``python`` runs code in ``sandbox``)."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name == "calculator":
            tools[name] = CalculatorTool()
        elif name == "python":
            if sandbox is None:
                raise ValueError("the python tool needs a sandbox")
            tools[name] = PythonTool(sandbox)
        else:
            raise ValueError(f"there is no built-in tool {name!r}")
    return tools
