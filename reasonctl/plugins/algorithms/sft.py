"""The ``sft`` algorithm plugin: supervised fine-tuning on chat data (``[algorithm.sft]``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reasonctl import hookimpl


class SFTConfig(BaseModel):
    """``[algorithm.sft]``: options of supervised fine-tuning."""

    model_config = ConfigDict(extra="forbid")

    loss_reduction: Literal["token", "sample"] = Field(
        default="token",
        description="token: mean over all target tokens of the global batch; sample: mean "
        "over samples of each sample's mean token loss.",
    )


def build_sft(config: SFTConfig | None, **_: Any) -> Any:
    """Supervised fine-tuning on the assistant turns of chat samples."""
    from reasonctl.algorithms.sft import SFTAlgorithm

    config = config or SFTConfig()
    return SFTAlgorithm(loss_reduction=config.loss_reduction)


@hookimpl
def register_algorithms(register: Any) -> None:
    """Register the ``sft`` algorithm."""
    register("sft", build_sft, config_model=SFTConfig)
