"""``[algorithm.sft]``: the options of supervised fine-tuning (:mod:`reasonctl.algorithms.sft`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig


class SFTConfig(BaseModel):
    """``[algorithm.sft]``: options of supervised fine-tuning."""

    model_config = ConfigDict(extra="forbid")

    loss_reduction: Literal["token", "sample"] = Field(
        default="token",
        description="token: mean over all target tokens of the global batch; sample: mean "
        "over samples of each sample's mean token loss.",
    )

    def config_problems(self, config: RunConfig, *, world_size: int) -> list[str]:
        """``train.global_batch_size`` must split into micro-batches on every rank
        (:class:`~reasonctl.core.protocols.ValidatesRunConfig`)."""
        total, micro = config.train.global_batch_size, config.train.micro_batch_size
        step = micro * world_size
        if total % step == 0:
            return []
        fit = max(1, total // step) * step
        if world_size == 1:
            return [f"train.global_batch_size: {total} is not a multiple of train.micro_batch_size "
                    f"({micro}); use e.g. {fit}, or a micro_batch_size that divides {total}"]
        return [f"train.global_batch_size: {total} is not a multiple of {world_size} "
                f"data-parallel ranks x train.micro_batch_size ({micro}) = {step}; use e.g. {fit}"]
