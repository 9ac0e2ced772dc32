"""Text helpers shared by the rewards and by evaluation: tags, boxes, numbers, folding.

Every function here is a pure function of text, with no configuration object:

- :func:`extract_tagged` — the content of the last ``<tag>...</tag>`` block;
- :func:`final_blocks` / :func:`after_reasoning` — the answer blocks written outside the
  ``<think>`` reasoning, and the text after that reasoning;
- :func:`find_boxes` / :func:`extract_boxed` — ``\\boxed{...}`` and ``\\fbox{...}``
  contents (nested braces);
- :func:`parse_exact` / :func:`parse_number` — one number written as an integer, a
  decimal, ``1,234``, ``3/4``, ``\\frac{3}{4}`` or ``50%``, kept exact (a
  :class:`~fractions.Fraction`) with the way it was written;
- :func:`last_number` — the last number written in a text;
- :func:`normalize_text` — case, whitespace and punctuation folding.

Multiple-choice letters are read by :mod:`reasonctl.rewards.choice_answers`, math answers
by :mod:`reasonctl.rewards.math_answers`.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

# --- tags and boxes ---------------------------------------------------------------------------


def extract_tagged(text: str, tag: str) -> str | None:
    """The stripped content of the last complete ``<tag>...</tag>`` block, or ``None``.

    The block is the last closing tag and the nearest opening tag before it, so a mention
    of ``<tag>`` earlier in the text (e.g. inside the reasoning) does not leak into the
    result. Tag names are matched exactly (case-sensitive).
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    end = text.rfind(closing)
    if end < 0:
        return None
    start = text.rfind(opening, 0, end)
    if start < 0:
        return None
    return text[start + len(opening) : end].strip()


REASONING_TAG = "think"
"""The tag around a response's reasoning: what is written inside it is never a final answer."""


def _reasoning_spans(text: str) -> list[tuple[int, int]]:
    opening, closing = f"<{REASONING_TAG}>", f"</{REASONING_TAG}>"
    spans = []
    start = text.find(opening)
    while start >= 0:
        end = text.find(closing, start)
        if end < 0:
            break
        spans.append((start, end + len(closing)))
        start = text.find(opening, end)
    return spans


def final_blocks(text: str, tag: str) -> list[str]:
    """The stripped contents of every complete ``<tag>...</tag>`` block of ``text`` that is
    not inside a ``<think>...</think>`` block, in order.

    Several blocks with different contents are several final answers (the rewards score
    them 0); a block mentioned inside the reasoning is part of the reasoning.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    reasoning = _reasoning_spans(text)
    blocks = []
    for match in re.finditer(re.escape(closing), text):
        start = text.rfind(opening, 0, match.start())
        if start < 0 or any(a <= start < b for a, b in reasoning):
            continue
        if blocks and start < blocks[-1][1]:  # "<a>x</a>y</a>": one block, closed twice
            continue
        blocks.append((start, match.end()))
    return [text[start + len(opening) : end - len(closing)].strip() for start, end in blocks]


def after_reasoning(text: str) -> str:
    """``text`` after its last ``</think>``, where the final answer is written (the whole
    text when it has no reasoning block)."""
    closing = f"</{REASONING_TAG}>"
    end = text.rfind(closing)
    return text if end < 0 else text[end + len(closing) :]


@dataclass(frozen=True)
class Box:
    """One ``\\boxed{...}`` in a text: where it starts and ends, and its stripped content."""

    start: int
    end: int
    content: str


_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_BARE = re.compile(r"\\boxed\s+([^\s${}\\]+)")


def find_boxes(text: str) -> list[Box]:
    """Every complete ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) and ``\\boxed 5``
    in ``text``, in order; a box whose braces never close is left out."""
    boxes = []
    for match in _BOX_OPEN.finditer(text):
        depth = 1
        for index in range(match.end(), len(text)):
            char = text[index]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    boxes.append(Box(match.start(), index + 1,
                                     text[match.end() : index].strip()))
                    break
    boxes += [Box(m.start(), m.end(), m.group(1)) for m in _BOX_BARE.finditer(text)]
    boxes.sort(key=lambda box: box.start)
    # a box inside another (\boxed{\boxed{5}}) is part of the outer one
    return [b for b in boxes if not any(o.start < b.start and b.end <= o.end for o in boxes)]


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), or ``None``."""
    boxes = find_boxes(text)
    return boxes[-1].content if boxes else None


# --- numbers ----------------------------------------------------------------------------------

NumberKind = Literal["integer", "decimal", "fraction"]


@dataclass(frozen=True)
class ExactNumber:
    """A number as written: its exact ``value``, how it was written (``kind``) and whether
    it carried a percent sign (``50%`` has the value 50)."""

    value: Fraction
    kind: NumberKind
    percent: bool = False

    def values(self) -> list[Fraction]:
        """The values it may stand for: a percentage also stands for its value / 100."""
        return [self.value, self.value / 100] if self.percent else [self.value]


