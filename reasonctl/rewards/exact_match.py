"""``exact_match``: is the answer the reference string, after normalisation?"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.answers import extract_tagged, normalize_text
from reasonctl.rewards.base import Judgement, PerSampleReward, RewardConfig, check_tag


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
    """The answer (the tag's last block, else the whole text) and its score: 1.0 when it
    equals the reference (or any item of a list of references) after normalisation, else
    0.0; ``None`` without a reference."""
    answer = extract_tagged(text, config.answer_tag) if config.answer_tag else None
    if answer is None and config.require_tag:
        return Judgement(None, None if reference is None else 0.0)
    if answer is None:
        answer = text
    if reference is None:
        return Judgement(answer, None)
    references = reference if isinstance(reference, (list, tuple)) else [reference]
    options = {
        "ignore_case": config.ignore_case,
        "ignore_punctuation": config.ignore_punctuation,
        "collapse_whitespace": config.collapse_whitespace,
    }
    key = normalize_text(answer, **options)
    right = bool(key) and any(normalize_text(str(r), **options) == key for r in references)
    return Judgement(answer.strip() or None, 1.0 if right else 0.0)


class ExactMatchReward(PerSampleReward[ExactMatchConfig]):
    """1 when the answer equals the reference after normalisation, else 0."""

    def score_one(self, completion: str, sample: Sample) -> float | None:
        """Score one completion against ``sample.reference``."""
        return exact_match_judgement(completion, sample.reference, self.config).score
