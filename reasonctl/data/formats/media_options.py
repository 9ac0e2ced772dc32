"""Config keys shared by the media-capable dataset formats."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.core.config import InputPath
from reasonctl.data.messages import MediaResolver


class MediaOptions(BaseModel):
    """``media_root``, ``fps`` and ``max_pixels`` of a dataset format.

    ``fps`` and ``max_pixels`` are defaults for media parts that do not set their own;
    left unset, the model's processor defaults apply.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    media_root: Annotated[str | None, InputPath("dir")] = Field(
        default=None,
        description="Directory that relative image/video paths resolve against "
        "(default: the data file's directory).",
    )
    fps: float | None = Field(default=None, gt=0, description="Video frames sampled per second.")
    max_pixels: int | None = Field(
        default=None, gt=0, description="Upper bound of pixels per image or video frame."
    )

    def resolver(self, base_dir: Path, format_name: str) -> MediaResolver:
        """A :class:`MediaResolver` for data files in ``base_dir``."""
        root = Path(self.media_root).expanduser().absolute() if self.media_root else None
        return MediaResolver(
            root=root,
            base_dir=base_dir.absolute(),
            fps=self.fps,
            max_pixels=self.max_pixels,
            option=f"data.{format_name}.media_root",
        )