_SIGN = r"(?:(?<![\w)\]}])-)?"
_DECIMAL = r"(?:\d+(?:\.\d+)?|\.\d+)"
_NUMBER_TOKEN = re.compile(
    rf"{_SIGN}\\[dt]?frac\{{\s*-?{_DECIMAL}\s*\}}\{{\s*-?{_DECIMAL}\s*\}}"
    rf"|{_SIGN}\\[dt]?frac(?:\d\d|\d\{{\d+\}}|\{{\d+\}}\d)"
    rf"|{_SIGN}\d+(?:\.\d+)?\s*/\s*\d+(?:\.\d+)?(?!\.?\d)"
    rf"|{_SIGN}\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?(?![\d,])(?:\s*\\?%)?"
    rf"|{_SIGN}{_DECIMAL}(?:[eE][-+]?\d+)?(?:\s*\\?%)?"
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac(?:\{([^{}]+)\}|(\d))(?:\{([^{}]+)\}|(\d))$")
_SLASH = re.compile(r"^(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\\displaystyle|\\mathrm\{\s*\}|~")
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm|textrm)\s*\{[^{}]*\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°|\\degree")
_CURRENCY = re.compile(r"\\\$|\$|€|£|¥|\\euro|\\pounds")


def parse_exact(text: str) -> ExactNumber | None:
    """Parse ``text`` as one number, exactly, or return ``None`` when it is anything else.

    Accepts integers and decimals (``-3``, ``0.5``, ``.5``, ``1e-3``), thousands separators
    (``1,234.5``; ``1{,}234``), fractions (``3/4``, ``\\frac{3}{4}``, ``\\frac34``,
    ``\\dfrac``, ``\\tfrac``), a percent sign (``50%``, ``50\\%``), currency signs (``$``,
    ``\\$``), degrees (``30^\\circ``), LaTeX spacing, ``\\text{...}`` units and a trailing
    period.
    """
    cleaned = _TEXT_UNIT.sub("", text.replace("{,}", ",").replace("\u2212", "-"))
    cleaned = _CURRENCY.sub("", _DEGREES.sub("", _LATEX_NOISE.sub("", cleaned)))
    cleaned = cleaned.replace("\\%", "%").replace(" ", "").rstrip(".")
    percent = cleaned.endswith("%")
    if percent:
        cleaned = cleaned[:-1]
    if not cleaned:
        return None
    plain = _parse_plain(cleaned)
    if plain is not None:
        kind: NumberKind = "decimal" if re.search(r"[.eE]", cleaned) else "integer"
        return ExactNumber(plain, kind, percent)
    frac, slash = _FRAC.match(cleaned), _SLASH.match(cleaned)
    value = None
    if frac:
        top = _parse_plain(frac.group(2) or frac.group(3))
        value = _divide(top, _parse_plain(frac.group(4) or frac.group(5)))
        if value is not None and frac.group(1):
            value = -value
    elif slash:
        value = _divide(_parse_plain(slash.group(1)), _parse_plain(slash.group(2)))
    return ExactNumber(value, "fraction", percent) if value is not None else None


def parse_number(text: str) -> float | None:
    """:func:`parse_exact` as a float (``50%`` gives ``50.0``), or ``None``."""
    parsed = parse_exact(text)
    if parsed is None:
        return None
    value = float(parsed.value)
    return value if math.isfinite(value) else None


def _parse_plain(text: str) -> Fraction | None:
    if _THOUSANDS.match(text):
        return Fraction(text.replace(",", ""))
    if _PLAIN.match(text):
        try:
            return Fraction(text)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _divide(top: Fraction | None, bottom: Fraction | None) -> Fraction | None:
    if top is None or bottom is None or bottom == 0:
        return None
    return top / bottom


def last_number(text: str) -> ExactNumber | None:
    """The last number written in ``text`` (any form :func:`parse_exact` accepts).

    ``"so she pays $1,234.50 in total."`` gives ``1234.5``; ``"#### 72"`` gives ``72``;
    ``"The answer is 1/2."`` gives ``1/2``.
    """
    for match in reversed(list(_NUMBER_TOKEN.finditer(text))):
        value = parse_exact(match.group(0))
        if value is not None:
            return value
    return None


def number_spans(text: str) -> list[tuple[int, int]]:
    """Where numbers are written in ``text`` (start, end), in order."""
    return [m.span() for m in _NUMBER_TOKEN.finditer(text) if parse_exact(m.group(0))]


# --- text -------------------------------------------------------------------------------------

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_text(
    text: str,
    *,
    ignore_case: bool = True,
    ignore_punctuation: bool = False,
    collapse_whitespace: bool = True,
) -> str:
    """``text`` folded for comparison: stripped, then optionally lower-cased, without ASCII
    punctuation, and with runs of whitespace collapsed to one space."""
    if ignore_case:
        text = text.casefold()
    if ignore_punctuation:
        text = text.translate(_PUNCTUATION)
    if collapse_whitespace:
        text = " ".join(text.split())
    return text.strip()
