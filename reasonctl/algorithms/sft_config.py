"""``[algorithm.sft]``: the options of supervised fine-tuning (:mod:`reasonctl.algorithms.sft`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SFTConfig(BaseModel):
    """``[algorithm.sft]``: options of supervised fine-tuning."""

    model_config = ConfigDict(extra="forbid")

    loss_reduction: Literal["token", "sample"] = Field(
        default="token",
        description="token: mean over all target tokens of the global batch; sample: mean "
        "over samples of each sample's mean token loss.",
    )
