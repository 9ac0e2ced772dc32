"""Registers the ``video_text`` dataset format of diffusion RL
(:mod:`reasonctl.diffusion.datasets`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reasonctl import hookimpl

if TYPE_CHECKING:
    from reasonctl.core.registry import Registrar


@hookimpl
def register_datasets(register: Registrar) -> None:
    """Register ``video_text``."""
    from reasonctl.diffusion.datasets import VideoTextConfig, build_video_text_dataset

    register("video_text", build_video_text_dataset, config_model=VideoTextConfig,
             description="videos/*.mp4 + metas/*.txt captions (+ text_embeddings/) for "
             "diffusion RL.")
