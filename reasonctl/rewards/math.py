"""``math``: is the final answer mathematically the reference answer?

How the answer is read and compared is :mod:`reasonctl.rewards.math_answers` (the
``<answer>`` block or the last box, answer statements, GSM8K ``####`` references, exact
integers, a relative tolerance for decimals, symbolic equivalence with ``math-verify``
under a time limit; several answers, hedges, candidate lists and chained equations score
0, and a bare trailing number is no answer unless ``last_number_fallback``); evaluation
with ``answer_format = "math"`` uses the same rules and options.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.base import Judgement, PerSampleReward, RewardConfig, check_tag
from reasonctl.rewards.math_answers import (
    DEFAULT_REL_TOL,
    DEFAULT_TIMEOUT_S,
    MathRules,
    judge_math,
)


class MathConfig(RewardConfig):
    """Options of the ``math`` reward."""

    answer_tag: str | None = Field(
        default="answer",
        description="Read the last block of this tag when present; null: the whole text.",
    )
    require_tag: bool = Field(
        default=False, description="true: a completion without the answer block scores 0."
    )
    require_boxed: bool = Field(
        default=False, description="true: no \\boxed{} answer scores 0 (no other reading)."
    )
    last_number_fallback: bool = Field(
        default=False,
        description="true: a response without an answer block, box or answer statement is "
        "read by its last number (or $...$ formula); false: it has no answer and scores 0.",
    )
    rel_tol: float = Field(
        default=DEFAULT_REL_TOL, ge=0, lt=1,
        description="Relative tolerance of a decimal against a fraction or a constant like "
        "\\pi; numbers written as integers or decimals compare exactly.",
    )
    timeout_s: float = Field(
        default=DEFAULT_TIMEOUT_S, gt=0,
        description="Time limit of one symbolic comparison; when it runs out the answer "
        "scores 0 (and the same comparison is not retried for 5 minutes).",
    )

    @field_validator("answer_tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        return check_tag(value)

    def rules(self) -> MathRules:
        """These options as :class:`~reasonctl.rewards.math_answers.MathRules`."""
        return MathRules(answer_tag=self.answer_tag, require_tag=self.require_tag,
                         require_boxed=self.require_boxed,
                         last_number_fallback=self.last_number_fallback, rel_tol=self.rel_tol,
                         timeout_s=self.timeout_s)


def math_judgement(text: str, sample: Sample, config: MathConfig) -> Judgement:
    """The answer read from ``text`` and its score against ``sample.reference``."""
    return judge_math(text, sample.reference, config.rules())


class MathReward(PerSampleReward[MathConfig]):
    """1 when the final answer equals the reference answer, else 0; None without one."""

    def judge_one(self, completion: str, sample: Sample) -> Judgement:
        """Read and score one completion against ``sample.reference``."""
        return math_judgement(completion, sample, self.config)
