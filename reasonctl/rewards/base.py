"""What every first-party reward shares: a strict config base and per-completion scoring."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from reasonctl.core import reward_set
from reasonctl.core.types import Explanation, Sample

TAG_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")


class RewardConfig(BaseModel):
    """Base of the reward config models: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


def check_tag(value: str | None) -> str | None:
    """Validate an XML-like tag name such as ``answer`` (``None`` passes through)."""
    if value is not None and not TAG_NAME.match(value):
        raise ValueError(
            f"{value!r} is not a tag name: use letters, digits, '_', '-' or '.', without "
            "angle brackets (e.g. 'answer')"
        )
    return value


class Reason:
    """The reason codes of the first-party rule rewards (``docs/rewards.md`` explains each).

    A score of 1 says ``correct``; every other code comes with 0 (or ``None`` for
    ``no_reference``).
    """

    CORRECT = "correct"
    WRONG = "wrong"
    NO_REFERENCE = "no_reference"
    NO_ANSWER = "no_answer"
    MISSING_TAG = "missing_tag"
    MISSING_BOX = "missing_box"
    EMPTY_ANSWER = "empty_answer"
    SEVERAL_ANSWERS = "several_answers"
    HEDGE = "hedge"
    CANDIDATE_LIST = "candidate_list"
    CHAINED_EQUATION = "chained_equation"
    UNDECIDED = "undecided"
    SCORED = reward_set.SCORED
    NOT_APPLICABLE = reward_set.NOT_APPLICABLE


@dataclass(frozen=True)
class Judgement:
    """How a reward read one completion: the ``answer`` it found (``None``: none), the
    ``score`` it gave (``None``: the reward does not apply, e.g. no reference) and the
    ``reason`` (a :class:`Reason` code).

    Evaluation reports the answer and counts a score of 1 as correct, so it judges exactly
    as the reward of the same name.
    """

    answer: str | None
    score: float | None
    reason: str = Reason.SCORED

    def explanation(self) -> Explanation:
        """This judgement as an :class:`~reasonctl.core.types.Explanation`."""
        return Explanation(self.score, self.answer, self.reason)


def verdict(answer: str | None, right: bool) -> Judgement:
    """``answer`` scored 1 (``correct``) when ``right``, else 0 (``wrong``)."""
    return Judgement(answer, 1.0 if right else 0.0, Reason.CORRECT if right else Reason.WRONG)


ConfigT = TypeVar("ConfigT", bound=RewardConfig)


class PerSampleReward(ABC, Generic[ConfigT]):
    """A batched reward that scores each completion on its own with :meth:`judge_one`
    (what it read, its score and why); :meth:`explain` gives the explanations."""

    def __init__(self, config: ConfigT) -> None:
        self.config = config

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float | None]:
        """Score each completion against its sample."""
        return [self.score_one(c, s) for c, s in zip(completions, samples, strict=True)]

    def explain(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[Explanation]:
        """Score each completion and say what was read and why
        (:class:`~reasonctl.core.protocols.ExplainsScores`)."""
        return [self.judge_one(c, s).explanation()
                for c, s in zip(completions, samples, strict=True)]

    def score_one(self, completion: str, sample: Sample) -> float | None:
        """Score one completion; ``None`` when the reward does not apply."""
        return self.judge_one(completion, sample).score

    @abstractmethod
    def judge_one(self, completion: str, sample: Sample) -> Judgement:
        """Read and score one completion."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
