"""A calculator tool: arithmetic read by a parser, never evaluated as code.

:func:`calculate` parses an expression with Python's own parser (:func:`ast.parse`, which
only builds a syntax tree) and computes it by walking the tree, accepting nothing but
numbers, parentheses, ``+ - * / // % **`` (``^`` is read as a power, as on a calculator)
and unary signs. Names, calls, attributes and every other construct are rejected, and
sizes are bounded so that no expression can take long or use much memory: the text's
length, exponents, and the size of every intermediate integer.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_INTEGER_BITS = 4096
"""Integers above this size (about 1233 decimal digits) are refused."""

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and "
                       "parentheses, exactly for integers.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "e.g. (37 * 91) - 4"}},
            "required": ["expression"],
        },
    },
}
"""The tool's JSON schema, as chat templates describe tools."""


class CalculatorError(ValueError):
    """The expression cannot be computed; the message says why."""


def calculate(expression: str) -> str:
    """The value of ``expression`` as text: integers exactly, other numbers to 12
    significant digits (a float with an integral value is written as an integer).

    Raises :class:`CalculatorError` naming what is not allowed or went wrong.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("give a non-empty arithmetic expression as a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        # 2^10 is a power on a calculator (and binds as tightly as **)
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot read {expression!r} as arithmetic") from exc
    value = _value(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents above {MAX_EXPONENT} are not allowed")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) \
                and isinstance(right, int) and right > 0 \
                and left.bit_length() * right > MAX_INTEGER_BITS:
            raise CalculatorError("the result would be too large")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number")
        return _checked(result)
    raise CalculatorError(f"{ast.unparse(node)!r} is not arithmetic (only numbers, "
                          "+ - * / // % ** and parentheses)")


def _checked(value: Any) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise CalculatorError("the result would be too large")
    return value
