"""``math``: is the final answer numerically (or literally) the reference answer?

The predicted answer is read from the ``<answer>`` block when there is one (configurable),
then from the last ``\\boxed{...}`` in it, else (unless ``require_boxed``) the last number
written. The reference is ``sample.reference``: a number, or text whose ``\\boxed{...}``
or GSM8K-style ``#### 42`` tail is taken when present, else the whole text.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.answers import (
    extract_boxed,
    extract_final_number,
    extract_tagged,
    math_answers_match,
    numbers_match,
)
from reasonctl.rewards.base import PerSampleReward, RewardConfig, check_tag


class MathConfig(RewardConfig):
    """Options of the ``math`` reward."""

    answer_tag: str | None = Field(
        default="answer",
        description="Look inside this tag when present; null: always the whole text.",
    )
    require_boxed: bool = Field(
        default=False, description="true: no \\boxed{} answer scores 0 (no last-number fallback)."
    )
    rel_tol: float = Field(default=1e-6, ge=0, description="Relative tolerance of equality.")
    abs_tol: float = Field(default=1e-9, ge=0, description="Absolute tolerance of equality.")

    @field_validator("answer_tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        return check_tag(value)


def reference_answer(reference: Any) -> str | float | None:
    """The final answer in a math reference (see the module docstring), or ``None``."""
    if reference is None or isinstance(reference, bool):
        return None
    if isinstance(reference, (int, float)):
        return float(reference)
    text = str(reference)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip() or None


def math_score(text: str, reference: Any, config: MathConfig) -> float | None:
    """1.0 for a correct final answer, 0.0 for a wrong or missing one, ``None`` without a
    reference."""
    expected = reference_answer(reference)
    if expected is None:
        return None
    tagged = extract_tagged(text, config.answer_tag) if config.answer_tag else None
    region = text if tagged is None else tagged
    tolerance = {"rel_tol": config.rel_tol, "abs_tol": config.abs_tol}
    boxed = extract_boxed(region)
    if boxed is not None:
        return 1.0 if math_answers_match(boxed, expected, **tolerance) else 0.0
    if config.require_boxed:
        return 0.0
    if tagged is not None and math_answers_match(tagged, expected, **tolerance):
        return 1.0
    number = extract_final_number(region)
    if number is None:
        return 0.0
    return 1.0 if numbers_match(number, expected, **tolerance) else 0.0


class MathReward(PerSampleReward[MathConfig]):
    """1 when the boxed (or last) number equals the reference answer, else 0."""

    def score_one(self, completion: str, sample: Sample) -> float | None:
        """Score one completion against ``sample.reference``."""
        return math_score(completion, sample.reference, self.config)
