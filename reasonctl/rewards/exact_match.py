"""``exact_match``: is the answer the reference string, after normalisation?"""

from __future__ import annotations

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


class ExactMatchConfig(RewardConfig):
    """Options of the ``exact_match`` reward."""

    answer_tag: str | None = Field(
        default="answer",
        description="Compare the last block of this tag when present; null: the whole text.",
    )
    require_tag: bool = Field(
        default=False, description="true: a completion without the answer block scores 0."
    )
    ignore_case: bool = True
    ignore_punctuation: bool = False
    collapse_whitespace: bool = True

    @field_validator("answer_tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        return check_tag(value)


def exact_match_judgement(text: str, reference: Any, config: ExactMatchConfig) -> Judgement:
    """The answer (the last answer block outside the ``<think>`` reasoning, else the text
    after the reasoning) and its score: 1.0 when it equals the reference (or any item of a
    list of references) after normalisation, else 0.0; ``None`` without a reference.
    Answer blocks with different answers score 0 (``several_answers``)."""
    options = {
        "ignore_case": config.ignore_case,
        "ignore_punctuation": config.ignore_punctuation,
        "collapse_whitespace": config.collapse_whitespace,
    }
    blocks = final_blocks(text, config.answer_tag) if config.answer_tag else []
    if reference is None:
        return Judgement((blocks[-1] if blocks else text).strip() or None, None,
                         Reason.NO_REFERENCE)
    if not blocks and config.require_tag:
        return Judgement(None, 0.0, Reason.MISSING_TAG)
    distinct = list(dict.fromkeys(normalize_text(b, **options) for b in blocks if b.strip()))
    if len(distinct) > 1:
        return Judgement(" | ".join(distinct), 0.0, Reason.SEVERAL_ANSWERS)
    answer = blocks[-1] if blocks else after_reasoning(text)
    key = normalize_text(answer, **options)
    if not key:
        return Judgement(None, 0.0, Reason.EMPTY_ANSWER if blocks else Reason.NO_ANSWER)
    references = reference if isinstance(reference, (list, tuple)) else [reference]
    right = any(normalize_text(str(r), **options) == key for r in references)
    return verdict(answer.strip() or None, right)


class ExactMatchReward(PerSampleReward[ExactMatchConfig]):
    """1 when the answer equals the reference after normalisation, else 0."""

    def judge_one(self, completion: str, sample: Sample) -> Judgement:
        """Read and score one completion against ``sample.reference``."""
        return exact_match_judgement(completion, sample.reference, self.config)
