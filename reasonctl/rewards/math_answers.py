"""Reading the final answer of a math response and deciding whether it is right.

Used by the ``math`` reward and by evaluation with ``answer_format = "math"``, so both judge
a response the same way. The reading is built so that a policy cannot raise its reward by
writing several answers and letting the reader pick the right one; ``docs/rewards.md``
has the rules with examples. Each outcome has a reason code
(:class:`~reasonctl.rewards.base.Reason`).

**Where the final answer is.**

1. The answer blocks (``<answer>...</answer>`` by default) written outside the
   ``<think>`` reasoning: blocks with different answers are ``several_answers``; otherwise
   the last block is the region read below (an empty one is ``empty_answer``). Without a
   block, ``require_tag`` gives ``missing_tag``; else the region is the text after the last
   ``</think>`` (the whole text when there is none).
2. If the region holds ``\\boxed{...}`` or ``\\fbox{...}``, the last box is the answer (an
   empty one is ``empty_answer``). Boxes with different answers are ``several_answers``,
   unless every pair is joined by "or" (``\\boxed{3} or \\boxed{4}``): a hedge.
3. Otherwise (``require_boxed`` gives ``missing_box``): an answer statement
   (``The answer is 5``, ``Final answer: 5``, ``**Answer:** 5``, a GSM8K ``#### 5`` line);
   statements with different answers are ``several_answers``. Inside an answer block
   without a statement the whole block is the answer.
4. Nothing else is an answer (``no_answer``): the last number of a response is not its
   answer unless ``last_number_fallback`` is on; then the last number or ``$...$`` formula
   written is read, and a run of numbers (``0 1 2 ... 10``) is a ``candidate_list``.

**What the answer may not be.** An answer naming alternatives ("3 or 4", "either 3 or
4") is a ``hedge`` and an answer listing several values (``1, 2, 3``, ``\\pm 2``) a
``candidate_list``, unless the reference itself has several values (``\\pm 2`` against
``2, -2``). An equation whose sides are different values (``x = 1 = 2``, ``1 = 2``) is a
``chained_equation``; a chain of equal values (``x = 2 + 3 = 5``) is its last value.

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
  limited to ``timeout_s`` seconds and counts as wrong (``undecided``) when it runs out;
- words with one number (``18 dollars``) compare by that number; with several numbers
  they are a ``candidate_list``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from reasonctl.rewards.answers import (
    ExactNumber,
    after_reasoning,
    final_blocks,
    find_boxes,
    last_number,
    number_spans,
    parse_exact,
)
from reasonctl.rewards.base import Judgement, Reason
from reasonctl.rewards.math_judge import SymbolicJudge, shared_judge

DEFAULT_REL_TOL = 1e-6
DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class MathRules:
    """How answers are read and compared (the options of the ``math`` reward)."""

    answer_tag: str | None = "answer"
    require_tag: bool = False
    require_boxed: bool = False
    last_number_fallback: bool = False
    rel_tol: float = DEFAULT_REL_TOL
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class MathReading:
    """The final answer read from a response, or why there is none: ``answer`` is the
    answer (``None``: none), ``shown`` what to report as extracted (the answers found when
    there are several) and ``reason`` the :class:`~reasonctl.rewards.base.Reason` when
    there is no answer."""

    answer: str | None
    reason: str | None = None
    shown: str | None = None

    @property
    def extracted(self) -> str | None:
        """What the reader found, for explanations."""
        return self.answer if self.answer is not None else self.shown


def judge_math(text: str, reference: Any, rules: MathRules,
               judge: SymbolicJudge | None = None) -> Judgement:
    """Read the answer of ``text`` and score it against ``reference`` (see the module
    docstring); the score is ``None`` without a reference."""
    judge = judge or shared_judge()
    golds = reference_answers(reference)
    reading = read_math_answer(text, rules, judge)
    if golds is None:
        return Judgement(reading.extracted, None, Reason.NO_REFERENCE)
    if reading.answer is None:
        assert reading.reason is not None
        return Judgement(reading.extracted, 0.0, reading.reason)
    outcomes = [compare_answer(reading.answer, gold, rules, judge) for gold in golds]
    if any(right for right, _ in outcomes):
        return Judgement(reading.answer, 1.0, Reason.CORRECT)
    return Judgement(reading.answer, 0.0, outcomes[0][1])


# --- reading answers ----------------------------------------------------------------------------

_STATEMENT = re.compile(
    r"(?i:final\s+answer|answer)\s*(?:\*\*|__)?\s*(?i:is|would\s+be|will\s+be|should\s+be"
    r"|=|:)[ \t]*(?:\*\*|__)?[ \t]*[:=]?[ \t]*(?=[^\s])"
    r"|^[ \t]*####[ \t]*(?P<gsm8k>)",
    re.MULTILINE,
)
"""Where an answer statement's answer starts (it runs to the end of its line)."""
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\s+(?i:because|since|as|which|so)\s")
_INLINE_MATH = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_HEDGE_BETWEEN_BOXES = re.compile(
    r"^[\s,.$]*(?i:or|and/or)(?:\s+(?i:maybe|possibly|perhaps))?[\s,.$]*$"
    r"|^\s*\\(?:text|mbox)\{\s*or\s*\}\s*$"
)
_HEDGE_AFTER = re.compile(r"^\s*[.,;:]?\s*\(?\s*(?i:or|and/or)\b\s*(?i:maybe|possibly|perhaps)?"
                          r"\s*(?P<other>[^\n]*)")
