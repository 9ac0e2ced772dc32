"""``exact_match``: is the answer the reference string, after normalisation?"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.answers import extract_tagged, normalize_text
from reasonctl.rewards.base import PerSampleReward, RewardConfig, check_tag


class ExactMatchConfig(RewardConfig):
    """Options of the ``exact_match`` reward."""

    answer_tag: str | None = Field(
        default="answer",
        description="Compare the content of this tag when present; null: the whole text.",
    )
    ignore_case: bool = True
    ignore_punctuation: bool = False
    collapse_whitespace: bool = True

    @field_validator("answer_tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        return check_tag(value)


def exact_match_score(text: str, reference: Any, config: ExactMatchConfig) -> float | None:
    """1.0 when the answer equals the reference (or any item of a list of references) after
    normalisation, else 0.0; ``None`` without a reference."""
    if reference is None:
        return None
    references = reference if isinstance(reference, (list, tuple)) else [reference]
    answer = extract_tagged(text, config.answer_tag) if config.answer_tag else None
    if answer is None:
        answer = text
    options = {
        "ignore_case": config.ignore_case,
        "ignore_punctuation": config.ignore_punctuation,
        "collapse_whitespace": config.collapse_whitespace,
    }
    key = normalize_text(answer, **options)
    return 1.0 if any(normalize_text(str(r), **options) == key for r in references) else 0.0


class ExactMatchReward(PerSampleReward[ExactMatchConfig]):
    """1 when the answer equals the reference after normalisation, else 0."""

    def score_one(self, completion: str, sample: Sample) -> float | None:
        """Score one completion against ``sample.reference``."""
        return exact_match_score(completion, sample.reference, self.config)
