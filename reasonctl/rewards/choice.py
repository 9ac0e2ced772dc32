"""``choice``: is the multiple-choice letter the completion picks the reference one?

Where the options and the correct answer come from, first found wins:

- ``sample.reference`` as a dict ``{"question": ..., "index2ans": {"A": "...", ...},
  "answer": ...}``;
- ``sample.meta["qa_pairs"]`` with the same layout (a dict, or a list whose first item is
  one), as in Cosmos-Reason RL data;
- ``sample.meta["choices"]`` (or ``"options"``): a list of option texts (lettered in order)
  or a dict letter -> text.

The correct answer is ``sample.reference`` when it is not a dict, else the layout's
``answer``. It may be a letter (``"B"``, ``"(B)"``), an option text, or an int index
(0 -> ``A``). Without options, a non-letter reference is compared as text.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.answers import extract_choice_letter, extract_tagged, normalize_text
from reasonctl.rewards.base import PerSampleReward, RewardConfig, check_tag


class ChoiceConfig(RewardConfig):
    """Options of the ``choice`` reward."""

    letters: str = Field(
        default=string.ascii_uppercase,
        description="Option letters in order; only the first N are valid for N options.",
    )
    answer_tag: str | None = Field(
        default="answer",
        description="Read the letter inside this tag when present; null: the whole text.",
    )

    @field_validator("letters")
    @classmethod
    def _letters(cls, value: str) -> str:
        if not value or not value.isalpha() or not value.isupper() or len(set(value)) != len(value):
            raise ValueError("letters must be distinct upper-case letters, e.g. 'ABCD'")
        return value

    @field_validator("answer_tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        return check_tag(value)


@dataclass
class ChoiceQuestion:
    """The options of a multiple-choice sample and its correct answer.

    ``options`` maps letters to option texts (empty when unknown); ``letter`` is the correct
    letter when it could be resolved, ``text`` the reference text otherwise.
    """

    options: dict[str, str]
    letter: str | None
    text: str | None

    def valid_letters(self, letters: str) -> str:
        """The letters a response may pick."""
        if self.options:
            return "".join(self.options)
        return letters


def choice_question(sample: Sample, letters: str = string.ascii_uppercase) -> ChoiceQuestion | None:
    """Resolve the options and the correct answer of ``sample`` (``None`` if it has none)."""
    layout = _layout(sample)
    options = _options(layout.get("index2ans") if layout else None, letters)
    if not options:
        options = _options(sample.meta.get("choices", sample.meta.get("options")), letters)
    answer: Any = sample.reference
    if isinstance(answer, Mapping) or answer is None:
        answer = layout.get("answer") if layout else None
    if answer is None or isinstance(answer, bool):
        return None
    valid = "".join(options) or letters
    if isinstance(answer, int):
        letter = valid[answer] if 0 <= answer < len(valid) else None
        return ChoiceQuestion(options, letter, None)
    text = str(answer).strip()
    letter = option_letter(text, options) or extract_choice_letter(text, letters=valid)
    return ChoiceQuestion(options, letter, None if letter else text)


def choice_score(text: str, sample: Sample, config: ChoiceConfig) -> float | None:
    """1.0 when the letter picked in ``text`` is the correct one, 0.0 otherwise, ``None``
    when the sample has no reference answer."""
    question = choice_question(sample, config.letters)
    if question is None:
        return None
    answer = extract_tagged(text, config.answer_tag) if config.answer_tag else None
    if answer is None:
        answer = text
    valid = question.valid_letters(config.letters)
    picked = extract_choice_letter(answer, letters=valid) or option_letter(
        answer, question.options
    )
    if question.letter is not None:
        return 1.0 if picked == question.letter else 0.0
    assert question.text is not None
    chosen = question.options.get(picked, answer) if picked else answer
    return 1.0 if normalize_text(chosen) == normalize_text(question.text) else 0.0


def _layout(sample: Sample) -> Mapping[str, Any] | None:
    if isinstance(sample.reference, Mapping):
        return sample.reference
    qa = sample.meta.get("qa_pairs")
    if isinstance(qa, list) and qa:
        qa = qa[0]
    return qa if isinstance(qa, Mapping) else None


def _options(raw: Any, letters: str) -> dict[str, str]:
    if isinstance(raw, Mapping):
        return {str(k).strip().upper(): str(v) for k, v in raw.items()}
    if isinstance(raw, (list, tuple)):
        return {letter: str(option) for letter, option in zip(letters, raw, strict=False)}
    return {}


def option_letter(text: str, options: Mapping[str, str]) -> str | None:
    """The letter whose option text equals ``text`` (case and spacing ignored)."""
    key = normalize_text(text)
    for letter, option in options.items():
        if normalize_text(option) == key:
            return letter
    return None


class ChoiceReward(PerSampleReward[ChoiceConfig]):
    """1 when the picked option letter matches the reference, 0 if not; None without one."""

    def score_one(self, completion: str, sample: Sample) -> float | None:
        """Score one completion against its sample's options and answer."""
        return choice_score(completion, sample, self.config)
