"""Rule-based rewards on generated media: ``brightness`` and ``color``.

Both declare ``media_type = "video"`` (:class:`~reasonctl.core.protocols.ScoresMedia`): they
receive uint8 ``[T, H, W, 3]`` frames (an image model's samples as one-frame clips) and
score the mean over all pixels, so they are cheap, deterministic and learnable, the
quickstart's task for a diffusion model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.base import RewardConfig


class BrightnessConfig(RewardConfig):
    """Options of ``brightness``."""

    target: float | None = Field(
        default=None, ge=0, le=1,
        description="None: the mean brightness in [0, 1] (brighter is better); a value: "
        "1 - |brightness - target|.")


class BrightnessReward:
    """The mean pixel value of the frames, in ``[0, 1]`` (or closeness to ``target``)."""

    media_type: Literal["video"] = "video"

    def __init__(self, config: BrightnessConfig | None = None) -> None:
        self.config = config or BrightnessConfig()

    def __call__(self, completions: Sequence[Any], samples: Sequence[Sample]
                 ) -> list[float | None]:
        """One score per clip."""
        out: list[float | None] = []
        for frames in completions:
            value = float(np.asarray(frames, dtype=np.float64).mean() / 255.0)
            target = self.config.target
            out.append(value if target is None else 1.0 - abs(value - target))
        return out


class ColorConfig(RewardConfig):
    """Options of ``color``."""

    rgb: list[int] = Field(default_factory=lambda: [255, 0, 0], min_length=3, max_length=3,
                           description="Target colour as [r, g, b] in 0..255.")

    @field_validator("rgb")
    @classmethod
    def _channels(cls, rgb: list[int]) -> list[int]:
        if any(not 0 <= c <= 255 for c in rgb):
            raise ValueError("each channel must be in 0..255")
        return rgb


class ColorReward:
    """``1 - mean |pixel - rgb| / 255``: how close the frames are to a colour."""

    media_type: Literal["video"] = "video"

    def __init__(self, config: ColorConfig | None = None) -> None:
        self.config = config or ColorConfig()
        self.target = np.asarray(self.config.rgb, dtype=np.float64)

    def __call__(self, completions: Sequence[Any], samples: Sequence[Sample]
                 ) -> list[float | None]:
        """One score per clip."""
        return [1.0 - float(np.abs(np.asarray(f, dtype=np.float64) - self.target).mean()) / 255
                for f in completions]