_LIST_GAP = re.compile(r"^(?:\s|,|;|\.\.\.|\\[lc]?dots|\\ldots|\\quad|\\,|\b(?i:or|and)\b)*$")


def read_math_answer(text: str, rules: MathRules, judge: SymbolicJudge | None = None
                     ) -> MathReading:
    """The final answer written in ``text``, or the reason there is none (see the module
    docstring); two boxes joined by "or" read as ``"a or b"`` (a hedge, judged against the
    reference)."""
    judge = judge or shared_judge()
    region, tagged = text, False
    if rules.answer_tag:
        blocks = final_blocks(text, rules.answer_tag)
        several = _distinct([b for b in blocks if b], rules, judge)
        if len(several) > 1:
            return MathReading(None, Reason.SEVERAL_ANSWERS, " | ".join(several))
        if blocks:
            region, tagged = blocks[-1], True
            if not region:
                return MathReading(None, Reason.EMPTY_ANSWER)
        elif rules.require_tag:
            return MathReading(None, Reason.MISSING_TAG)
    if not tagged:
        region = after_reasoning(text)
    boxes = find_boxes(region)
    if boxes:
        return _boxed_answer(region, boxes, rules, judge)
    if rules.require_boxed:
        return MathReading(None, Reason.MISSING_BOX)
    statement = _stated_answer(region, rules, judge)
    if statement is not None:
        return statement
    if tagged:
        return MathReading(region)
    if rules.last_number_fallback:
        return _last_written_answer(region)
    return MathReading(None, Reason.NO_ANSWER)


def _boxed_answer(region: str, boxes: Sequence[Any], rules: MathRules,
                  judge: SymbolicJudge) -> MathReading:
    last = boxes[-1]
    if not last.content:
        return MathReading(None, Reason.EMPTY_ANSWER)
    filled = [box for box in boxes if box.content]
    distinct = _distinct([box.content for box in filled], rules, judge)
    if len(distinct) == 1:
        return MathReading(last.content)
    joined_by_or = all(_HEDGE_BETWEEN_BOXES.match(region[a.end : b.start])
                       for a, b in zip(filled, filled[1:], strict=False))
    if joined_by_or:
        return MathReading(" or ".join(distinct))
    return MathReading(None, Reason.SEVERAL_ANSWERS, " | ".join(distinct))


def _stated_answer(region: str, rules: MathRules, judge: SymbolicJudge) -> MathReading | None:
    """The answer of the region's answer statements, ``None`` without one."""
    answers = []
    for match in _STATEMENT.finditer(region):
        line_end = region.find("\n", match.end())
        body = region[match.end() : line_end if line_end >= 0 else len(region)]
        if match.group("gsm8k") is not None:
            answers.append(body.strip().strip("*_").strip())
            continue
        end = _SENTENCE_END.search(body)
        written = body[: end.start()] if end else body
        stated = written.strip().strip("*_").strip()
        if not stated:
            continue
        rest = _HEDGE_AFTER.match(body[len(written) :])
        if rest is not None and rest.group("other").strip():  # "The answer is 5. Or 6."
            other = _SENTENCE_END.split(rest.group("other"))[0].strip().strip("*_").strip()
            stated = f"{stated} or {other}"
        answers.append(stated)
    answers = [a for a in answers if a]
    if not answers:
        return None
    distinct = _distinct(answers, rules, judge)
    if len(distinct) > 1:
        return MathReading(None, Reason.SEVERAL_ANSWERS, " | ".join(distinct))
    return MathReading(answers[-1])


