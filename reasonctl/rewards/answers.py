"""Answer extraction and comparison shared by the rewards and by evaluation.

Every function here is a pure function of text, with no configuration object, so any
component can reuse it:

- :func:`extract_tagged` — the content of the last ``<tag>...</tag>`` block;
- :func:`extract_boxed` — the content of the last ``\\boxed{...}`` (nested braces);
- :func:`extract_choice_letter` — a multiple-choice letter from free text;
- :func:`parse_number` / :func:`extract_final_number` — numbers written as integers,
  decimals, ``1,234``, ``3/4``, ``\\frac{3}{4}``, ``50%``;
- :func:`numbers_match` / :func:`math_answers_match` — numeric or normalised comparison;
- :func:`normalize_text` — case, whitespace and punctuation folding.
"""

from __future__ import annotations

import math
import re
import string

LETTERS = string.ascii_uppercase
"""The default multiple-choice letters, ``A`` to ``Z``."""


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


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

    Returns ``None`` when there is no box or its braces never close.
    """
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    begin = starts[-1]
    depth = 1
    for index in range(begin, len(text)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index].strip()
    return None


# --- multiple choice --------------------------------------------------------------------------

_WHOLE_LETTER = re.compile(r"^[\s*_(\[]*([A-Za-z])[\s*_)\].:]*$")
_ANSWER_STATEMENT = re.compile(
    r"(?i:answer|option|choice)(?:\s+(?i:is|would\s+be|should\s+be))?\s*[:\-]?\s*"
    r"[*_(\[]*([A-Z])(?![A-Za-z0-9])"
)
_LEADING_LETTER = re.compile(r"^[\s*_\[(]*([A-Z])[*_]*[.):\]]")
_PARENTHESISED = re.compile(r"\(([A-Z])\)")


def extract_choice_letter(
    text: str, n_options: int | None = None, letters: str = LETTERS
) -> str | None:
    """The multiple-choice letter a response picks, or ``None`` when it names none.

    Valid letters are ``letters[:n_options]`` (all of ``letters`` when ``n_options`` is
    ``None``); a letter outside them is ignored. The first rule that finds a valid letter
    wins:

    1. the whole text is one letter, optionally decorated: ``B``, ``b``, ``(B)``, ``B.``,
       ``B)``, ``**B**``;
    2. an explicit statement, last one first: ``Answer: B``, ``the answer is (B)``,
       ``option B``;
    3. a letter opening the text: ``B. a dog``, ``B) a dog``, ``(B) a dog``;
    4. the last non-empty line is one letter (as in rule 1);
    5. the last parenthesised capital letter: ``... so (B)``.

    Only rule 1 and 4 accept lower case, since ``a`` is also a word.
    """
    valid = letters[:n_options] if n_options is not None else letters
    if not text.strip() or not valid:
        return None

    def whole(candidate: str) -> str | None:
        match = _WHOLE_LETTER.match(candidate)
        letter = match.group(1).upper() if match else None
        return letter if letter is not None and letter in valid else None

    found = whole(text)
    if found:
        return found
    for match in reversed(list(_ANSWER_STATEMENT.finditer(text))):
        if match.group(1) in valid:
            return match.group(1)
    match = _LEADING_LETTER.match(text)
    if match and match.group(1) in valid:
        return match.group(1)
    lines = [line for line in text.splitlines() if line.strip()]
    if lines:
        found = whole(lines[-1])
        if found:
            return found
    for match in reversed(list(_PARENTHESISED.finditer(text))):
        if match.group(1) in valid:
            return match.group(1)
    return None


# --- numbers ----------------------------------------------------------------------------------

_SIGN = r"(?:(?<![\w)\]}])-)?"
_DECIMAL = r"(?:\d+(?:\.\d+)?|\.\d+)"
_NUMBER_TOKEN = re.compile(
    rf"{_SIGN}\\[dt]?frac\{{\s*-?{_DECIMAL}\s*\}}\{{\s*-?{_DECIMAL}\s*\}}"
    rf"|{_SIGN}\d+(?:\.\d+)?\s*/\s*\d+(?:\.\d+)?(?![\d.])"
    rf"|{_SIGN}\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?(?:\s*\\?%)?"
    rf"|{_SIGN}{_DECIMAL}(?:[eE][-+]?\d+)?(?:\s*\\?%)?"
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_SLASH = re.compile(r"^(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\$|\\displaystyle")
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°")


def parse_number(text: str) -> float | None:
    """Parse ``text`` as one number, or return ``None`` when it is anything else.

    Accepts integers and decimals (``-3``, ``0.5``, ``.5``, ``1e-3``), thousands separators
    (``1,234.5``), fractions (``3/4``, ``\\frac{3}{4}``, ``\\dfrac``, ``\\tfrac``), a
    percent sign (``50%`` or ``50\\%`` parses as ``50``; see :func:`numbers_match`), a
    leading ``$``, degrees (``30^\\circ``), LaTeX spacing and ``\\text{...}`` units, and a
    trailing period.
    """
    parsed = _parse(text)
    return parsed[0] if parsed is not None else None


def _parse(text: str) -> tuple[float, bool] | None:
    """``(value, is_percent)`` for a whole-string number, else ``None``."""
    cleaned = _TEXT_UNIT.sub("", text)
    cleaned = _DEGREES.sub("", _LATEX_NOISE.sub("", cleaned))
    cleaned = cleaned.replace("\\%", "%").replace(" ", "").rstrip(".")
    percent = cleaned.endswith("%")
    if percent:
        cleaned = cleaned[:-1]
    if not cleaned:
        return None
    value = _parse_plain(cleaned)
    if value is None:
        frac = _FRAC.match(cleaned)
        slash = _SLASH.match(cleaned)
        if frac:
            value = _divide(_parse_plain(frac.group(2)), _parse_plain(frac.group(3)))
            if value is not None and frac.group(1):
                value = -value
        elif slash:
            value = _divide(_parse_plain(slash.group(1)), _parse_plain(slash.group(2)))
    if value is None or not math.isfinite(value):
        return None
    return value, percent


def _parse_plain(text: str) -> float | None:
    if _THOUSANDS.match(text):
        return float(text.replace(",", ""))
    if _PLAIN.match(text):
        return float(text)
    return None


def _divide(top: float | None, bottom: float | None) -> float | None:
    if top is None or bottom is None or bottom == 0:
        return None
    return top / bottom


def extract_final_number(text: str) -> float | None:
    """The last number written in ``text`` (any form :func:`parse_number` accepts), or ``None``.

    ``"so she pays $1,234.50 in total."`` gives ``1234.5``; ``"#### 72"`` gives ``72.0``.
    """
    for match in reversed(list(_NUMBER_TOKEN.finditer(text))):
        value = parse_number(match.group(0))
        if value is not None:
            return value
    return None


def numbers_match(
    predicted: str | float, reference: str | float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> bool | None:
    """Whether two numbers are equal within tolerance; ``None`` if either is not a number.

    Strings are parsed with :func:`parse_number`. A percentage matches both its written
    value and that value over 100, so ``"50%"`` matches ``50`` and ``0.5``.
    """
    left = _candidates(predicted)
    right = _candidates(reference)
    if not left or not right:
        return None
    return any(math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol) for a in left for b in right)


def _candidates(value: str | float) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)] if math.isfinite(value) else []
    parsed = _parse(str(value))
    if parsed is None:
        return []
    number, percent = parsed
    return [number, number / 100] if percent else [number]


def math_answers_match(
    predicted: str, reference: str | float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> bool:
    """Compare a predicted final answer with a reference one.

    Numerically (see :func:`numbers_match`) when both are numbers, also trying the right
    side of an ``x = 5`` style answer; otherwise as strings with LaTeX spacing, ``\\left``/
    ``\\right``, dollar signs, spaces and a trailing period removed.
    """
    for candidate in _answer_forms(predicted):
        matched = numbers_match(candidate, reference, rel_tol=rel_tol, abs_tol=abs_tol)
        if matched is not None:
            return matched
    return _math_key(predicted) == _math_key(str(reference))


def _answer_forms(predicted: str) -> list[str]:
    forms = [predicted]
    if "=" in predicted:
        forms.append(predicted.rsplit("=", 1)[1])
    return forms


def _math_key(text: str) -> str:
    cleaned = _LATEX_NOISE.sub("", text)
    cleaned = cleaned.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", cleaned).rstrip(".")


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
