"""``format``: does the completion follow ``<think>...</think><answer>...</answer>``?"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.answers import extract_tagged
from reasonctl.rewards.base import Judgement, PerSampleReward, RewardConfig, check_tag


class FormatConfig(RewardConfig):
    """Options of the ``format`` reward."""

    think_tag: str = Field(default="think", description="Tag around the reasoning.")
    answer_tag: str = Field(default="answer", description="Tag around the final answer.")
    require_think: bool = Field(
        default=True, description="false: a completion with only the answer block is fine."
    )
    partial_credit: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Score when a non-empty answer block exists but the layout is not exact.",
    )

    @field_validator("think_tag", "answer_tag")
    @classmethod
    def _tag(cls, value: str) -> str:
        check_tag(value)
        return value


def format_score(text: str, config: FormatConfig) -> float:
    """1.0 when ``text`` is exactly a think block (optional if not required) followed by a
    non-empty answer block, with only whitespace around them and each tag used once;
    ``config.partial_credit`` when a non-empty answer block exists anyway; else 0.0.
    """
    think, answer = re.escape(config.think_tag), re.escape(config.answer_tag)
    think_block = rf"<{think}>.*?</{think}>\s*"
    if not config.require_think:
        think_block = rf"(?:{think_block})?"
    layout = re.fullmatch(rf"\s*{think_block}<{answer}>(.*?)</{answer}>\s*", text, re.DOTALL)
    tags_once = all(
        text.count(f"<{t}>") <= 1 and text.count(f"</{t}>") <= 1
        for t in (config.think_tag, config.answer_tag)
    )
    if layout is not None and tags_once and layout.group(1).strip():
        return 1.0
    return config.partial_credit if extract_tagged(text, config.answer_tag) else 0.0


class FormatReward(PerSampleReward[FormatConfig]):
    """1 when the completion is ``<think>reasoning</think><answer>answer</answer>``, else 0."""

    def judge_one(self, completion: str, sample: Sample) -> Judgement:
        """Score the layout of one completion (the sample is not needed): ``well_formed``,
        ``partial_credit`` (an answer block in another layout) or ``malformed``."""
        score = format_score(completion, self.config)
        if score == 1.0:
            return Judgement(None, score, "well_formed")
        has_answer = bool(extract_tagged(completion, self.config.answer_tag))
        return Judgement(None, score, "partial_credit" if has_answer else "malformed")
