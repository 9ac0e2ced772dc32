"""Reading which option a multiple-choice response commits to.

Used by the ``choice`` reward and by evaluation with ``answer_format = "letter"`` (or
``"reasoning"`` on multiple-choice samples), so both read a response the same way. The
rules of :func:`read_choice`, on the text it is given (the caller passes the last
``<answer>`` block when the format asks for one):

1. A **commitment** is one of:

   - the whole text is a letter, optionally decorated: ``B``, ``b``, ``(B)``, ``B.``,
     ``**B**``, ``[B]``, ``Option B``;
   - an answer statement: ``The answer is B``, ``Answer: B``, ``**Answer:** B``,
     ``Final answer: (B)``, ``The correct option is B``, ``the answer is option B``,
     ``I choose B``, ``I'd say B``, ``B is correct``, ``Option B is the right answer``;
     an answer statement whose claim (up to "not", "but", "rather than") marks exactly
     one letter in parentheses: ``Answer: the bus (B), not the truck (C)``;
   - a conclusion ending its sentence with a letter: ``So B.``, ``Therefore, (B).``,
     ``It's B.``, ``I think it is B.``;
   - ``\\boxed{B}`` (or ``\\boxed{\\text{B}}``);
   - a letter opening the text: ``B. a dog``, ``(B) a dog``, ``B) a dog``, ``B: ...``,
     ``B - a dog``, ``B, because ...``;
   - a letter alone as the last line or the last sentence: ``...\\n(B)``, ``Not A. Not
     C. B.``.

   A letter followed by its own option's text reads as the letter alone (``(B) a dog is
   correct`` is ``(B) is correct``). A statement after "not", "n't", "if" or "whether" is
   no commitment (``the answer is not A``, ``if the answer were A``), nor is a mere
   mention (``Option C is a truck``).
2. Every commitment must name the same one letter. A commitment naming two or more
   different letters (``(B) or (C)``, ``B. or C.``, ``The answer is B, or possibly C``,
   ``Answer: B (or C)``, ``either A or B``, ``Answer: B, C``) is a ``hedge``; a list of
   letters (``A B C D``, ``(A) (B) (C) (D)``, ``A. B. C. D.``) too. Commitments to
   different letters (``The answer is B.`` ... ``Final answer: C``) are
   ``several_answers``. Either way the response picks nothing and scores 0.
3. Letters are case-insensitive; a lower-case ``a`` or ``i`` followed by a word is read as
   the English word (``the answer is a truck``). A letter outside the question's options
   is not a commitment.
4. An answer statement whose sentence opens with one option's text (whole words) picks
   that option, even when the text starts like a letter (``Answer: A bus`` and ``The
   answer is A bus, since ...`` pick the option "a bus").
   Without a commitment, an option's text counts: the whole text, or the body of an answer
   statement, equal to one option's text (case, spacing and final punctuation ignored).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from reasonctl.rewards.answers import find_boxes, normalize_text
from reasonctl.rewards.base import Reason

_DECOR_OPEN = r"(?:\*\*|__|\*|_)?[(\[]?\s*"
_DECOR_CLOSE = r"\s*[)\]]?(?:\*\*|__|\*|_)?"
_TOKEN = re.compile(rf"{_DECOR_OPEN}(?<![A-Za-z0-9])([A-Za-z]){_DECOR_CLOSE}(?![A-Za-z0-9])")
_SEPARATOR = re.compile(
    r"(?:\s*[.,;:]?\s*\(?\s*\b(?:and/or|or)\b|\s*(?:,|/|&|;|\band\b))"
    r"(?:\s+(?:maybe|possibly|perhaps|even|also))?(?:\s+(?:option|choice))?\s*",
    re.IGNORECASE,
)
"""Between two letters of one commitment: ``,``, ``/``, ``and``, ``or`` (also after a
period or inside parentheses: ``B. or C``, ``B (or C)``, ``B, or possibly C``)."""
_BARE_LIST = re.compile(
    r"^\s*(?:\*\*)?[(\[]?([A-Z])[)\]]?\.?(?:\*\*)?"
    r"(?:\s+(?:\*\*)?[(\[]?[A-Z][)\]]?\.?(?:\*\*)?)+\s*$"
)
"""A line of upper-case letters alone: ``A B C D``, ``(A) (B) (C)``, ``A. B. C. D.``."""
_WORD_AFTER = re.compile(r"\s+(?!(?i:or|and)\b)[A-Za-z]{2,}")
_STATEMENT = re.compile(
    r"(?i:(?:final\s+|correct\s+|right\s+|best\s+)?(?:answer|option|choice))"
    r"\s*(?:\*\*|__)?\s*(?:(?i:is|would\s+be|should\s+be|must\s+be|will\s+be)\s*:?|[:=\-])"
    r"\s*(?:\*\*|__)?\s*"
    r"|(?i:\b(?:choose|chose|pick|select|go\s+with|going\s+with))\s+"
    r"|(?i:\b(?:i'd|i\s+would|i'll|i\s+will)\s+(?:say|guess))\s+"
)
_CONCLUSION = re.compile(
    r"(?i:\b(?:therefore|thus|hence|so|it's|it\s+is|it\s+must\s+be|it\s+should\s+be))"
    r"\s*,?\s*"
)
_BODY_PREFIX = re.compile(
    r"^(?i:(?:(?:most\s+)?likely|probably|clearly|definitely|obviously|either)\s+)?"
    r"(?i:(?:the\s+)?(?:option|choice|letter)\s+)?"
)
_CORRECT_AFTER = re.compile(
    r"(?:(?i:option|choice)\s+)?(?<![A-Za-z0-9])\(?([A-Z])\)?\s+(?i:is|would\s+be)\s+"
    r"(?i:(?:the\s+)?(?:(?:correct|right|best)\b|(?:final\s+)?answer\b))"
)
_LEADING = re.compile(
    r"^\s*(?:\*\*|__)?(?:\(([A-Za-z])\)|\[([A-Za-z])\]"
    r"|([A-Z])(?:\s*[.):]|\s+[-\u2013]\s|,\s*(?i:because|since|as|given)\b)"
    r"|([a-z])\))"
)
_BLOCKERS = re.compile(r"(?i:\bnot\b|n't\b|\bif\b|\bwhether\b)[^.\n;,]{0,12}$")
_MARKED = re.compile(r"\(([A-Z])\)")
_CONTRAST = re.compile(r"(?i:\b(?:not|but|rather\s+than|instead\s+of|unlike)\b)")
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n|;")


@dataclass(frozen=True)
class ChoiceReading:
    """What a response picked: ``letter`` (``None`` when it picked nothing), and when it
    picked nothing, why (``reason``: ``no_answer``, ``hedge`` or ``several_answers``) and
    the letters it named (``named``, e.g. ``"B or C"``)."""

    letter: str | None
    reason: str | None = None
    named: str | None = None


def read_choice(text: str, valid: str, options: Mapping[str, str] | None = None
                ) -> ChoiceReading:
    """The letter ``text`` commits to among ``valid`` letters (module docstring rules)."""
    options = options or {}
    if not text.strip():
        return ChoiceReading(None, Reason.NO_ANSWER)
    text = _without_option_texts(text, options)
    commitments = _commitments(text, valid, options)
    for letters in commitments:
        if len(set(letters)) > 1:
            return ChoiceReading(None, Reason.HEDGE, " or ".join(dict.fromkeys(letters)))
    picked = list(dict.fromkeys(letter for letters in commitments for letter in letters))
    if not picked:
        candidates = [text, *_statement_bodies(text)]
        picked = list(dict.fromkeys(letter for candidate in candidates
                                    if (letter := option_letter(candidate, options))))
    if len(picked) > 1:
        return ChoiceReading(None, Reason.SEVERAL_ANSWERS, " | ".join(picked))
    if picked:
        return ChoiceReading(picked[0])
    return ChoiceReading(None, Reason.NO_ANSWER)


def option_letter(text: str, options: Mapping[str, str]) -> str | None:
    """The letter whose option text equals ``text`` (case, spacing, final punctuation and
    markdown emphasis ignored)."""
    key = _option_key(text)
    if not key:
        return None
    for letter, option in options.items():
        if _option_key(option) == key:
            return letter
    return None


def _without_option_texts(text: str, options: Mapping[str, str]) -> str:
    """``text`` with an option's text dropped where it follows its own letter (``(B) a
    bus`` -> ``(B)``, ``B. a bus`` -> ``B``), so the letter reads as it would alone."""
    for letter, option in options.items():
        words = option.strip().rstrip(".!;,").strip()
        if not words or not letter.isalpha():
            continue
        body = r"\s+".join(re.escape(word) for word in words.split())
        mark = rf"(?:\({letter}\)|\[{letter}\]|{letter}\)?)"
        text = re.sub(
            rf"(?<![A-Za-z0-9])({mark})(?:\s*[.:\-\u2013])?\s*(?:\*\*)?(?i:{body})(?:\*\*)?"
            r"(?![A-Za-z0-9])", r"\1", text)
    return text


def _named_option(sentence: str, options: Mapping[str, str]) -> str | None:
    """The letter of the (longest) option whose text opens ``sentence`` as whole words
    (``A bus, since ...`` names the option "a bus")."""
    key = _option_key(sentence)
    best: tuple[int, str] | None = None
    for letter, option in options.items():
        option_key = _option_key(option)
        if not option_key or not key.startswith(option_key):
            continue
        if len(key) > len(option_key) and key[len(option_key)].isalnum():
            continue
        if best is None or len(option_key) > best[0]:
            best = (len(option_key), letter)
    return best[1] if best else None


def _option_key(text: str) -> str:
    return normalize_text(text.strip().strip("*_").strip().rstrip(".!;,").strip("*_"))


def _commitments(text: str, valid: str, options: Mapping[str, str]) -> list[list[str]]:
    """The letters of each commitment, in the order they are written."""
    found: list[tuple[int, list[str]]] = []
    whole = _whole_chain(text, valid)
    if whole:
        return [whole]
    for match in _STATEMENT.finditer(text):
        if _BLOCKERS.search(text[max(0, match.start() - 40) : match.start()]):
            continue
        bare = re.match(r"(?i:option|choice)\b", match.group(0))  # "the first option is"
        named = None if bare else _named_option(_sentence(text[match.end() :]), options)
        letters = [named] if named else _leading_chain(text[match.end() :], valid)
        if not letters and not bare:  # "Answer: the bus (B)"
            claim = _CONTRAST.split(_sentence(text[match.end() :]))[0]
            marked = set(_MARKED.findall(claim)) & set(valid)
            letters = sorted(marked) if len(marked) == 1 else None
        if letters:
            found.append((match.start(), letters))
    for match in _CONCLUSION.finditer(text):
        if _BLOCKERS.search(text[max(0, match.start() - 40) : match.start()]):
            continue
        body = text[match.end() :]
        letters = _leading_chain(body, valid)
        _, end = _chain(_BODY_PREFIX.sub("", body))
        rest = _BODY_PREFIX.sub("", body)[end:]
        if letters and re.match(r"\s*(?:[.!\n]|$)", rest):
            found.append((match.start(), letters))
    for match in _CORRECT_AFTER.finditer(text):
        if match.group(1) in valid and not _BLOCKERS.search(text[max(0, match.start() - 40):
                                                                  match.start()]):
            found.append((match.start(), [match.group(1)]))
    for box in find_boxes(text):
        content = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r" \1 ",
                         box.content).strip()
        letters = _whole_chain(content, valid)
        if letters:
            found.append((box.start, letters))
    leading = _LEADING.match(text)
    if leading:
        letter = next(g for g in leading.groups() if g).upper()
        if letter in valid:
            found.append((leading.start(), [letter]))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    sentences = re.split(r"(?<=[.!?])\s+", lines[-1]) if lines else []
    if len(lines) > 1 or len(sentences) > 1:  # "...\n(B)", "Not A. Not C. B."
        letters = _whole_chain(sentences[-1], valid)
        if letters:
            found.append((text.rindex(sentences[-1]), letters))
        for line in reversed(lines[:-1] if letters and len(sentences) == 1 else []):
            above = _whole_chain(line, valid)  # "A\nB\nC\nD": one letter per line
            if not above:
                break
            found.append((text.rindex(line), above))
    found.sort(key=lambda item: item[0])
    return [letters for _, letters in found]


def _chain(text: str, pos: int = 0) -> tuple[list[str], int]:
    """The letters of a chain of letters at ``pos`` (``B``, ``(B) or (C)``, ``A/B``) and
    where it ends; a later letter followed by a word starts a new clause and is left out
    (``B, C is wrong``)."""
    match = _TOKEN.match(text, pos)
    if match is None:
        return [], pos
    letters, end = [match.group(1)], match.end()
    while True:
        separator = _SEPARATOR.match(text, end)
        token = _TOKEN.match(text, separator.end()) if separator else None
        if token is None or _WORD_AFTER.match(text, token.end()):
            break
        letters.append(token.group(1))
        end = token.end()
    return [letter.upper() for letter in letters], end


def _whole_chain(text: str, valid: str) -> list[str] | None:
    """The letters when ``text`` is nothing but a chain of letters (``Option B`` too)."""
    stripped = _BODY_PREFIX.sub("", text.strip()).rstrip(".!").strip()
    listed = _listed_letters(stripped)
    if listed:
        return listed
    letters, end = _chain(stripped)
    if not letters or end != len(stripped):
        return None
    return None if len(letters) == 1 and letters[0] not in valid else letters


def _listed_letters(text: str) -> list[str] | None:
    """The letters of a line that is only upper-case letters (``A B C D``)."""
    line = text.split("\n", 1)[0]
    if not _BARE_LIST.match(line):
        return None
    return re.findall(r"[A-Z]", line)


def _leading_chain(body: str, valid: str) -> list[str] | None:
    """The letters of a chain opening ``body`` (the text after an answer statement)."""
    body = _BODY_PREFIX.sub("", body)
    listed = _listed_letters(body)
    if listed:
        return listed
    letters, end = _chain(body)
    if not letters:
        return None
    first = _TOKEN.match(body)
    assert first is not None
    if first.group(1) in "ai" and "(" not in first.group(0) and _WORD_AFTER.match(body, end):
        return None  # "the answer is a truck"
    return None if len(letters) == 1 and letters[0] not in valid else letters


def _statement_bodies(text: str) -> list[str]:
    """The text after each answer statement, up to the end of its sentence."""
    return [_sentence(text[match.end() :]) for match in _STATEMENT.finditer(text)]


def _sentence(body: str) -> str:
    """``body`` (the text after an answer statement) up to the end of its sentence."""
    body = _BODY_PREFIX.sub("", body)
    end = _SENTENCE_END.search(body)
    return body[: end.start()] if end else body
