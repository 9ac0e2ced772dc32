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
from reasonctl.rewards.answers import after_reasoning, final_blocks, normalize_text
from reasonctl.rewards.base import (
    Judgement,
    PerSampleReward,
    Reason,
    RewardConfig,
    check_tag,
    verdict,
)
from reasonctl.rewards.choice_answers import option_letter, read_choice


class ChoiceConfig(RewardConfig):
    """Options of the ``choice`` reward."""

    letters: str = Field(
        default=string.ascii_uppercase,
        description="Option letters in order; only the first N are valid for N options.",
    )
    answer_tag: str | None = Field(
        default="answer",
        description="Read the letter in the last block of this tag when present; null: the "
        "whole text.",
    )
    require_tag: bool = Field(
        default=False, description="true: a completion without the answer block scores 0."
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
    letter = option_letter(text, options) or read_choice(text, valid).letter
    return ChoiceQuestion(options, letter, None if letter else text)


def choice_judgement(text: str, sample: Sample, config: ChoiceConfig) -> Judgement:
    """The letter ``text`` commits to (:mod:`reasonctl.rewards.choice_answers`) and its
    score: 1.0 for the correct option (``correct``), 0.0 otherwise (``wrong``, or
    ``hedge``, ``several_answers``, ``no_answer``, ``missing_tag``, ``empty_answer``),
    ``None`` when the sample has no reference answer (``no_reference``).

    The region read is the last answer block written outside the ``<think>`` reasoning;
    blocks picking different letters are ``several_answers``. Without a block it is the
    text after the reasoning."""
    question = choice_question(sample, config.letters)
    valid = question.valid_letters(config.letters) if question else config.letters
    options = question.options if question else None
    blocks = final_blocks(text, config.answer_tag) if config.answer_tag else []
    if not blocks and config.require_tag:
        return _judged(question, Judgement(None, 0.0, Reason.MISSING_TAG))
    if len(blocks) > 1:
        readings = [read_choice(block, valid, options) for block in blocks if block]
        picked = list(dict.fromkeys(r.letter for r in readings if r.letter is not None))
        if len(picked) > 1:
            return _judged(question, Judgement(" | ".join(picked), 0.0,
                                               Reason.SEVERAL_ANSWERS))
    region = blocks[-1] if blocks else after_reasoning(text)
    if blocks and not region:
        return _judged(question, Judgement(None, 0.0, Reason.EMPTY_ANSWER))
    reading = read_choice(region, valid, options)
    if question is None:
        return Judgement(reading.letter, None, Reason.NO_REFERENCE)
    if reading.letter is None and reading.reason != Reason.NO_ANSWER:
        return Judgement(reading.named, 0.0, reading.reason or Reason.NO_ANSWER)
    if question.letter is not None:
        if reading.letter is None:
            return Judgement(None, 0.0, Reason.NO_ANSWER)
        return verdict(reading.letter, reading.letter == question.letter)
    assert question.text is not None
    chosen = question.options.get(reading.letter, region) if reading.letter else region
    right = normalize_text(chosen) == normalize_text(question.text)
    return verdict(reading.letter or region.strip() or None, right)


def _judged(question: ChoiceQuestion | None, judgement: Judgement) -> Judgement:
    """``judgement``, or no score (``no_reference``) when the sample has no answer."""
    if question is None:
        return Judgement(judgement.answer, None, Reason.NO_REFERENCE)
    return judgement


def _layout(sample: Sample) -> Mapping[str, Any] | None:
    if isinstance(sample.reference, Mapping):
        return sample.reference
    qa = sample.meta.get("qa_pairs")
    if isinstance(qa, list) and qa:
        qa = qa[0]
    return qa if isinstance(qa, Mapping) else None


def _options(raw: Any, letters: str) -> dict[str, str]:
    if isinstance(raw, Mapping):
        return {str(k).strip().upper(): str(v) for k, v in raw.items() if v is not None}
    if isinstance(raw, (list, tuple)):
        return {letter: str(option) for letter, option in zip(letters, raw, strict=False)}
    return {}


class ChoiceReward(PerSampleReward[ChoiceConfig]):
    """1 when the picked option letter matches the reference, 0 if not; None without one."""

    def judge_one(self, completion: str, sample: Sample) -> Judgement:
        """Read and score one completion against its sample's options and answer."""
        return choice_judgement(completion, sample, self.config)
