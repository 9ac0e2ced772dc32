"""The process that runs symbolic math comparisons for :mod:`reasonctl.rewards.math_judge`.

It is started as a script (``python -I math_worker.py``), imports nothing from reasonctl
and reads one JSON request per line on stdin, answering each with one JSON line on stdout:

- ``{"op": "verify", "gold": "...", "pred": "..."}`` -> ``{"result": true|false}``: whether
  ``math_verify.verify`` finds the parsed answers equivalent (symbolically or numerically);
- ``{"op": "value", "expr": "..."}`` -> ``{"result": "3.14159..."|null}``: the numeric
  value of a constant expression to 40 significant digits, or null when it has none.

Both answers are LaTeX or plain expressions already extracted by the caller; each is
parsed as the content of a ``\\boxed{}``. The caller enforces the time limit by killing
this process, so a pathological expression (``9^{9^{9^9}}``) can never stall it; the
library's own signal-based timeouts are therefore off. Errors answer ``false``/``null``.
"""

from __future__ import annotations

import json
import logging
import sys

VALUE_DIGITS = 40
MEMORY_LIMIT_BYTES = 4 << 30
WARM_UP = (("(x+1)^2", "x^2+2x+1"), ("\\{1,2\\}", "\\{2,1\\}"), ("\\frac{\\pi}{2}", "1.5708"))


def _parse(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(
        "\\boxed{" + text + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=None,  # type: ignore[arg-type]
    )


def _verify(gold: str, pred: str) -> bool:
    from math_verify import verify

    parsed_gold, parsed_pred = _parse(gold), _parse(pred)
    if not parsed_gold or not parsed_pred:
        return False
    return bool(verify(parsed_gold, parsed_pred, timeout_seconds=None))  # type: ignore[arg-type]


def _value(expr: str) -> str | None:
    from sympy import Basic

    for item in _parse(expr):
        if isinstance(item, Basic) and getattr(item, "is_number", False):
            value = item.evalf(VALUE_DIGITS)
            if value.is_real and value.is_finite:
                return str(value)
    return None


def _answer(request: dict) -> object:
    op = request.get("op")
    if op == "verify":
        return _verify(str(request["gold"]), str(request["pred"]))
    if op == "value":
        return _value(str(request["expr"]))
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    """Answer requests until stdin closes."""
    logging.disable(logging.CRITICAL)  # the library warns that its own timeouts are off
    try:  # a runaway expression fails with MemoryError instead of exhausting the machine
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    import math_verify  # noqa: F401  (fail now, before announcing readiness)

    for gold, pred in WARM_UP:  # load SymPy's lazily imported parts before the first limit
        _verify(gold, pred)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = _answer(json.loads(line))
        except Exception:
            result = None
        print(json.dumps({"result": result}), flush=True)


if __name__ == "__main__":
    main()
