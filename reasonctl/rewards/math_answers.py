"""Reading the final answer of a math response and deciding whether it is right.

Used by the ``math`` reward and by evaluation with ``answer_format = "math"``, so both judge
a response the same way. The rules, in order:

**The predicted answer.**

1. With an answer tag (``<answer>`` by default), the content of the *last* complete
   ``<answer>...</answer>`` block is the region read below; with ``require_tag`` a
   response without one has no answer. Without the block, the whole response is read.
2. If the region holds ``\\boxed{...}`` or ``\\fbox{...}``, the last one is the answer
   (an empty box is no answer). Two different boxes joined by "or" (``\\boxed{3} or
   \\boxed{4}``) are a hedge: wrong.
3. Otherwise (unless ``require_boxed``): inside an answer block, the whole block, or the
   last "answer is ..." / "answer: ..." statement in it; in a whole response, the last such
   statement, else the last number or ``$...$`` formula written.

**The reference** (``sample.reference``): a number, or text whose last ``\\boxed{}`` or
GSM8K ``#### 42`` tail is taken when present, else the whole text; a list of references
is right when any item is.

**Comparison** (both sides cleaned of ``$``, ``\\left``/``\\right``, LaTeX spacing,
``\\text{}`` wrappers, currency signs, a trailing period; ``x = 5`` compares its right side):

- two numbers as written (integers, decimals, ``1,234``, fractions, percentages) compare
  exactly as rationals, so ``123456789`` is not ``123456700`` and ``0.5`` is ``1/2`` and
  ``18.90`` is ``\\$18.90``; a percentage also stands for its value / 100;
- a decimal against a value without a finite decimal form (``1/3``, ``\\pi``,
  ``\\sqrt 2``) is right within a relative tolerance ``rel_tol`` (default ``1e-6``:
  ``0.333333`` is ``1/3``, ``3.14`` is not ``\\pi``);
- anything else is compared symbolically by ``math-verify``
  (:mod:`reasonctl.rewards.math_judge`): ``\\sqrt{8}`` = ``2\\sqrt2``, ``\\{1,2\\}`` =
  ``\\{2,1\\}``, ``\\pm 2`` = ``2, -2``, intervals, equations, matrices; each comparison is
  limited to ``timeout_s`` seconds and counts as wrong when it runs out;
- an answer naming alternatives ("3 or 4") is a hedge and wrong, unless the reference
  itself has several values (``\\pm 2`` against ``2 or -2``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from reasonctl.rewards.answers import (
    ExactNumber,
    extract_tagged,
    find_boxes,
    last_number,
    number_spans,
    parse_exact,
)
from reasonctl.rewards.base import Judgement
from reasonctl.rewards.math_judge import SymbolicJudge, shared_judge

DEFAULT_REL_TOL = 1e-6
DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class MathRules:
    """How answers are read and compared (the options of the ``math`` reward)."""

    answer_tag: str | None = "answer"
    require_tag: bool = False
    require_boxed: bool = False
    rel_tol: float = DEFAULT_REL_TOL
    timeout_s: float = DEFAULT_TIMEOUT_S


def judge_math(text: str, reference: Any, rules: MathRules,
               judge: SymbolicJudge | None = None) -> Judgement:
    """Read the answer of ``text`` and score it against ``reference`` (see the module
    docstring); the score is ``None`` without a reference."""
    golds = reference_answers(reference)
    answer = predicted_answer(text, rules)
    if golds is None:
        return Judgement(answer, None)
    if answer is None:
        return Judgement(None, 0.0)
    judge = judge or shared_judge()
    right = any(answers_match(answer, gold, rel_tol=rules.rel_tol, timeout_s=rules.timeout_s,
                              judge=judge) for gold in golds)
    return Judgement(answer, 1.0 if right else 0.0)


# --- reading answers ----------------------------------------------------------------------------

_STATEMENT = re.compile(
    r"(?i:final\s+answer|answer)\s*(?:\*\*|__)?\s*(?i:is|would\s+be|will\s+be|should\s+be"
    r"|=|:)\s*(?:\*\*|__)?\s*[:=]?\s*(?P<body>[^\n]+)"
)
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\s+(?i:because|since|as|which|so)\s")
_INLINE_MATH = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_HEDGE_BETWEEN_BOXES = re.compile(
    r"^[\s,.$]*(?i:or|and/or)[\s,.$]*$|^\s*\\(?:text|mbox)\{\s*or\s*\}\s*$"
)


def predicted_answer(text: str, rules: MathRules) -> str | None:
    """The final answer written in ``text`` as a string, or ``None`` (see the module
    docstring); a hedge between two boxes returns the two joined by ``" or "``."""
    tagged = extract_tagged(text, rules.answer_tag) if rules.answer_tag else None
    if tagged is None and rules.require_tag:
        return None
    region = text if tagged is None else tagged
    boxes = find_boxes(region)
    if boxes:
        last = boxes[-1]
        if not last.content:
            return None
        if len(boxes) > 1:
            before = boxes[-2]
            between = region[before.end : last.start]
            if before.content != last.content and _HEDGE_BETWEEN_BOXES.match(between):
                return f"{before.content} or {last.content}"
        return last.content
    if rules.require_boxed:
        return None
    if tagged is not None:
        if not tagged:
            return None
        statement = _last_statement(tagged)
        return statement if statement is not None else tagged
    statement = _last_statement(text)
    if statement is not None:
        return statement
    return _last_written_answer(text)


def _last_statement(text: str) -> str | None:
    matches = list(_STATEMENT.finditer(text))
    if not matches:
        return None
    body = matches[-1].group("body")
    end = _SENTENCE_END.search(body)
    body = (body[: end.start()] if end else body).strip().strip("*_").strip()
    return body or None


def _last_written_answer(text: str) -> str | None:
    """The last number or inline formula of ``text``, whichever comes later."""
    spans = number_spans(text)
    formulas = [m for m in _INLINE_MATH.finditer(text) if any(m.groups())]
    number_at = spans[-1] if spans else None
    formula = formulas[-1] if formulas else None
    if formula is not None and (number_at is None or formula.end() >= number_at[1]):
        return next(g for g in formula.groups() if g)
    if number_at is not None:
        return text[number_at[0] : number_at[1]]
    return None


def reference_answers(reference: Any) -> list[str] | None:
    """The final answers a math reference accepts, or ``None`` without one."""
    if reference is None or isinstance(reference, bool):
        return None
    if isinstance(reference, (list, tuple)):
        answers = [a for item in reference for a in (reference_answers(item) or [])]
        return answers or None
    if isinstance(reference, (int, float)):
        return [repr(reference) if isinstance(reference, float) else str(reference)]
    text = str(reference)
    boxes = find_boxes(text)
    if boxes and boxes[-1].content:
        return [boxes[-1].content]
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    return [text] if text else None


# --- comparing answers --------------------------------------------------------------------------

_DELIMITERS = re.compile(r"^\s*(?:\$\$|\$|\\\(|\\\[)(.*?)(?:\$\$|\$|\\\)|\\\])\s*$", re.DOTALL)
_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm|mathbf|mbox|textrm|operatorname)\s*\{(.*)\}$",
                      re.DOTALL)
_NOISE = re.compile(r"\\left|\\right|\\displaystyle|\\[!,;: ]|\\quad|\\qquad")
_VARIABLE = re.compile(r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*$")
_HEDGE = re.compile(r"\s(?i:or|and/or)\s|\\(?:text|mbox)\{\s*or\s*\}|\\lor\b")
_MULTI_VALUED = re.compile(r",|\\pm|\\mp|\\cup|\s(?i:or|and)\s|\\(?:text|mbox)\{\s*(?:or|and)\s*\}")
_WORDS = re.compile(r"[A-Za-z]{2,}")
_WORD_ANSWER = re.compile(r"^[A-Za-z]{2,}(?:[ '-][A-Za-z]+)*$")


def clean_answer(text: str) -> str:
    """``text`` without math delimiters, ``\\text{}`` wrappers, sizing and spacing commands,
    currency signs, markdown bold and a trailing period."""
    cleaned = text.strip().replace("\u2212", "-").replace("{,}", ",")
    for _ in range(3):
        before = cleaned
        match = _DELIMITERS.match(cleaned)
        if match:
            cleaned = match.group(1).strip()
        cleaned = cleaned.strip("*_ ").rstrip(".;, ").strip()
        match = _WRAPPER.match(cleaned)
        if match and "{" not in match.group(1) and "}" not in match.group(1):
            cleaned = match.group(1).strip()
        if cleaned == before:
            break
    cleaned = _NOISE.sub(" ", cleaned).replace("\\$", "")
    cleaned = re.sub(r"^\$(?=\s*[-\d.])", "", cleaned)  # a dollar sign before an amount
    return " ".join(cleaned.split())


def answers_match(pred: str, gold: str, *, rel_tol: float, timeout_s: float,
                  judge: SymbolicJudge) -> bool:
    """Whether the predicted answer ``pred`` is the reference answer ``gold``."""
    pred, gold = clean_answer(pred), clean_answer(gold)
    if not pred or not gold:
        return False
    if _HEDGE.search(pred):
        if not _MULTI_VALUED.search(gold):
            return False
        pred = _HEDGE.sub(", ", pred)
    pred_number, gold_number = _as_number(pred), _as_number(gold)
    if pred_number is not None and gold_number is not None:
        return numbers_equal(pred_number, gold_number, rel_tol=rel_tol)
    if _key(pred) == _key(gold):
        return True
    if _WORD_ANSWER.match(pred) and _WORD_ANSWER.match(gold):  # "Monday", "north east"
        return pred.casefold() == gold.casefold()
    if pred_number is None and gold_number is not None and _is_prose(pred):
        number = last_number(pred)
        return number is not None and numbers_equal(number, gold_number, rel_tol=rel_tol)
    if gold_number is None and pred_number is not None and _is_prose(gold):
        number = last_number(gold)
        return number is not None and numbers_equal(pred_number, number, rel_tol=rel_tol)
    if judge.equivalent(gold, pred, timeout_s=timeout_s):
        return True
    decimal, other = _decimal_and_other(pred, pred_number, gold, gold_number)
    if decimal is not None and other is not None:
        value = judge.numeric_value(other, timeout_s=timeout_s)
        return value is not None and _within(decimal.value, value, rel_tol)
    return False


def numbers_equal(a: ExactNumber, b: ExactNumber, *, rel_tol: float = DEFAULT_REL_TOL) -> bool:
    """Exact equality of written numbers (a percentage also standing for its value / 100);
    a decimal against a fraction is equal within ``rel_tol`` of the fraction."""
    for left in a.values():
        for right in b.values():
            if left == right:
                return True
    kinds = {a.kind, b.kind}
    if kinds != {"decimal", "fraction"}:
        return False
    exact = a if a.kind == "fraction" else b
    approx = b if exact is a else a
    return any(_within(x, y, rel_tol) for x in approx.values() for y in exact.values())


def _within(approx: Fraction, exact: Fraction, rel_tol: float) -> bool:
    return abs(approx - exact) <= Fraction(str(rel_tol)) * abs(exact)


def _as_number(text: str) -> ExactNumber | None:
    number = parse_exact(text)
    if number is None and "=" in text:
        left, right = text.rsplit("=", 1)
        if _VARIABLE.match(left):
            number = parse_exact(right)
    return number


def _decimal_and_other(pred: str, pred_number: ExactNumber | None, gold: str,
                       gold_number: ExactNumber | None) -> tuple[ExactNumber | None, str | None]:
    if pred_number is not None and pred_number.kind == "decimal" and gold_number is None:
        return pred_number, gold
    if gold_number is not None and gold_number.kind == "decimal" and pred_number is None:
        return gold_number, pred
    return None, None


def _is_prose(text: str) -> bool:
    """Words outside LaTeX commands and no formula: ``18 dollars``, ``5 apples``."""
    return "\\" not in text and bool(_WORDS.search(text))


def _key(text: str) -> str:
    return re.sub(r"\s+", "", text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac"))