def _last_written_answer(text: str) -> MathReading:
    """The last number or inline formula of ``text``, whichever comes later; a run of
    numbers with only separators between them is a candidate list."""
    spans = number_spans(text)
    formulas = [m for m in _INLINE_MATH.finditer(text) if any(m.groups())]
    number_at = spans[-1] if spans else None
    formula = formulas[-1] if formulas else None
    if formula is not None and (number_at is None or formula.end() >= number_at[1]):
        return MathReading(next(g for g in formula.groups() if g))
    if number_at is None:
        return MathReading(None, Reason.NO_ANSWER)
    run = [number_at]
    for span in reversed(spans[:-1]):
        gap = text[span[1] : run[0][0]]
        if not gap or not _LIST_GAP.match(gap):
            break
        run.insert(0, span)
    if len(run) > 1:
        return MathReading(None, Reason.CANDIDATE_LIST, text[run[0][0] : run[-1][1]])
    return MathReading(text[number_at[0] : number_at[1]])


def _distinct(answers: Sequence[str], rules: MathRules, judge: SymbolicJudge) -> list[str]:
    """``answers`` without repeats of the same value (``1/2`` repeats ``0.5``), in order."""
    out: list[str] = []
    for answer in answers:
        if not any(_same_value(answer, seen, rules, judge) for seen in out):
            out.append(answer)
    return out


def _same_value(a: str, b: str, rules: MathRules, judge: SymbolicJudge) -> bool:
    """Whether two answers of one response are the same value (compared as against a
    reference)."""
    a, b = clean_answer(a), clean_answer(b)
    return _key(a) == _key(b) or _match(a, b, rules, judge) == Reason.CORRECT


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
_EITHER = re.compile(r"^(?i:either)\s+")
_HEDGE = re.compile(r"\s(?i:or|and/or)\s|\\(?:text|mbox)\{\s*or\s*\}|\\lor\b")
_MULTI_VALUED = re.compile(r",|;|\\pm|\\mp|\\cup|\s(?i:or|and)\s"
                           r"|\\(?:text|mbox)\{\s*(?:or|and)\s*\}")
_ELLIPSIS = re.compile(r"\.\.\.|\\[lc]?dots\b|\\ldots\b|…")
_WORDS = re.compile(r"[A-Za-z]{2,}")
_WORD_ANSWER = re.compile(r"^[A-Za-z]{2,}(?:[ '-][A-Za-z]+)*$")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_THOUSANDS_BY_SPACES = re.compile(r"^-?\d{1,3}(?:[ \u2009\u202f]\d{3})+(?:\.\d+)?$")


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


def compare_answer(pred: str, gold: str, rules: MathRules, judge: SymbolicJudge
                   ) -> tuple[bool, str]:
    """Whether the predicted answer ``pred`` is the reference answer ``gold``, and the
    :class:`~reasonctl.rewards.base.Reason` (``correct``, ``wrong``, ``hedge``,
    ``candidate_list``, ``chained_equation`` or ``undecided``)."""
    pred, gold = clean_answer(pred), clean_answer(gold)
    if not pred or not gold:
        return False, Reason.WRONG
    gold_multi = _is_multi_valued_reference(gold)
    if _EITHER.match(pred) or _HEDGE.search(pred):
        if not gold_multi:
            return False, Reason.HEDGE
        pred = _HEDGE.sub(", ", _EITHER.sub("", pred))
    if not gold_multi and _lists_values(pred):
        return False, Reason.CANDIDATE_LIST
    chained = _resolve_chain(pred, rules, judge)
    if chained is None:
        return False, Reason.CHAINED_EQUATION
    reason = _match(chained, gold, rules, judge)
    return reason == Reason.CORRECT, reason


