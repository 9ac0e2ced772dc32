"""What every first-party reward shares: a strict config base and per-completion scoring."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from reasonctl.core.types import Sample

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


@dataclass(frozen=True)
class Judgement:
    """How a reward read one completion: the ``answer`` it found (``None``: none) and the
    ``score`` it gave (``None``: the reward does not apply, e.g. no reference).

    Evaluation reports the answer and counts a score of 1 as correct, so it judges exactly
    as the reward of the same name.
    """

    answer: str | None
    score: float | None


ConfigT = TypeVar("ConfigT", bound=RewardConfig)


class PerSampleReward(ABC, Generic[ConfigT]):
    """A batched reward that scores each completion on its own with :meth:`score_one`."""

    def __init__(self, config: ConfigT) -> None:
        self.config = config

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float | None]:
        """Score each completion against its sample."""
        return [self.score_one(c, s) for c, s in zip(completions, samples, strict=True)]

    @abstractmethod
    def score_one(self, completion: str, sample: Sample) -> float | None:
        """Score one completion; ``None`` when the reward does not apply."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