def _match(pred: str, gold: str, rules: MathRules, judge: SymbolicJudge) -> str:
    """``correct`` or ``wrong``; ``undecided`` when the symbolic comparison ran out of
    time; ``candidate_list`` for words naming several numbers against a number."""
    rel_tol = rules.rel_tol
    pred_number, gold_number = _as_number(pred), _as_number(gold)
    if pred_number is not None and gold_number is not None:
        return _verdict(numbers_equal(pred_number, gold_number, rel_tol=rel_tol))
    if _key(pred) == _key(gold):
        return Reason.CORRECT
    if _WORD_ANSWER.match(pred) and _WORD_ANSWER.match(gold):  # "Monday", "north east"
        return _verdict(pred.casefold() == gold.casefold())
    if pred_number is None and gold_number is not None and _is_prose(pred):
        values = {number.value for start, end in number_spans(pred)
                  if (number := parse_exact(pred[start:end])) is not None}
        if len(values) > 1:  # "5 apples and 3 pears"
            return Reason.CANDIDATE_LIST
        number = last_number(pred)
        return _verdict(number is not None
                        and numbers_equal(number, gold_number, rel_tol=rel_tol))
    if gold_number is None and pred_number is not None and _is_prose(gold):
        number = last_number(gold)
        return _verdict(number is not None
                        and numbers_equal(pred_number, number, rel_tol=rel_tol))
    equal = judge.equivalence(gold, pred, timeout_s=rules.timeout_s)
    if equal:
        return Reason.CORRECT
    decimal, other = _decimal_and_other(pred, pred_number, gold, gold_number)
    if decimal is not None and other is not None:
        value = judge.numeric_value(other, timeout_s=rules.timeout_s)
        return _verdict(value is not None and _within(decimal.value, value, rel_tol))
    return Reason.UNDECIDED if equal is None else Reason.WRONG


def _verdict(right: bool) -> str:
    return Reason.CORRECT if right else Reason.WRONG


def _is_multi_valued_reference(gold: str) -> bool:
    """Whether a reference names several values (``2, -2``, ``\\pm 2``, ``\\{1, 2\\}``,
    ``(1, 2)``); a number with thousands separators is one value."""
    if parse_exact(gold) is not None:
        return False
    return bool(_MULTI_VALUED.search(gold) or _ELLIPSIS.search(gold))


def _lists_values(pred: str) -> bool:
    """Whether an answer lists several values at its top level: ``1, 2, 3``, ``x=1; x=2``,
    ``0 1 2 3``, ``1, 2, \\ldots, 10``, ``\\pm 2`` (a tuple ``(1, 2)``, a set and
    ``1 000 000`` are one value)."""
    spans = number_spans(pred)
    gaps = [pred[a[1] : b[0]] for a, b in zip(spans, spans[1:], strict=False)]
    if gaps and all(gap and not gap.strip() for gap in gaps) \
            and not pred[: spans[0][0]].strip() and not pred[spans[-1][1] :].strip() \
            and not _THOUSANDS_BY_SPACES.match(pred):
        return True  # "0 1 2 3"
    if parse_exact(pred) is not None:
        return False
    if _ELLIPSIS.search(pred) or re.search(r"\\(?:pm|mp)\b|±|∓", pred):
        return True
    return len(_top_level_split(pred, ",;")) > 1


def _top_level_split(text: str, separators: str) -> list[str]:
    """``text`` split at ``separators`` outside brackets and braces (``\\{``, ``\\}``
    count as braces); empty parts are dropped."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        if depth == 0 and char in separators:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def _equation_sides(text: str) -> list[str]:
    """The sides of ``text`` split at top-level ``=`` signs (not ``<=``, ``>=``, ``!=``,
    ``==``); one side when it is no equation."""
    sides, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif char == "=" and depth == 0:
            before = text[index - 1] if index else " "
            after = text[index + 1] if index + 1 < len(text) else " "
            if before in "<>!:=" or after == "=":
                continue
            sides.append(text[start:index].strip())
            start = index + 1
    sides.append(text[start:].strip())
    return sides


def _resolve_chain(pred: str, rules: MathRules, judge: SymbolicJudge) -> str | None:
    """``pred`` with a chain of equal values reduced to its last value (``x = 2+3 = 5``
    -> ``x = 5``); ``None`` when the sides are different values (``x = 1 = 2``,
    ``1 = 2``)."""
    parts = _top_level_split(pred, ",;")
    if len(parts) > 1:  # a system: "x = 1, y = 2"
        return pred if all(_resolve_chain(p, rules, judge) is not None for p in parts) else None
    sides = _equation_sides(pred)
    if len(sides) < 2 or any(not side for side in sides):
        return pred
    named = bool(re.search(r"[A-Za-z]", _LATEX_COMMAND.sub("", sides[0])))
    values = sides[1:] if named else sides
    if len(values) < 2:
        return pred
    if not all(_same_value(value, values[-1], rules, judge) for value in values[:-1]):
        return None
    return f"{sides[0]} = {values[-1]}" if named else values[-1]


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
